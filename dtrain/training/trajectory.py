"""DiLoCo work reports: the committed trajectory of a miner's inner steps.

In DiLoCo mode (``allreduce.mode = "diloco"``) a miner takes up to H inner AdamW steps on
its own pages, starting from the shared parameters of the epoch (the *anchor*) with fresh
optimizer moments, and puts ``anchor - params`` (the pseudo-gradient) into the round. What it
commits in the round's gather, before any validator chooses what to check:

* ``start``: the work sketch (``dtrain.sketch.gradient_sketch`` under the
  epoch's public work nonce) of the parameters it started from, ``c_0``;
* per inner step t: the page counters and page ids it trained, their sample count and mean
  loss, the sketch of the step's sample-summed gradient ``g_t`` (as a per-step page's), and
  the sketch of the step's update ``u_t = c_{t-1} - c_t`` (``c_t`` is the sketch of the
  parameters after step t);
* every ``every`` steps (t = 0, every, 2 every, ...): the sketches of the AdamW moments
  (``exp_avg``, ``exp_avg_sq``) at that point: a *snapshot* the miner keeps and serves;
* ``t0``: how many AdamW steps the moments it started from stand for (0: fresh moments);
* ``carry``: the sketches of the moments after its last step under the *next* epoch's nonce.
  The inner optimizer keeps its moments from one epoch to the next (restarting them cost
  convergence); a validator checks the next epoch's start moments against this commitment,
  and the replay of the last stretch checks the commitment itself (docs/protocol.md,
  "DiLoCo", "Carried moments").

Sketches are linear, so the pseudo-gradient's sketch is ``sum(u_t)`` (``contribution_sketch``):
the same binding rule as per-step mode ties what a miner sends to what it committed
(``dtrain.swarm.averaging.contribution``). A validator then replays one randomly chosen stretch from
the snapshot before it (Proof-of-Learning's segment replay) and compares both sketches of
every replayed step (docs/protocol.md, "DiLoCo"). The gradient's sketch is what tells data
apart: an AdamW update is mostly the momentum carried in, so two steps from the same state
on different pages still move the parameters almost alike. Made-up steps are caught with
the probability that the replay covers one.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from typing import Sequence

from dtrain.sketch import WORK_SKETCH_K
from dtrain.training.work import MAX_REPORT_PAGES, OTHER_MODE, WorkReportError, work_nonce

TRAJECTORY_MODE = "diloco"  # the report's kind, its "m" field (a per-step report has none)
# A step names at most this many pages: a local batch is a handful of pages; the bound keeps
# a hostile gather cheap to parse.
MAX_STEP_PAGES = 4096
# The inner optimizer's step count, carried from epoch to epoch, is at most this (a bound for a
# hostile gather; 2**40 steps is far beyond any run).
MAX_OPTIMIZER_STEPS = 1 << 40


def _pack(values: Sequence[float]) -> bytes:
    return struct.pack(f"<{len(values)}d", *values)


def _unpack(blob: object, k: int, what: str) -> tuple[float, ...]:
    if not isinstance(blob, bytes) or len(blob) != 8 * k:
        raise WorkReportError(f"{what} must be {8 * k} bytes")
    values = struct.unpack(f"<{k}d", blob)
    if not all(math.isfinite(v) for v in values):
        raise WorkReportError(f"{what} holds non-finite values")
    return values


def _int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class InnerStepWork:
    """One committed inner step: its pages (own counters and ids), samples, loss and update sketch."""

    counters: tuple[int, ...]
    pages: tuple[int, ...]
    samples: int
    loss: float
    sketch: tuple[float, ...]  # u_t = c_{t-1} - c_t
    grad_sketch: tuple[float, ...] = ()  # sketch of the step's sample-summed gradient


@dataclass(frozen=True)
class SnapshotCommit:
    """The moments' sketches at a snapshot: after ``step`` inner steps (0 = the start)."""

    step: int
    exp_avg: tuple[float, ...]
    exp_avg_sq: tuple[float, ...]


