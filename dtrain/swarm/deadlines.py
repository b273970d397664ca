"""How long a round may take: one formula, used by the validator, the miner and the averager
(it lives in swarm/ because the averager's settings need it, and swarm sits below the neurons).

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


def matchmaking_timeout_for(matchmaking_time: float) -> float:
    """Give up looking for a group after this long, for a matchmaking window of ``matchmaking_time``."""
    return matchmaking_time * MATCHMAKING_ATTEMPTS


def matchmaking_timeout_s(allreduce) -> float:
    """:func:`matchmaking_timeout_for` of the config's ``[allreduce]`` section."""
    return matchmaking_timeout_for(allreduce.matchmaking_time)


def round_deadline_s(allreduce) -> float:
    """A whole round: matchmaking, then the all-reduce's own time limit."""
    return matchmaking_timeout_s(allreduce) + allreduce.allreduce_timeout


def max_accepted_deadline_s(allreduce) -> float:
    """The longest round deadline a miner accepts in an AllReduce query (else 422)."""
    return ACCEPTED_DEADLINE_FACTOR * round_deadline_s(allreduce)


def next_round_start(now: float, interval_s: float) -> float:
    """When the next validation round starts: the next multiple of ``interval_s`` of UNIX time.

    A shared clock instead of "interval after my last round": validators that run independently
    (there is no master) then start their rounds together, query miners at the same epoch and
    meet in the same all-reduce group, so every validator's replica takes every step. NTP keeps
    operators' clocks far closer than a round's matchmaking window.
    """
    if interval_s <= 0:
        return now
    return (now // interval_s + 1) * interval_s


# Where in its slot a round's all-reduce starts: validators that verified at different speeds
# still meet in one matchmaking window, as long as each finishes its checks in this share.
ALLREDUCE_AT_FRACTION = 0.5


def allreduce_start(slot_start: float, interval_s: float) -> float:
    """When a round that started at ``slot_start`` begins its all-reduce (UNIX time)."""
    return slot_start + ALLREDUCE_AT_FRACTION * max(0.0, interval_s)
