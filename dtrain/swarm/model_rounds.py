"""One model's rounds on dtrain's own protocols: what a neuron calls instead of hivemind's averager.

:class:`ModelRounds` holds the round buffers of one model (float32 on CPU, the tensors' order
and shapes), cuts them into the round's parts (contribution.PartLayout.of_values), commits a
contribution to its work report, keeps what it sent for the members' and the validators'
questions, runs the round (dtrain.swarm.round: announced by a validator, joined by a miner) and
turns it into this peer's :class:`~dtrain.swarm.records.RoundRecord`. It runs on the caller's
thread only to copy tensors in and out; the round itself runs on the transport's loop.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from typing import Any, Callable, Optional, Sequence

import torch

from dtrain.swarm.averaging.contribution import PartLayout
from dtrain.swarm.averaging.group_rules import BENCH_ROUNDS, BenchList
from dtrain.swarm.averaging.kept import SentContribution
from dtrain.swarm.codecs import part_codec
from dtrain.swarm.commitments import CommittedChecks, commit
from dtrain.swarm.records import RoundLog, RoundRecord
from dtrain.swarm.round import Round, Rounds, RoundSettings, Stage, record_of
from dtrain.swarm.sent_round import SentRound

# Values per part: 128 Ki float32 (512 KiB on the uncompressed wire), fewer for a model so small
# that a group of 32 would otherwise leave reducers without a part.
MAX_VALUES_PER_PART = 1 << 17
MIN_VALUES_PER_PART = 1 << 10
PARTS_PER_VECTOR = 32
# How often a caller's stop event is looked at while it waits for its round.
STOP_POLL_S = 0.2


def values_per_part(num_values: int) -> int:
    """The part size of a model of ``num_values`` values: a 32nd of it, within the bounds above
    (it reads only the size, so every peer of a run cuts its vector alike)."""
    return max(MIN_VALUES_PER_PART, min(MAX_VALUES_PER_PART, num_values // PARTS_PER_VECTOR or 1))


class ModelRounds:
    """One averaging participant for one model on ``rounds`` (dtrain.swarm.round.Rounds).

    ``templates`` fix the order, shapes and dtypes of the averaged tensors; ``report_type`` is
    the mode's work report class; ``compression`` the wire codec's setting; ``robust``: the
    reducers' rule is CenteredClip; ``kept_dir``: where what we sent is kept (None: memory);
    ``log_path``: a JSON-lines log of every round's record; ``checks_type``: the class of each
    round's checks (a CommittedChecks; the sandbox's cheating reducers give their own).
    """

    def __init__(self, rounds: Rounds, templates: Sequence[torch.Tensor], fingerprint: str, *,
                 report_type: Optional[type] = None, mode: str = "gradient", compression: str = "none",
                 robust: bool = True, settings: RoundSettings = RoundSettings(), kept_dir: Optional[str] = None,
                 log_path: Optional[str] = None, part_values: Optional[int] = None,
                 checks_type: type = CommittedChecks):
        self.rounds, self.fingerprint, self.mode = rounds, str(fingerprint), mode
        self.checks_type = checks_type
        self.report_type, self.codec, self.kept_dir = report_type, part_codec(compression), kept_dir
        self.settings = RoundSettings(settings.window_s, settings.sender_timeout_s, settings.reducer_timeout_s, robust)
        self._shapes = [(tuple(t.shape), t.numel()) for t in templates]
        total = sum(n for _, n in self._shapes)
        self._buffers: Optional[list[torch.Tensor]] = None
        self.layout = PartLayout.of_values(self._zeros(), part_values or values_per_part(total))
        self.sizes = [length for _, _, length in self.layout.parts]
        self._log = RoundLog(log_path) if log_path else None
        self._lock = threading.Lock()  # the buffers: one round (or one writer) at a time
        self.last_record: Optional[RoundRecord] = None
        self.last_round: Optional[Round] = None
        self._last_sent = SentRound()  # our last committed round, the one the round audit asks about
        # reducers our checks refused for what they returned: as announcer, we give them no share
        self._bench = BenchList()

    def _zeros(self) -> list[torch.Tensor]:
        return [torch.zeros(shape, dtype=torch.float32) for shape, _ in self._shapes]

    @property
    def peer_id(self) -> str:
        return self.rounds.transport.peer_id

    @property
    def num_parts(self) -> int:
        return len(self.layout)

    @property
    def stage(self) -> Optional[str]:
        """The stage of the current or last round (None before any)."""
        return None if self.last_round is None else self.last_round.stage.value

    # -- the round buffers -----------------------------------------------------------------------
    @contextlib.contextmanager
    def round_buffers(self):
        """The round buffers, locked, to write a contribution straight into (run_round then copies nothing)."""
        with self._lock:
            if self._buffers is None:
                self._buffers = self._zeros()
            yield list(self._buffers)

    def into_buffers(self, compute: Callable[[Optional[list]], Any]) -> Any:
        """``compute(buffers)`` with the round buffers locked; its result goes to run_round."""
        with self.round_buffers() as buffers:
            return compute(buffers)

    def release_buffers(self) -> int:
        """Free the round buffers (4 bytes per parameter between rounds); the bytes freed, 0 when
        a round holds them."""
        if not self._lock.acquire(timeout=1.0):
            return 0
        try:
            freed = sum(4 * b.numel() for b in self._buffers) if self._buffers is not None else 0
            self._buffers = None
            return freed
        finally:
            self._lock.release()

    # -- one round -------------------------------------------------------------------------------
    def run_round(self, tensors: Sequence[torch.Tensor], weight: float, *, round_id: str, epoch: int,
                  announcer: Optional[str] = None, work=None, work_nonce: Optional[str] = None, tokens: int = 0,
                  timeout_s: Optional[float] = None, stop: Optional[threading.Event] = None,
                  caps: Optional[dict] = None, benched: Sequence[str] = (), reduces: bool = True) -> RoundRecord:
        """Average ``tensors`` in place in round ``round_id`` of ``epoch``; this peer's record.

        With ``announcer`` (the validator's peer id) this peer declares ``weight`` and joins; without,
        it announces the round and takes part with weight 0 (a validator), giving each peer at
        most its weight in ``caps`` (None: as declared; an unlisted peer gets 0). ``work`` and
        ``work_nonce`` commit the contribution to its work report (a miner's rounds are always
        committed; a validator passes the nonce alone, to check the others'). The tensors keep their
        values unless the round is DONE. ``stop`` abandons the wait (the round still ends on its own
        loop; its result is then not applied). As announcer, the peers in ``benched`` and those our
        checks refused as reducers within BENCH_ROUNDS of our rounds reduce no share (they still send).
        ``reduces``: whether we take a share when we join (a validator joining another's round does not)."""
        self._check(tensors, weight)
        with self.round_buffers() as buffers:
            for b, t in zip(buffers, tensors):
                if not (b.data_ptr() == t.data_ptr() and b.shape == t.shape and b.dtype == t.dtype):
                    b.copy_(t.detach().to(device="cpu", dtype=torch.float32))
            parts = self.layout.views(buffers)
            checks, gather = self._checks(round_id, buffers, parts, work, work_nonce)
            self._last_sent.begin()
            committed = None
            try:
                if announcer is None:
                    rnd = self.rounds.announce(round_id, epoch, parts, self.codec, self.settings, checks=checks,
                                               caps=caps, benched={*benched, *self._bench.named()})
                else:
                    rnd = self.rounds.join(announcer, round_id, epoch, parts, self.codec, float(weight),
                                           self.settings, checks=checks, gather=gather, reduces=reduces)
                self.last_round = rnd
                finished = self._wait(rnd, timeout_s, stop)
                committed = round_id if work is not None and finished and rnd.stage == Stage.DONE else None
            finally:
                self._last_sent.end(committed)
            record = record_of(rnd, self.peer_id, self.sizes, checks, fingerprint=self.fingerprint,
                               compression=self.codec.name, mode=self.mode, tokens=tokens)
            self._bench.tick()
            if rnd.outcome is not None and rnd.membership is not None:
                peers = rnd.membership.membership.peers
                self._bench.name([peers[k] for k in rnd.outcome.refused_reducers], BENCH_ROUNDS)
            if not finished:
                record.error = ("stopped before the round ended" if stop is not None and stop.is_set() else
                                "the round did not end in time")
                self._buffers = None  # the round still writes into them on its loop: never reuse them
            elif rnd.stage == Stage.DONE:
                for b, t in zip(buffers, tensors):
                    if b.data_ptr() != t.data_ptr():
                        t.copy_(b.to(device=t.device, dtype=t.dtype))
        self.last_record = record
        if self._log is not None:
            self._log.append(record)
        return record

    def _check(self, tensors: Sequence[torch.Tensor], weight: float) -> None:
        if len(tensors) != len(self._shapes):
            raise ValueError(f"expected {len(self._shapes)} tensors, got {len(tensors)}")
        for i, (t, (shape, _)) in enumerate(zip(tensors, self._shapes)):
            if tuple(t.shape) != shape:
                raise ValueError(f"tensor #{i} has shape {tuple(t.shape)}, expected {shape}")
            if not bool(torch.isfinite(t).all()):
                # an honest peer never ships NaN/Inf: refuse here instead of being refused by all
                raise ValueError(f"tensor #{i} has non-finite values; skip this round or fix the step")
        if not (math.isfinite(weight) and weight >= 0):
            raise ValueError("weight must be finite and >= 0")

    def _checks(self, round_id: str, buffers, parts, work, work_nonce) -> tuple[CommittedChecks, bytes]:
        """This round's checks, and our gather (our commitment; empty when we do not commit)."""
        nonce = work_nonce or ""
        own, sent = None, None
        if work is not None:
            if work_nonce is None:
                raise ValueError("a work report commits a contribution only under the epoch's work nonce")
            if self.report_type is None or not isinstance(work, self.report_type):
                raise ValueError(f"a committed round needs a work report of this swarm's kind ({self.report_type}), "
                                 f"got {type(work).__name__}")
            own = commit(parts, self.layout, self.codec, work_nonce, work)
            # a copy: the buffers are averaged in place, the questions are about what we sent
            self.rounds.kept.keep(round_id, SentContribution.keep(buffers, self.layout, self.codec,
                                                                   directory=self.kept_dir))
            sent = self.rounds.kept.sent(round_id)
        checks = self.checks_type(self.layout, self.codec, nonce, self.report_type, own=own, parts=parts,
                                 robust=self.settings.robust, questions=self.rounds.kept, sent=sent,
                                 question_timeout_s=max(10.0, self.settings.sender_timeout_s))
        return checks, own.gather() if own is not None else b""

    def _wait(self, rnd: Round, timeout_s: Optional[float], stop: Optional[threading.Event]) -> bool:
        """Whether the round ended within ``timeout_s`` (None: the round's own bound) before ``stop``."""
        bound = timeout_s if timeout_s is not None else (self.settings.window_s + 30.0 + 2 * (
            self.settings.sender_timeout_s + self.settings.reducer_timeout_s) + 60.0)
        deadline = time.monotonic() + bound
        while time.monotonic() < deadline:
            if stop is not None and stop.is_set():
                return False
            try:
                rnd.result(timeout_s=min(STOP_POLL_S, max(0.0, deadline - time.monotonic())))
                return True
            except TimeoutError:
                continue
        return rnd.finished

    # -- what we sent (the validators' round audit asks) -----------------------------------------
    def sent_sketches(self, round_id: str, nonce: str):
        """float32 [num_parts, k]: the sketches under ``nonce`` of what we sent in round
        ``round_id``; LookupError once another round replaced it."""
        return self._sent(round_id).sketches(nonce)

    def sent_wire(self, round_id: str, part: int) -> bytes:
        """The wire bytes of part ``part`` of what we sent in round ``round_id``."""
        if not 0 <= part < self.num_parts:
            raise IndexError(f"part {part} of {self.num_parts}")
        return self._sent(round_id).wire(part)

    @property
    def sent_round(self) -> Optional[str]:
        """The round id of our last committed round (None while a round runs, or none was committed)."""
        return self._last_sent.round_id

    def wait_for_sent(self, round_id: str, timeout_s: float) -> bool:
        """True when ``round_id`` is our last committed round, waiting while our round still runs."""
        return self._last_sent.wait_for(round_id, timeout_s)

    def _sent(self, round_id: str) -> SentContribution:
        sent = self.rounds.kept.sent(round_id) if self.sent_round == round_id else None
        if sent is None:
            raise LookupError(f"round {round_id} is no longer kept (only the last committed round is)")
        return sent

    def problem(self) -> Optional[str]:
        """Why this peer cannot take part in rounds (its transport is down), or None."""
        return None if self.rounds.transport.running else "the round transport is not running"