@dataclass(frozen=True)
class TrajectoryReport:
    epoch: int
    every: int
    start: tuple[float, ...]
    steps: tuple[InnerStepWork, ...] = field(default_factory=tuple)
    snapshots: tuple[SnapshotCommit, ...] = field(default_factory=tuple)
    # AdamW steps the start moments stand for (0: fresh moments; then the step-0 snapshot's
    # sketches are zero), and the moments after the last step under the next epoch's nonce
    # (``step`` = t0 + len(steps), the optimizer's count then). None without steps.
    t0: int = 0
    carry: SnapshotCommit | None = None

    @property
    def samples(self) -> int:
        return sum(s.samples for s in self.steps)

    @property
    def pages(self) -> tuple:
        """Every committed page in training order, as (page, counter) pairs."""
        return tuple(_Page(p, c) for s in self.steps for p, c in zip(s.pages, s.counters))

    def contribution_sketch(self, k: int = WORK_SKETCH_K) -> list[float]:
        """Sketch of the pseudo-gradient the steps give: ``c_0 - c_T`` = the sum of the updates."""
        total = [0.0] * k
        for s in self.steps:
            for i, v in enumerate(s.sketch):
                total[i] += v
        return total

    def params_sketch_after(self, step: int) -> list[float]:
        """``c_step``: the sketch of the parameters after ``step`` inner steps."""
        out = list(self.start)
        for s in self.steps[:step]:
            for i, v in enumerate(s.sketch):
                out[i] -= v
        return out

    def snapshot_at(self, step: int) -> SnapshotCommit | None:
        return next((s for s in self.snapshots if s.step == step), None)

    @property
    def optimizer_steps(self) -> int:
        """The inner optimizer's step count after the last committed step."""
        return self.t0 + len(self.steps)

    def to_wire(self) -> dict:
        wire = {"m": TRAJECTORY_MODE, "e": int(self.epoch), "every": int(self.every), "c0": _pack(self.start),
                "s": [[list(s.counters), list(s.pages), s.samples, float(s.loss), _pack(s.sketch), _pack(s.grad_sketch)]
                      for s in self.steps],
                "snap": [[s.step, _pack(s.exp_avg), _pack(s.exp_avg_sq)] for s in self.snapshots],
                "t0": int(self.t0)}
        if self.carry is not None:
            wire["carry"] = [self.carry.step, _pack(self.carry.exp_avg), _pack(self.carry.exp_avg_sq)]
        return wire

    @classmethod
    def from_wire(cls, data: object, k: int = WORK_SKETCH_K) -> "TrajectoryReport":
        if isinstance(data, dict) and "m" not in data:
            raise WorkReportError(OTHER_MODE.format(kind="per-step"))
        if not isinstance(data, dict) or data.get("m") != TRAJECTORY_MODE:
            raise WorkReportError("not a DiLoCo trajectory report")
        epoch, every, steps_in, snaps_in = data.get("e"), data.get("every"), data.get("s"), data.get("snap")
        if not (_int(epoch) and _int(every) and every >= 1):
            raise WorkReportError("trajectory needs an integer epoch 'e' and a snapshot interval 'every' >= 1")
        if not isinstance(steps_in, list) or not isinstance(snaps_in, list):
            raise WorkReportError("trajectory needs a step list 's' and a snapshot list 'snap'")
        if len(steps_in) > MAX_REPORT_PAGES:
            raise WorkReportError(f"trajectory names {len(steps_in)} steps, more than {MAX_REPORT_PAGES}")
        start = _unpack(data.get("c0"), k, "start sketch")
        steps = _steps_from_wire(steps_in, k)
        snapshots = _snapshots_from_wire(snaps_in, k)
        # A snapshot before every stretch of `every` steps: the replay of any step starts at one.
        wanted = list(range(0, len(steps), every))
        if [s.step for s in snapshots] != wanted:
            raise WorkReportError(f"snapshots must be at steps {wanted[:8]}{'...' if len(wanted) > 8 else ''}")
        t0 = data.get("t0", 0)
        if not (_int(t0) and 0 <= t0 <= MAX_OPTIMIZER_STEPS):
            raise WorkReportError(f"'t0' must be an integer from 0 to {MAX_OPTIMIZER_STEPS}")
        carry = _carry_from_wire(data.get("carry"), t0 + len(steps) if steps else None, k)
        return cls(epoch=epoch, every=every, start=start, steps=tuple(steps), snapshots=tuple(snapshots),
                   t0=t0, carry=carry)

    @classmethod
    def empty(cls, epoch: int, k: int = WORK_SKETCH_K) -> "TrajectoryReport":
        """What a peer that brings no work (a validator, weight 0) commits."""
        return cls(epoch=int(epoch), every=1, start=(0.0,) * k)


