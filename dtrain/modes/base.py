"""What a training mode answers, in one place.

``allreduce.mode`` decides what a miner trains between rounds, what it puts into a round,
what a round changes, and what a validator audits afterwards. Each mode answers all of
that through :class:`Mode`, so miners, validators and benchmarks ask their mode instead of
branching on which one it is:

- training: :meth:`Mode.start_epoch`, :attr:`Mode.wants_data`, :meth:`Mode.train_page`,
  :attr:`Mode.samples`, :meth:`Mode.progress`;
- the round: :meth:`Mode.contribution` (tensors, weight, work report) and
  :meth:`Mode.apply_average` (the step every peer takes with the round's average);
- validating: :attr:`Mode.weight_cap`, :meth:`Mode.empty_report`, :meth:`Mode.audit`;
- snapshots a validator's audit may ask for: :meth:`Mode.open_store`, :meth:`Mode.snapshot`.

``Mode.trainer`` is the *shared replica*: the parameters every peer of the swarm holds at
an epoch. Rounds average into it, checkpoints, catch-up, state slices and Train challenges
all refer to it. The caller holds the neuron's model lock around every call that changes it
(training, the round's step, the start of an epoch); the calls that only read (``progress``,
``snapshot``, a validator's ``audit`` on its own thread) take no lock, as before.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtrain.config import Config


@dataclass(frozen=True)
class ModeSettings:
    """The settings a mode reads, taken from a :class:`~dtrain.config.Config` once."""

    mode: str
    run_id: str
    page_sequences: int
    # the local optimizer (per-step: the shared replica's; DiLoCo: the inner copy's)
    micro_batch_size: int
    local_batch_size: int
    optimizer: str
    lr: float
    weight_decay: float
    warmup_steps: int
    total_steps: int
    grad_clip: float | None
    precision: str
    # DiLoCo
    inner_steps: int
    inner_warmup: int
    snapshot_every: int
    outer_lr: float
    outer_momentum: float
    # validating: committed pages recomputed per miner and round (per-step mode)
    audit_pages: int
    # validating: the chance a miner's whole batch is recomputed in a round's secret-seed audit
    batch_audit_probability: float = 0.0
    # per-step: the swarm's target global batch, the most one contribution carries (and weighs)
    target_batch_size: int = 0

    @classmethod
    def from_config(cls, cfg: Config) -> ModeSettings:
        t, a = cfg.training, cfg.allreduce
        return cls(mode=a.mode, run_id=cfg.model.run_id, page_sequences=cfg.data.page_sequences,
                   micro_batch_size=t.micro_batch_size, local_batch_size=t.local_batch_size, optimizer=t.optimizer,
                   lr=t.lr, weight_decay=t.weight_decay, warmup_steps=t.warmup_steps, total_steps=t.total_steps,
                   grad_clip=t.grad_clip or None, precision=t.precision, inner_steps=a.diloco_inner_steps,
                   inner_warmup=a.diloco_inner_warmup, snapshot_every=a.diloco_snapshot_every,
                   outer_lr=a.outer_lr, outer_momentum=a.outer_momentum, audit_pages=cfg.validator.audit_pages,
                   batch_audit_probability=cfg.validator.batch_audit_probability,
                   target_batch_size=a.target_batch_size)

    def local_trainer_config(self, device: str, fused: bool | None = None):
        """The trainer of the local steps. ``fused`` None: torch's fused AdamW on CUDA only."""
        from dtrain.training.trainer import TrainerConfig

        return TrainerConfig(micro_batch_size=self.micro_batch_size, local_batch_size=self.local_batch_size,
                             optimizer=self.optimizer, lr=self.lr, weight_decay=self.weight_decay,
                             warmup_steps=self.warmup_steps, total_steps=self.total_steps, grad_clip=self.grad_clip,
                             precision=self.precision, device=device, fused=fused)


@dataclass(frozen=True)
class PageTrained:
    """What training one page gave: the loss to show, its samples, and the optimizer step it
    completed (a DiLoCo inner step), if any."""

    loss: float
    samples: int
    step: Any = None  # dtrain.training.trainer.StepMetrics


@dataclass(frozen=True)
class Progress:
    """Where the local training stands, for the dashboard and ``/v1/status``."""

    lr: float
    inner_step: int  # optimizer steps taken (DiLoCo: inner steps this epoch)
    samples: int  # samples trained since the start
    tokens: int
    samples_accumulated: int  # toward the next round's contribution
    local_batch: int  # samples a full contribution stands for


@dataclass(frozen=True)
class Contribution:
    """What a miner puts into a round: the tensors averaged, their weight (samples) and the work
    report committed with them in the gather."""

    tensors: list
    weight: float
    report: Any  # dtrain.training.work.WorkReport or dtrain.training.trajectory.TrajectoryReport


# read_snapshot(epoch, step, offset, length, timeout_s) -> bytes of a miner's committed snapshot
# (b"" past its end); raises dtrain.training.snapshots.SnapshotError when the miner cannot serve it.
SnapshotReader = Callable[[int, int, int, int, float], bytes]


@dataclass(frozen=True)
class AuditRequest:
    """One miner's work committed in a round, for the validator's audit."""

    uid: int
    report: Any
    read_snapshot: SnapshotReader | None = None  # DiLoCo replays download a snapshot through it
    # the round audit of what the miner sent (dtrain.swarm.averaging.audit.SenderAudit)
    sent: Any = None


