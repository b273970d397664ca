"""Model-state hand-over between peers: what a lagging peer downloads to catch up.

Averaged gradients only keep replicas identical if every replica also has the same
optimizer moments and schedule position, so the shared state is parameters plus
AdamW/LAMB moments plus counters. hivemind's ``load_state_from_peers`` carries it.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

MOMENTS = ("exp_avg", "exp_avg_sq")
# DiLoCo's outer optimizer (SGD with Nesterov momentum) keeps one buffer; it travels in the
# first moment's place, with zeros in the second, so the hand-over layout is the same.
SGD_MOMENTS = ("momentum_buffer", None)


def export_state(trainer, epoch: int) -> tuple[dict[str, Any], list[torch.Tensor]]:
    trainer.resident()  # an offloaded outer momentum comes back first (dtrain.training.offload)
    tensors: list[torch.Tensor] = []
    opt_step = 0.0
    keys = SGD_MOMENTS if isinstance(trainer.optimizer, torch.optim.SGD) else MOMENTS
    for p in trainer.params:
        tensors.append(p.detach().to("cpu", torch.float32))
        state = trainer.optimizer.state.get(p, {})
        for key in keys:
            moment = state.get(key) if key else None
            tensors.append(moment.detach().to("cpu", torch.float32) if moment is not None
                           else torch.zeros(p.shape, dtype=torch.float32))
        if "step" in state:
            opt_step = float(state["step"])
        elif state.get("momentum_buffer") is not None:
            # SGD counts no steps; any positive value says "the buffers are live".
            opt_step = float(max(trainer.counters.inner_step, 1))
    meta = {"epoch": int(epoch), "inner_step": trainer.counters.inner_step, "opt_step": opt_step,
            "sched_epoch": int(trainer.scheduler.last_epoch)}
    return meta, tensors


def state_slice(trainer, offset: int, length: int) -> bytes:
    """``length`` bytes of the float32 parameters from ``offset``, wrapping around at the end.

    Validators ask for more bytes than a small model holds to measure bandwidth, and
    check the bytes against their own replica, so both sides use this one function.
    Only the parameters the range touches are copied.
    """
    sizes = [p.numel() * 4 for p in trainer.params]
    total = sum(sizes)
    if total == 0 or length <= 0:
        return b""
    out = bytearray()
    position = offset % total
    while len(out) < length:
        start = 0
        for p, size in zip(trainer.params, sizes):
            end = start + size
            if start <= position < end:
                want = min(end - position, length - len(out))
                first = (position - start) // 4
                count = (position - start + want + 3) // 4 - first
                chunk = p.detach().reshape(-1)[first:first + count].to("cpu", torch.float32).numpy().tobytes()
                skip = (position - start) % 4
                out += chunk[skip:skip + want]
                position += want
                if len(out) >= length:
                    break
            start = end
        position %= total
    return bytes(out)


@torch.no_grad()
def import_state(trainer, meta: dict[str, Any], tensors: Sequence[torch.Tensor]) -> int:
    """Adopt a peer's state; returns its epoch. Raises ValueError when it does not fit this model."""
    per_param = 1 + len(MOMENTS)
    if len(tensors) != per_param * len(trainer.params):
        raise ValueError(f"peer state has {len(tensors)} tensors, this model needs {per_param * len(trainer.params)}")
    opt_step = float(meta.get("opt_step", 0.0))
    blocks = []
    for i, p in enumerate(trainer.params):
        block = tensors[i * per_param:(i + 1) * per_param]
        if any(tuple(t.shape) != tuple(p.shape) for t in block):
            raise ValueError("peer state does not match this model's parameter shapes")
        if not all(bool(torch.isfinite(t).all()) for t in block):
            raise ValueError("peer state holds non-finite values")
        blocks.append(block)
    trainer.copy_parameters_from([block[0] for block in blocks])
    trainer.load_moments([block[1:] for block in blocks] if opt_step > 0 else None, opt_step)
    # LambdaLR sets lr only when stepped; put the group lrs where the peer's schedule is.
    trainer.set_schedule_position(int(meta.get("sched_epoch", 0)))
    trainer.counters.inner_step = int(meta.get("inner_step", 0))
    epoch = int(meta.get("epoch", 0))
    trainer.counters.epoch = epoch
    trainer.zero_grad()
    return epoch
