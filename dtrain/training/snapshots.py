"""DiLoCo snapshots: the inner-loop state a miner keeps so validators can replay its steps.

A snapshot is the inner trainer's parameters, ``exp_avg`` and ``exp_avg_sq`` as raw float32,
one file per (epoch, step), written atomically and served byte ranges at a time through
``/v1/state-slice``. The format and how validators use it: docs/protocol.md ("Snapshots").
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from dtrain.atomic import write_bytes

SECTIONS = 3  # params, exp_avg, exp_avg_sq
_NAME = re.compile(r"^e(\d+)-s(\d+)\.bin$")


class SnapshotError(Exception):
    """A snapshot that is missing, or bytes that do not decode as one."""


def snapshot_nbytes(params: Sequence[torch.Tensor]) -> int:
    return SECTIONS * 4 * sum(p.numel() for p in params)


def inner_state(trainer) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """(params, exp_avg, exp_avg_sq) of ``trainer`` as float32 CPU tensors (zeros before a step)."""
    params, m, v = [], [], []
    for p in trainer.params:
        state = trainer.optimizer.state.get(p, {})
        params.append(p.detach().to("cpu", torch.float32))
        for key, out in (("exp_avg", m), ("exp_avg_sq", v)):
            t = state.get(key)
            out.append(t.detach().to("cpu", torch.float32) if t is not None else torch.zeros(p.shape))
    return params, m, v


def encode(params: Sequence[torch.Tensor], exp_avg: Sequence[torch.Tensor], exp_avg_sq: Sequence[torch.Tensor]) -> bytes:
    parts = [t.detach().to("cpu", torch.float32).contiguous().reshape(-1).numpy().astype("<f4", copy=False).tobytes()
             for section in (params, exp_avg, exp_avg_sq) for t in section]
    return b"".join(parts)


def decode(data: bytes | bytearray, shapes: Sequence[torch.Size]):
    """(params, exp_avg, exp_avg_sq) from snapshot bytes; SnapshotError when they do not fit.

    The tensors are views of ``data`` when it is a writable buffer (a bytearray): a snapshot
    is 12 bytes per parameter, and a copy per step of decoding adds up."""
    sizes = [int(np.prod(s)) if len(s) else 1 for s in shapes]
    total = sum(sizes)
    if len(data) != SECTIONS * 4 * total:
        raise SnapshotError(f"snapshot has {len(data)} bytes, this model's is {SECTIONS * 4 * total}")
    values = np.frombuffer(data, dtype="<f4")
    if not values.flags.writeable or values.dtype != np.float32:
        values = values.astype(np.float32)  # read-only bytes, or a big-endian host: one copy
    flat = torch.from_numpy(values)
    if not bool(torch.isfinite(flat).all()):
        raise SnapshotError("snapshot holds non-finite values")
    sections, offset = [], 0
    for _ in range(SECTIONS):
        tensors = []
        for shape, n in zip(shapes, sizes):
            tensors.append(flat[offset:offset + n].reshape(shape))  # views of one buffer
            offset += n
        sections.append(tensors)
    if any(bool((t < 0).any()) for t in sections[2]):
        raise SnapshotError("snapshot's second moments are negative")
    return sections[0], sections[1], sections[2]


@torch.no_grad()
def load_inner_state(trainer, params, exp_avg, exp_avg_sq, optimizer_steps: int) -> None:
    """Make ``trainer`` (AdamW) continue from a snapshot whose moments stand for
    ``optimizer_steps`` AdamW steps (the trajectory's ``t0`` plus the snapshot's step)."""
    trainer.copy_parameters_from(params)
    trainer.reset_optimizer_state()
    if optimizer_steps > 0:  # 0: fresh moments, whatever the snapshot holds
        trainer.load_moments(list(zip(exp_avg, exp_avg_sq)), float(optimizer_steps))


class SnapshotStore:
    """Snapshot files under one directory, one per (epoch, step), kept for a few epochs."""

    def __init__(self, root: Path, keep_epochs: int = 2):
        self.root = Path(root)
        self.keep_epochs = keep_epochs
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, epoch: int, step: int) -> Path:
        return self.root / f"e{int(epoch)}-s{int(step)}.bin"

    def save(self, epoch: int, step: int, data: bytes) -> None:
        final = self.path(epoch, step)
        write_bytes(final, data)  # a reader sees the whole snapshot or none

    def read(self, epoch: int, step: int, offset: int, length: int) -> bytes:
        path = self.path(epoch, step)
        try:
            with open(path, "rb") as fh:
                fh.seek(max(0, int(offset)))
                return fh.read(max(0, int(length)))
        except FileNotFoundError:
            raise SnapshotError(f"no snapshot for epoch {epoch} step {step}") from None

    def prune(self, current_epoch: int) -> None:
        """Drop snapshots of epochs older than the last ``keep_epochs`` (audits come right after a round)."""
        for entry in self.root.iterdir():
            match = _NAME.match(entry.name)
            if match and int(match.group(1)) <= current_epoch - self.keep_epochs:
                entry.unlink(missing_ok=True)
