"""The catch-ups a miner owes: its replica fell behind (or apart) and resynchronises from the swarm.

A validator's query for a later epoch, a round that went on without us, or a round that kept
local values schedules one, and the training loop runs it, retrying a few times (right after a
round, the peers that could share its state may not have applied it yet). A Train query that
finds our replica apart heals at once, within the query, at most once per epoch.
"""

from __future__ import annotations

import time
from typing import Optional

from dtrain.neurons.base import CATCH_UP_TIMEOUT_S, CatchUpTarget

# A catch-up the training loop owes is tried this many times, this far apart, before it waits
# for the next validator query (which names the state to reach).
CATCH_UP_ATTEMPTS = 3
CATCH_UP_RETRY_S = 5.0
# The longest a Train query waits for a resynchronisation of a drifted replica: the
# validator's probe phase waits for every answer before its all-reduce.
HEAL_IN_QUERY_S = 10.0


class CatchUps:
    """What ``miner`` (dtrain.neurons.miner.Miner) owes: the pending target, its attempts left and
    when the next may run."""

    def __init__(self, miner):
        self.miner = miner
        self.pending: Optional[CatchUpTarget] = None
        self.attempts = 0
        self.at = 0.0
        self.healed_at_epoch: Optional[int] = None

    def if_behind(self, epoch: int, sketch) -> None:
        """A validator queried a later epoch: schedule a catch-up to its state (within tolerance)."""
        if epoch > self.miner.epoch:
            self.schedule(CatchUpTarget(epoch=epoch, sketch=tuple(sketch) if sketch else None))

    def schedule(self, target: CatchUpTarget) -> None:
        self.pending, self.attempts, self.at = target, CATCH_UP_ATTEMPTS, 0.0

    def due(self) -> bool:
        return self.pending is not None and time.monotonic() >= self.at

    def run_pending(self) -> None:
        target = self.pending
        if target is None or self.reached(target):
            self.pending = None  # already there (a round or another catch-up took us)
            return
        if self.resync(target):
            return
        self.attempts -= 1
        if self.attempts <= 0:
            self.pending = None
            self.miner.tel.event("catch-up: giving up for now; the next validator query retries it")
        else:
            self.at = time.monotonic() + CATCH_UP_RETRY_S

    def reached(self, target: CatchUpTarget) -> bool:
        """Whether the replica is at (or, by epoch, past) a named target; never for "any newer state"."""
        epoch = self.miner.epoch
        if target.epoch is None:
            return False
        if target.epoch != epoch:
            return target.epoch < epoch
        return target.sketch is None or self.miner._near(target.sketch)

    def heal_before_answering(self, target: CatchUpTarget) -> None:
        """Resynchronise to a Train query's replica now, within the query, at most once per epoch
        and for at most HEAL_IN_QUERY_S (a validator's probes wait for every answer); later
        queries that still find us apart, and a failed attempt, only schedule a catch-up."""
        if self.healed_at_epoch == self.miner.epoch:
            self.schedule(target)
            return
        self.healed_at_epoch = self.miner.epoch
        if not self.resync(target, timeout_s=HEAL_IN_QUERY_S):
            self.schedule(target)

    def resync(self, target: CatchUpTarget, timeout_s: float = CATCH_UP_TIMEOUT_S) -> bool:
        """One catch-up to ``target``; on success nothing is owed any more, local training restarts
        from the new replica, and the loop checkpoints it (disk work never delays an answer)."""
        miner = self.miner
        if not miner._catch_up(target, timeout_s=timeout_s):
            return False
        self.pending = None
        miner._start_epoch()  # local training from the old replica no longer fits
        miner._checkpoint_due = True
        return True
