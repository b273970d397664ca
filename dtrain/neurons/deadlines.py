"""How long a round may take: one formula, used by the validator, the miner and the averager.

A round is matchmaking (hivemind waits ``matchmaking_time`` for peers, and retries a
few times when a group falls apart) followed by the butterfly all-reduce. The validator
asks miners to look for a group for :func:`round_deadline_s`; a miner accepts up to
:func:`max_accepted_deadline_s`, so a validator with a somewhat slower configuration is
still served while one asking for a day is refused.
"""

from __future__ import annotations

# Matchmaking attempts a round may spend before giving up: hivemind retries when a
# group's leader disappears, and one retry on a busy swarm is normal.
MATCHMAKING_ATTEMPTS = 3
# How much longer than its own deadline a miner lets a validator ask for.
ACCEPTED_DEADLINE_FACTOR = 2.0


def matchmaking_timeout_s(allreduce) -> float:
    """Give up looking for a group after this long (``allreduce`` is the config's section)."""
    return allreduce.matchmaking_time * MATCHMAKING_ATTEMPTS


def round_deadline_s(allreduce) -> float:
    """A whole round: matchmaking, then the all-reduce's own time limit."""
    return matchmaking_timeout_s(allreduce) + allreduce.allreduce_timeout


def max_accepted_deadline_s(allreduce) -> float:
    """The longest round deadline a miner accepts in an AllReduce query (else 422)."""
    return ACCEPTED_DEADLINE_FACTOR * round_deadline_s(allreduce)
