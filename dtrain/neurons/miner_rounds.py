"""The rounds a miner joins by itself: it watches the DHT's round notices on a thread, and the
training thread asks :meth:`MinerRounds.due` between pages (dtrain.neurons.round_joining
decides; docs/protocol.md, "AllReduce").

A validator's AllReduce query still reaches the checked miners with its weight caps; every
other miner joins the same round from the notice, with the default cap, bound by its work
commitment like everyone else's contribution.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from dtrain.api.messages import AllReduceRequest, AllReduceResponse
from dtrain.neurons.round_joining import CatchUp, RoundJoining
from dtrain.swarm.deadlines import ALLREDUCE_AT_FRACTION, round_deadline_s

log = logging.getLogger("dtrain.miner")

NOTICE_POLL_S = 0.5  # how often the DHT's round notices are read


@dataclass(frozen=True)
class RanRound:
    """The last round this miner ran, and what it answered."""

    round_id: str
    epoch: int
    answer: AllReduceResponse
    applied: bool  # its step was taken


class MinerRounds:
    """Round notices read off the DHT, and when ``miner`` (dtrain.neurons.miner.Miner) joins."""

    def __init__(self, miner):
        self.miner = miner
        self.joining: RoundJoining | None = None
        self._notices: list = []
        self.announcer: str | None = None  # of the notice whose round is being joined
        self.last: RanRound | None = None

    def start(self, stop: threading.Event) -> None:
        """Read the notices every NOTICE_POLL_S until ``stop`` (the swarm's DHT must be up)."""
        from dtrain.swarm.round_notices import RoundNotices

        cfg = self.miner.cfg
        self.joining = RoundJoining(min_gap_s=ALLREDUCE_AT_FRACTION * cfg.validator.round_interval_s,
                                    now=time.monotonic())
        prefix = f"dtrain-{cfg.model.run_id}"

        def loop() -> None:
            while not stop.wait(NOTICE_POLL_S):
                try:
                    # the node's DHT of now: a restarted swarm node has a new one
                    self._notices = RoundNotices(self.miner.node.dht, prefix).current()
                except Exception as exc:  # the DHT is best effort; the checked miners still get queries
                    log.debug("reading round notices failed: %r", exc)

        threading.Thread(target=loop, name="dtrain-round-notices", daemon=True).start()

    def due(self) -> AllReduceRequest | None:
        """The round to join now, as if a validator had asked with the default caps; else None."""
        m = self.miner
        if self.joining is None:
            return None  # not started
        join = self.joining.decide(m.epoch, list(self._notices), time.monotonic())
        if isinstance(join, CatchUp):
            # the same as a validator's query for a later epoch (its state, within tolerance, from peers)
            if m.catch_up.pending is None:
                m.catch_up.if_behind(join.epoch, None)
            return None
        if join is None:
            return None
        self.announcer = join.announcer
        return AllReduceRequest(round_id=join.round_id, epoch=m.epoch, weight_cap=m.bench.mode.weight_cap,
                                deadline_s=round_deadline_s(m.cfg.allreduce))

    def witnessed(self, record) -> bool:
        """Whether a round joined from a notice averaged with the validator that announced it.
        Miners that reached matchmaking after the validator's group formed can form a group of
        their own: its step would split their replicas from the validators', so it is not taken
        (they catch up at the next notice instead). A round a validator's query asked us into
        has no such condition (its validator's peer id is not known here)."""
        return self.announcer is None or self.announcer in record.group

    def vet(self, record) -> None:
        """Mark a round that was not ``witnessed`` failed, so that its step is not taken."""
        if not self.witnessed(record):
            record.error = record.error or "the validator that announced the round is not in this group: not applied"

    def finished(self) -> None:
        """A round (joined from a notice or on a validator's query) is over."""
        self.announcer = None
        if self.joining is not None:
            self.joining.attempted(time.monotonic())

    def answered(self, request: AllReduceRequest, epoch: int) -> AllReduceResponse | None:
        """Our answer of a round we already ran, to a query for it (``epoch``: ours now). The same
        round (id and epoch) is never run twice, whatever its result: run late, its matchmaking
        outlives the group and catches the next round's peers into a group at the wrong epoch.
        A round we stepped on answers other validators' queries for its epoch too (they all
        join one group on a shared clock); None: run it."""
        last = self.last
        if last is None or request.epoch != last.epoch:
            return None
        if request.round_id == last.round_id or (last.applied and epoch != last.epoch):
            return last.answer
        return None

    def ran(self, request: AllReduceRequest, answer: AllReduceResponse, applied: bool) -> None:
        self.last = RanRound(request.round_id, request.epoch, answer, applied)
