"""DiLoCo snapshots: the inner-loop state a miner keeps so validators can replay its steps.

A snapshot is the inner trainer's parameters, ``exp_avg`` and ``exp_avg_sq`` as raw float32,
one file per (epoch, step), written atomically and served byte ranges at a time through
``/v1/state-slice``. The format and how validators use it: docs/protocol.md ("Snapshots").
"""

from __future__ import annotations

import io
import re
import sys
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from dtrain.atomic import replacing

SECTIONS = 3  # params, exp_avg, exp_avg_sq
_NAME = re.compile(r"^e(\d+)-s(\d+)\.bin$")


class SnapshotError(Exception):
    """A snapshot that is missing, or bytes that do not decode as one."""


def snapshot_nbytes(params: Sequence[torch.Tensor]) -> int:
    return SECTIONS * 4 * sum(p.numel() for p in params)


def inner_state(trainer) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """(params, exp_avg, exp_avg_sq) of ``trainer`` as float32 CPU tensors: views of the trainer's
    own on a CPU trainer, and moments not taken yet as zeros that take no memory (expanded)."""
    trainer.resident()  # offloaded state comes back first (dtrain.training.offload)
    params, m, v = [], [], []
    zero = torch.zeros((), dtype=torch.float32)
    for p in trainer.params:
        state = trainer.optimizer.state.get(p, {})
        params.append(p.detach().to("cpu", torch.float32))
        for key, out in (("exp_avg", m), ("exp_avg_sq", v)):
            t = state.get(key)
            out.append(t.detach().to("cpu", torch.float32) if t is not None else zero.expand(p.shape))
    return params, m, v


# Bytes written per call when a tensor must be converted first: bounds the copy a write makes.
_WRITE_CHUNK = 4 << 20


def write_sections(fh, sections: Sequence[Sequence[torch.Tensor]]) -> None:
    """Write each tensor of each section as raw little-endian float32, in order: a contiguous
    float32 CPU tensor straight from its memory, any other a few MiB at a time, so a snapshot
    (12 bytes per parameter) is never held in memory a second time."""
    for section in sections:
        for t in section:
            flat = t.detach()
            if flat.dtype == torch.float32 and flat.device.type == "cpu" and flat.is_contiguous() \
                    and sys.byteorder == "little":
                fh.write(memoryview(flat.reshape(-1).numpy()).cast("B"))
                continue
            flat = flat.reshape(-1)
            step = _WRITE_CHUNK // 4
            for start in range(0, flat.numel(), step):
                piece = flat[start:start + step].to("cpu", torch.float32).contiguous().numpy()
                fh.write(piece.astype("<f4", copy=False).tobytes())


def encode(params: Sequence[torch.Tensor], exp_avg: Sequence[torch.Tensor], exp_avg_sq: Sequence[torch.Tensor]) -> bytes:
    """The snapshot's bytes in memory (tests and small models; miners write with SnapshotStore.save)."""
    out = io.BytesIO()
    write_sections(out, (params, exp_avg, exp_avg_sq))
    return out.getvalue()


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


class SnapshotSink:
    """A snapshot received straight into ``trainer`` (a validator's inner copy): its parameters,
    then fresh moment tensors, in the snapshot's order, a chunk at a time. No copy of the
    snapshot (12 bytes per parameter) is held beside them. The trainer's own moments are dropped
    first; :meth:`finish` checks what arrived as ``decode`` does and gives the sections."""

    def __init__(self, trainer):
        trainer.reset_optimizer_state()
        self.params = [p.detach() for p in trainer.params]
        self.exp_avg = [torch.empty_like(p) for p in self.params]
        self.exp_avg_sq = [torch.empty_like(p) for p in self.params]
        self._targets = [t.view(-1) for t in self.params + self.exp_avg + self.exp_avg_sq]
        self.size = 4 * sum(t.numel() for t in self._targets)
        self.received = 0
        self._at = (0, 0)  # (target index, element) the next value goes to
        self._tail = b""  # the bytes of a value split between two chunks

    @torch.no_grad()
    def write(self, chunk: bytes) -> None:
        if self.received + len(chunk) > self.size:
            raise SnapshotError(f"snapshot has more than {self.size} bytes, this model's size")
        self.received += len(chunk)
        data = bytearray(self._tail)
        data += chunk
        whole = len(data) // 4 * 4
        self._tail = bytes(data[whole:])
        values = torch.from_numpy(np.frombuffer(data, dtype="<f4", count=whole // 4).astype(np.float32, copy=False))
        index, offset, done = *self._at, 0
        while done < values.numel():
            target = self._targets[index]
            n = min(target.numel() - offset, values.numel() - done)
            target[offset:offset + n].copy_(values[done:done + n])
            done, offset = done + n, offset + n
            if offset == target.numel():
                index, offset = index + 1, 0
        self._at = (index, offset)

    def finish(self):
        """(params, exp_avg, exp_avg_sq) once every byte came; SnapshotError as ``decode`` says."""
        if self.received != self.size:
            raise SnapshotError(f"snapshot has {self.received} bytes, this model's is {self.size}")
        if not all(bool(torch.isfinite(t).all()) for t in self._targets):
            raise SnapshotError("snapshot holds non-finite values")
        if any(bool((t < 0).any()) for t in self.exp_avg_sq):
            raise SnapshotError("snapshot's second moments are negative")
        return self.params, self.exp_avg, self.exp_avg_sq


@torch.no_grad()
def load_inner_state(trainer, params, exp_avg, exp_avg_sq, optimizer_steps: int) -> None:
    """Make ``trainer`` (AdamW) continue from a snapshot whose moments stand for
    ``optimizer_steps`` AdamW steps (the trajectory's ``t0`` plus the snapshot's step)."""
    if not all(p.data_ptr() == q.data_ptr() for p, q in zip(trainer.params, params)):  # a sink wrote them in place
        trainer.copy_parameters_from(params)
    trainer.reset_optimizer_state()
    if optimizer_steps > 0:  # 0: fresh moments, whatever the snapshot holds
        # the moments become the optimizer's own, without a copy (nothing else holds them)
        trainer.load_moments(list(zip(exp_avg, exp_avg_sq)), float(optimizer_steps), copy=False)


class SnapshotStore:
    """Snapshot files under one directory, one per (epoch, step), kept for a few epochs."""

    def __init__(self, root: Path, keep_epochs: int = 2):
        self.root = Path(root)
        self.keep_epochs = keep_epochs
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, epoch: int, step: int) -> Path:
        return self.root / f"e{int(epoch)}-s{int(step)}.bin"

    def save(self, epoch: int, step: int, params, exp_avg, exp_avg_sq) -> None:
        """Write the snapshot straight from the tensors; a reader sees the whole file or none."""
        with replacing(self.path(epoch, step)) as fh:
            write_sections(fh, (params, exp_avg, exp_avg_sq))

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
