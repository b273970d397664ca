"""When a miner joins a round by itself: every miner with work averages every round, whichever
miners the validators check (docs/protocol.md, "Every miner in every round").

A miner joins when a round notice (dtrain.swarm.round_notices) names its epoch, once per
notice: a validator is about to join that round. A miner behind the notice's epoch catches up
instead (a round of another epoch would refuse its contribution). Miners never start a round
without a validator: groups without one would step apart from the validators' replica, which
every check compares against. Pure: the caller passes the clock.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

TRIED_KEPT = 256  # notices remembered as tried (a forger cannot grow this)


@dataclass(frozen=True)
class Join:
    round_id: str  # the notice's round
    announcer: str  # the validator's peer id: a group without it is not the announced round


@dataclass(frozen=True)
class CatchUp:
    epoch: int  # a round was announced for this later epoch: we are behind


class RoundJoining:
    """A miner's memory of the notices it acted on; ``decide`` says whether to join one now."""

    def __init__(self, *, min_gap_s: float, now: float):
        self.min_gap_s = float(min_gap_s)  # a stream of forged notices costs one attempt per gap
        self._tried: deque[str] = deque(maxlen=TRIED_KEPT)
        self._last_attempt = now - self.min_gap_s

    def decide(self, epoch: int, notices, now: float) -> Join | CatchUp | None:
        """Join a round now, or catch up? ``notices``: the RoundNotices current on the DHT."""
        if now - self._last_attempt < self.min_gap_s:
            return None
        for notice in notices:
            key = f"{notice.announcer}/{notice.round_id}/{notice.epoch}"
            if notice.epoch >= epoch and key not in self._tried:
                self._tried.append(key)
                if notice.epoch == epoch:
                    return Join(notice.round_id, notice.announcer)
                # a forged notice for a later epoch costs at most one catch-up per gap (and the
                # catch-up keeps only a state that peers really hold at that epoch)
                self._last_attempt = now
                return CatchUp(notice.epoch)
        return None

    def attempted(self, now: float) -> None:
        """A round was joined (from a notice or on a validator's query) and is over."""
        self._last_attempt = now