def computed_into(out, op, *columns) -> list:
    """``op`` applied elementwise to each row of ``columns`` (lists of tensors, one per parameter):
    into ``out`` (the swarm's float32 CPU buffers, written in place) or, without it, into new
    CPU tensors. ``op(*tensors, out=None)`` is a torch function with ``out=``; a contribution
    computed into the buffers is never held twice (docs/operators.md, "Memory")."""
    import torch

    results = []
    for i, row in enumerate(zip(*columns)):
        row = [t.detach() for t in row]
        dst = out[i] if out is not None else None
        if all(t.device.type == "cpu" and t.dtype == torch.float32 for t in row):
            results.append(op(*row, out=dst) if dst is not None else op(*row))
            continue
        value = op(*(t.float() for t in row)).cpu()  # on the accelerator, then one copy to the host
        results.append(dst.copy_(value) if dst is not None else value)
    return results


class NoSnapshots:
    """The snapshot store of a neuron that keeps none (per-step mode, a validator)."""

    def save(self, epoch: int, step: int, params, exp_avg, exp_avg_sq) -> None:
        pass

    def read(self, epoch: int, step: int, offset: int, length: int) -> bytes:
        from dtrain.training.snapshots import SnapshotError

        raise SnapshotError("this miner keeps no DiLoCo snapshots (allreduce.mode is not diloco)")

    def prune(self, current_epoch: int) -> None:
        pass


class Mode(ABC):
    """One training mode; see the module docstring. Subclasses build their trainers from
    ``(settings, model, device, reader, fused=...)``."""

    name = ""

    def __init__(self, settings: ModeSettings, trainer, reader):
        self.settings = settings
        self.trainer = trainer  # the shared replica
        self.reader = reader
        self.store: Any = NoSnapshots()

    # ---------------------------------------------------------------- what a miner trains

    @abstractmethod
    def start_epoch(self, epoch: int) -> None:
        """Begin an epoch's local training from the shared replica (a new epoch, a resume, a
        catch-up)."""

    @property
    @abstractmethod
    def wants_data(self) -> bool:
        """Whether the next round's contribution would take another page."""

    @abstractmethod
    def train_page(self, tokens, *, page: int, counter: int, epoch: int) -> PageTrained:
        """Train one of the miner's own pages (``counter`` in its assignment of ``epoch``)."""

    @property
    @abstractmethod
    def samples(self) -> int:
        """Samples the next round's contribution stands for."""

    @abstractmethod
    def progress(self) -> Progress:
        ...

    # ---------------------------------------------------------------- what it contributes

    @abstractmethod
    def contribution(self, samples: int, weight_cap: float, out=None) -> Contribution:
        """The tensors, weight and work report for a round. An honest miner claims no more than
        ``weight_cap`` (more would read as inflation) nor more than its report commits to.
        ``out``: the swarm's round buffers to compute the tensors into (computed_into)."""

    # ---------------------------------------------------------------- after a round

    def apply_average(self, record, averaged: Sequence) -> Any:
        """Take the step every peer of a successful round takes with its average; return its
        StepMetrics, or None (changing nothing) when the round failed or its result is not finite.

        Every peer that averaged the same bits applies the same step to the same replica, so
        the replicas stay identical.
        """
        import torch

        if not record.ok or not all(bool(torch.isfinite(t).all()) for t in averaged):
            return None
        params = self.trainer.params
        # adopt: the average becomes the gradient itself, not a copy beside the one held
        self.trainer.set_gradients([t.to(p.device, p.dtype) for t, p in zip(averaged, params)], num_samples=1,
                                   adopt=True)
        return self.trainer.step()

    # ---------------------------------------------------------------- what a validator audits

    @property
    @abstractmethod
    def weight_cap(self) -> float:
        """The most samples an honest miner brings to a round (Train pages are computed aside
        and are not part of a contribution)."""

    @abstractmethod
    def empty_report(self, epoch: int):
        """The work report of a peer that brings no work (a validator, weight 0)."""

    @property
    def report_type(self) -> type:
        """The class of this mode's work reports: the swarm parses its group's commitments with it."""
        return type(self.empty_report(0))

    @abstractmethod
    def audit(self, requests: Sequence[AuditRequest], *, epoch: int, rng: random.Random) -> list:
        """A WorkVerdict (dtrain.validation.verification) per request, None where nothing was
        committed. Runs on the pre-step replica; ``rng`` is drawn from the validator's secret
        after the gather, so no miner knows what will be checked."""

    # ---------------------------------------------------------------- snapshots

    def open_store(self, root: Path) -> None:
        """Keep the snapshots validators' audits ask for under ``root`` (a miner)."""

    def snapshot(self, epoch: int, step: int, offset: int, length: int) -> bytes:
        """Bytes of a committed snapshot; SnapshotError when this neuron does not hold it."""
        return self.store.read(epoch, step, offset, length)

    # ---------------------------------------------------------------- helpers

    def expected_page(self, uid: int, epoch: int) -> Callable[[int], int]:
        """The page id of ``uid``'s page counter ``c`` in ``epoch`` (its own assignment)."""
        from dtrain.training.data import assign_pages

        def page(counter: int) -> int:
            return assign_pages(run_id=self.settings.run_id, uid=uid, epoch=epoch, page_counter=counter, count=1,
                                num_pages=self.reader.num_pages)[0]

        return page
