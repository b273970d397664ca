"""The classes a round is built from: replace one to change one mechanism.

The sandbox's cheating reducers (dtrain/sandbox/adversary.py) and the tests' faulty peers
(tests/faults.py) are made this way, and run the honest code path everywhere else.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtrain.swarm.averaging.butterfly import OurParts
from dtrain.swarm.averaging.kept import SentContribution
from dtrain.swarm.averaging.reply import ReducerReply
from dtrain.swarm.averaging.share import ShareChecks
from dtrain.swarm.commitments import CommittedChecks


@dataclass(frozen=True)
class Mechanisms:
    sending: type = OurParts  # what we send each reducer (butterfly.py)
    share: type = ShareChecks  # our share, as its reducer (share.py)
    reply: type = ReducerReply  # the reducer's reply, both ways (reply.py)
    kept: type = SentContribution  # what we sent, and the members' questions about it (kept.py)
    round_checks: type = CommittedChecks  # a round's checks on dtrain's own protocol (commitments.py)