def _steps_from_wire(steps_in: list, k: int) -> list:
    """The inner steps of a trajectory's wire form, bounded and checked."""
    steps, last_counter, total_pages = [], -1, 0
    for entry in steps_in:
        if not (isinstance(entry, list) and len(entry) == 6):
            raise WorkReportError("each step must be [counters, pages, samples, loss, update sketch, gradient sketch]")
        counters, pages, samples, loss, blob, grad_blob = entry
        if not (isinstance(counters, list) and isinstance(pages, list) and 1 <= len(counters) == len(pages)
                <= MAX_STEP_PAGES):
            raise WorkReportError("a step needs matching, non-empty counter and page lists")
        total_pages += len(pages)
        if total_pages > MAX_REPORT_PAGES:  # the same bound a per-step report has on its pages
            raise WorkReportError(f"trajectory names more than {MAX_REPORT_PAGES} pages")
        if not all(_int(x) and x >= 0 for x in (*counters, *pages)):
            raise WorkReportError("page counters and ids must be non-negative integers")
        for c in counters:
            if c <= last_counter:
                raise WorkReportError("page counters must be strictly increasing across the steps")
            last_counter = c
        if not (_int(samples) and samples >= 1):
            raise WorkReportError("step samples must be an integer >= 1")
        if not isinstance(loss, (int, float)) or isinstance(loss, bool) or not math.isfinite(loss):
            raise WorkReportError("step loss must be a finite number")
        steps.append(InnerStepWork(counters=tuple(counters), pages=tuple(pages), samples=samples,
                                   loss=float(loss), sketch=_unpack(blob, k, "step sketch"),
                                   grad_sketch=_unpack(grad_blob, k, "step gradient sketch")))
    return steps


def _snapshots_from_wire(snaps_in: list, k: int) -> list:
    snapshots = []
    for entry in snaps_in:
        if not (isinstance(entry, list) and len(entry) == 3 and _int(entry[0])):
            raise WorkReportError("each snapshot must be [step, exp_avg sketch, exp_avg_sq sketch]")
        snapshots.append(SnapshotCommit(step=entry[0], exp_avg=_unpack(entry[1], k, "snapshot sketch"),
                                        exp_avg_sq=_unpack(entry[2], k, "snapshot sketch")))
    return snapshots


def _carry_from_wire(carry_in, end_step, k: int):
    """The end moments a trajectory with steps carries (at ``end_step`` = t0 + steps); None without steps."""
    if end_step is None:
        if carry_in is not None:
            raise WorkReportError("a trajectory without steps carries no moments")
        return None
    if not (isinstance(carry_in, list) and len(carry_in) == 3 and _int(carry_in[0]) and carry_in[0] == end_step):
        raise WorkReportError("a trajectory with steps must carry [t0 + steps, exp_avg sketch, "
                              "exp_avg_sq sketch] of its end moments")
    return SnapshotCommit(step=carry_in[0], exp_avg=_unpack(carry_in[1], k, "carry sketch"),
                          exp_avg_sq=_unpack(carry_in[2], k, "carry sketch"))


@dataclass(frozen=True)
class _Page:
    page: int
    counter: int


