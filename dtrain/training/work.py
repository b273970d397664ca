"""Work reports: what a miner commits to about the gradient it puts into a round.

A miner's contribution to a round is the mean gradient of the pages it trained since the
last step. For every one of its own pages (``assign_pages(run, uid, epoch, counter)``) it
records the page id, its counter, the sample count, the loss and the *work sketch* of that
page's sample-summed gradient: the CountSketch of ``dtrain.training.fingerprint`` under the
public nonce ``work_nonce(run_id, epoch)``, with ``WORK_SKETCH_K`` buckets.

Sketches are linear, so the sketch of the contribution must equal ``mean_sketch()``: the sum
of the page sketches divided by the sample count. The report travels in the round's gather
(so it is fixed before anyone chooses what to check), peers check the contribution against
it, and validators afterwards recompute randomly chosen pages (docs/protocol.md, "Work
commitments"). A fabricated page, a contribution that is not the mean of the pages
(negated, zeroed, rescaled, noisy, replayed) or a sample count above the pages' is caught.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from typing import Sequence

from dtrain.sketch import WORK_SKETCH_K

WORK_VERSION = "dtrain/work/v1"
# A report names at most this many pages (a miner's local batch is far smaller); the bound
# keeps a hostile gather from costing its peers unbounded parsing.
MAX_REPORT_PAGES = 65536


class WorkReportError(ValueError):
    """A work report that cannot be parsed or is inconsistent."""


# Why a report of the other averaging mode's kind is refused (its kind is the wire's "m" field).
OTHER_MODE = "{kind} work report in a swarm of the other averaging mode"


def work_nonce(run_id: str, epoch: int) -> str:
    """The public sketch seed of one epoch's work (the same for every peer of the run)."""
    return f"{WORK_VERSION}:{run_id}:{int(epoch)}"


@dataclass(frozen=True)
class PageWork:
    """One trained page: its id, its counter in the miner's assignment, and what it gave."""

    page: int
    counter: int
    samples: int
    loss: float
    sketch: tuple[float, ...]


@dataclass(frozen=True)
class WorkReport:
    epoch: int
    pages: tuple[PageWork, ...] = field(default_factory=tuple)

    @property
    def samples(self) -> int:
        return sum(p.samples for p in self.pages)

    def mean_sketch(self, k: int = WORK_SKETCH_K) -> list[float]:
        """Sketch of the mean gradient these pages give (zeros when there are none)."""
        total = [0.0] * k
        for p in self.pages:
            for i, v in enumerate(p.sketch):
                total[i] += v
        n = self.samples
        return [v / n for v in total] if n > 0 else total

    # What the contribution's claims must add up to (the DiLoCo report has its own).
    contribution_sketch = mean_sketch

    def to_wire(self) -> dict:
        """Compact form for the gather: sketches as little-endian float64 bytes."""
        return {"e": int(self.epoch),
                "p": [[p.page, p.counter, p.samples, float(p.loss), struct.pack(f"<{len(p.sketch)}d", *p.sketch)]
                      for p in self.pages]}

    @classmethod
    def from_wire(cls, data: object, k: int = WORK_SKETCH_K) -> "WorkReport":
        if isinstance(data, dict) and "m" in data:
            raise WorkReportError(OTHER_MODE.format(kind="DiLoCo"))
        if not isinstance(data, dict) or not isinstance(data.get("e"), int) or not isinstance(data.get("p"), list):
            raise WorkReportError("work report must be a map with an integer epoch 'e' and a page list 'p'")
        if len(data["p"]) > MAX_REPORT_PAGES:
            raise WorkReportError(f"work report names {len(data['p'])} pages, more than {MAX_REPORT_PAGES}")
        pages = []
        for entry in data["p"]:
            if not (isinstance(entry, list) and len(entry) == 5):
                raise WorkReportError("each page entry must be [page, counter, samples, loss, sketch]")
            page, counter, samples, loss, blob = entry
            if not all(isinstance(x, int) and not isinstance(x, bool) for x in (page, counter, samples)):
                raise WorkReportError("page, counter and samples must be integers")
            if page < 0 or counter < 0 or samples < 1:
                raise WorkReportError("page and counter must be >= 0 and samples >= 1")
            if not isinstance(loss, (int, float)) or not math.isfinite(loss):
                raise WorkReportError("page loss must be a finite number")
            if not isinstance(blob, bytes) or len(blob) != 8 * k:
                raise WorkReportError(f"page sketch must be {8 * k} bytes")
            sketch = struct.unpack(f"<{k}d", blob)
            if not all(math.isfinite(v) for v in sketch):
                raise WorkReportError("page sketch holds non-finite values")
            pages.append(PageWork(page=page, counter=counter, samples=samples, loss=float(loss), sketch=sketch))
        counters = [p.counter for p in pages]
        if any(b <= a for a, b in zip(counters, counters[1:])):
            raise WorkReportError("page counters must be strictly increasing")
        return cls(epoch=data["e"], pages=tuple(pages))


class WorkLog:
    """The miner's running record of the pages in its current accumulation.

    Call :meth:`record` after each own page is added to the trainer's gradients; it sketches
    the accumulated gradient and keeps the difference from the previous sketch, which is the
    page's own sketch (the sketch is linear). :meth:`reset` when the accumulation restarts.
    """

    def __init__(self, run_id: str, k: int = WORK_SKETCH_K):
        self.run_id = run_id
        self.k = k
        self.epoch = 0
        self._pages: list[PageWork] = []
        self._last: list[float] | None = None

    def reset(self, epoch: int) -> None:
        self.epoch = int(epoch)
        self._pages = []
        self._last = None

    def record(self, *, page: int, counter: int, samples: int, loss: float, gradients: Sequence) -> PageWork:
        from dtrain.sketch import gradient_sketch

        now = gradient_sketch(gradients, work_nonce(self.run_id, self.epoch), k=self.k).tolist()
        before = self._last or [0.0] * self.k
        entry = PageWork(page=int(page), counter=int(counter), samples=int(samples), loss=float(loss),
                         sketch=tuple(a - b for a, b in zip(now, before)))
        self._pages.append(entry)
        self._last = now
        return entry

    def report(self) -> WorkReport:
        return WorkReport(epoch=self.epoch, pages=tuple(self._pages))
