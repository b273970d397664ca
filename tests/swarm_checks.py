"""What a real all-reduce round guarantees, checked element by element.

hivemind can lose a reducer's part on a loaded machine (docs/swarm.md, "fraction_averaged"):
the senders of that part keep their local values for it and record the reducer as FAIL.
Tests of the averaging numerics therefore assert the round's contract, which holds whether
or not a part was lost, instead of hoping that none was:

* wherever two peers both received an average, they hold the same bits;
* each peer's ``fraction_averaged`` is the share of its vector that changed;
* a peer that averaged less than everything names a failed peer and a reason.

The elements every peer averaged are returned, for the test to check the values.
"""

from __future__ import annotations

from typing import Sequence

import torch

from dtrain.swarm.records import Outcome, RoundRecord

# Matchmaking timing for loopback tests on a loaded 2-core machine. A follower gives up on its
# leader request_timeout after its own expiry; a leader that sends "begin" later (an event
# loop stalled for a second under load) still counts that follower in the group, and the
# round then misses one peer ("could not find a group" on its side). 1.5 s of slack makes
# that improbable; request_timeout must stay below min_matchmaking_time or hivemind's
# matchmaking can deadlock.
LOOPBACK_MATCHMAKING = dict(min_matchmaking_time_s=3.0, request_timeout_s=1.5)
# What such a follower's record says.
MATCHMAKING_MISS = "could not find a group"


def retry_matchmaking_miss(attempt, tries: int = 2):
    """``attempt()`` (one round of real peers from fresh copies of their tensors, returning a
    tuple whose last item is the records), run again while a peer's record says its matchmaking
    missed the group: the race above, which is not what a test of the round's rules checks."""
    for _ in range(tries):
        out = attempt()
        if not any(MATCHMAKING_MISS in (r.error or "") for r in out[-1]):
            break
    return out


def loopback_config(prefix: str, group: int, **overrides):
    """An AveragingConfig for a group of ``group`` real peers on loopback, with small parts
    (several per peer even for small tensors) and timeouts generous enough for a loaded
    2-core CI machine (a short sender timeout bans honest peers there); ``overrides`` win."""
    from dtrain.swarm.averaging import AveragingConfig

    base = dict(prefix=prefix, min_group_size=group, target_group_size=group, **LOOPBACK_MATCHMAKING,
                matchmaking_timeout_s=60, allreduce_timeout_s=120, sender_timeout_s=30, part_size_bytes=4096,
                allow_state_sharing=False)
    base.update(overrides)
    return AveragingConfig(**base)


def check_round_contract(originals: Sequence[torch.Tensor], results: Sequence[torch.Tensor],
                         records: Sequence[RoundRecord]) -> torch.Tensor:
    """Assert the contract above; return a mask of the elements all peers averaged."""
    before = torch.stack([t.reshape(-1) for t in originals])
    after = torch.stack([t.reshape(-1) for t in results])
    # An average of randn inputs never equals an input by chance. A reducer that lost every
    # other sender "averages" only its own part, and its lossy round trip (fp16, 8-bit) can
    # return a few inputs unchanged, hence the share tolerance below; a lost part is a whole
    # reducer's share (thousands of elements), far above it.
    changed = after != before
    for i in range(len(results)):
        for j in range(i + 1, len(results)):
            both = changed[i] & changed[j]
            assert torch.equal(after[i][both], after[j][both]), f"peers {i} and {j} disagree on averaged elements"
    for i, record in enumerate(records):
        assert not record.error, record.error
        share = float(changed[i].double().mean())
        assert abs(record.fraction_averaged - share) < 0.005, (i, record.fraction_averaged, share)
        if record.fraction_averaged < 1.0:
            failed = [p for p in record.peers if p.outcome == Outcome.FAIL and p.reason]
            assert failed, f"peer {i} averaged {share:.0%} but its record names no failed peer"
    return changed.all(dim=0)