class TrajectoryLog:
    """The miner's running record of its inner steps since the epoch's anchor.

    :meth:`start` at the anchor, :meth:`record_step` after each inner step, and
    :meth:`record_snapshot` whenever :meth:`snapshot_due` says so (the caller stores the
    state itself: see ``dtrain.training.snapshots``).
    """

    def __init__(self, run_id: str, every: int, k: int = WORK_SKETCH_K):
        if every < 1:
            raise ValueError("snapshot interval must be >= 1")
        self.run_id, self.every, self.k = run_id, int(every), k
        self.epoch = 0
        self._start: tuple[float, ...] = (0.0,) * k
        self._last: tuple[float, ...] = (0.0,) * k
        self._steps: list[InnerStepWork] = []
        self._snapshots: list[SnapshotCommit] = []
        self.t0 = 0

    @property
    def nonce(self) -> str:
        return work_nonce(self.run_id, self.epoch)

    @property
    def steps_done(self) -> int:
        return len(self._steps)

    @property
    def samples(self) -> int:
        return sum(s.samples for s in self._steps)

    def start(self, epoch: int, params: Sequence, t0: int = 0) -> None:
        """Begin the epoch's trajectory at ``params``, with moments that stand for ``t0`` AdamW
        steps (0: fresh)."""
        self.epoch = int(epoch)
        self.t0 = int(t0)
        self._start = self.gradient_sketch(params)
        self._last = self._start
        self._steps, self._snapshots = [], []

    def snapshot_due(self) -> bool:
        """Whether the state now (after ``steps_done`` steps) must be kept as a snapshot."""
        return self.steps_done % self.every == 0 and self.snapshot_at(self.steps_done) is None

    def snapshot_at(self, step: int) -> SnapshotCommit | None:
        return next((s for s in self._snapshots if s.step == step), None)

    def record_snapshot(self, exp_avg: Sequence, exp_avg_sq: Sequence) -> SnapshotCommit:
        entry = SnapshotCommit(step=self.steps_done, exp_avg=self.gradient_sketch(exp_avg),
                               exp_avg_sq=self.gradient_sketch(exp_avg_sq))
        self._snapshots.append(entry)
        return entry

    def gradient_sketch(self, tensors: Sequence, nonce: str | None = None) -> tuple[float, ...]:
        """The epoch's sketch of ``tensors`` (or under ``nonce``): a step's accumulated
        (sample-summed) gradient (take it before the step), the parameters, or moments."""
        from dtrain.sketch import gradient_sketch

        return tuple(gradient_sketch(list(tensors), self.nonce if nonce is None else nonce, k=self.k).tolist())

    def record_step(self, *, counters: Sequence[int], pages: Sequence[int], samples: int, loss: float,
                    params: Sequence, grad_sketch: Sequence[float]) -> InnerStepWork:
        """Record a step just taken: ``params`` after it, ``grad_sketch`` from before it."""
        now = self.gradient_sketch(params)
        entry = InnerStepWork(counters=tuple(int(c) for c in counters), pages=tuple(int(p) for p in pages),
                              samples=int(samples), loss=float(loss),
                              sketch=tuple(a - b for a, b in zip(self._last, now)), grad_sketch=tuple(grad_sketch))
        self._steps.append(entry)
        self._last = now
        return entry

    def carry(self, exp_avg: Sequence, exp_avg_sq: Sequence) -> SnapshotCommit:
        """The commitment to the moments now, after the last step, under the next epoch's nonce:
        what the next epoch's step-0 snapshot must sketch to when the moments are kept."""
        nxt = work_nonce(self.run_id, self.epoch + 1)
        return SnapshotCommit(step=self.t0 + self.steps_done, exp_avg=self.gradient_sketch(exp_avg, nxt),
                              exp_avg_sq=self.gradient_sketch(exp_avg_sq, nxt))

    def report(self, carry: SnapshotCommit | None = None) -> TrajectoryReport:
        """The trajectory so far; ``carry`` (from :meth:`carry`) is required once a step was taken."""
        # Snapshots past the last step serve no replay (and the wire rule does not expect them).
        snaps = tuple(s for s in self._snapshots if s.step < len(self._steps))
        if self._steps and (carry is None or carry.step != self.t0 + self.steps_done):
            raise ValueError("a trajectory with steps needs the carry of its end moments")
        return TrajectoryReport(epoch=self.epoch, every=self.every, start=self._start, steps=tuple(self._steps),
                                snapshots=snaps, t0=self.t0, carry=carry if self._steps else None)
