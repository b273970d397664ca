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
SGD_MOMENTS = ("momentum_buffer",)


def _moment_keys(optimizer) -> tuple[str, ...]:
    return SGD_MOMENTS if isinstance(optimizer, torch.optim.SGD) else MOMENTS


def export_state(trainer, epoch: int) -> tuple[dict[str, Any], list[torch.Tensor]]:
    tensors: list[torch.Tensor] = []
    opt_step = 0.0
    keys = _moment_keys(trainer.optimizer)
    for p in trainer.params:
        tensors.append(p.detach().to("cpu", torch.float32))
        state = trainer.optimizer.state.get(p, {})
        for i in range(len(MOMENTS)):
            moment = state.get(keys[i]) if i < len(keys) else None
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


def _load_moments(optimizer, params, blocks, opt_step: float) -> None:
    """Give the optimizer the peer's moments (or none, before its first step).

    Goes through ``optimizer.load_state_dict`` rather than writing ``optimizer.state``
    by hand: torch then places every state tensor where this optimizer expects it. Fused
    and capturable AdamW (fused is used on CUDA) need ``step`` on the parameters' device,
    the plain kernels keep it where torch's policy says, and moments follow the
    parameters' device and dtype. A hand-built CPU ``step`` next to CUDA parameters is
    what the fused kernel refuses.
    """
    index = {id(p): i for i, p in enumerate(q for group in optimizer.param_groups for q in group["params"])}
    state: dict[int, dict[str, torch.Tensor]] = {}
    sgd = isinstance(optimizer, torch.optim.SGD)
    if blocks is not None:
        for p, block in zip(params, blocks):
            if sgd:
                state[index[id(p)]] = {"momentum_buffer": block[1].to(torch.float32).clone()}
                continue
            state[index[id(p)]] = {"step": torch.tensor(opt_step, dtype=torch.float32),
                                   **{key: t.to(torch.float32).clone() for key, t in zip(MOMENTS, block[1:])}}
    current = optimizer.state_dict()
    optimizer.load_state_dict({"state": state, "param_groups": current["param_groups"]})


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
    for p, block in zip(trainer.params, blocks):
        p.copy_(block[0].to(p.device, p.dtype))
    _load_moments(trainer.optimizer, trainer.params, blocks if opt_step > 0 else None, opt_step)
    sched = trainer.scheduler
    sched.last_epoch = int(meta.get("sched_epoch", 0))
    # LambdaLR sets lr only when stepped; put the group lrs where the peer's schedule is.
    for group, base, fn in zip(trainer.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas):
        group["lr"] = base * fn(sched.last_epoch)
    trainer.counters.inner_step = int(meta.get("inner_step", 0))
    epoch = int(meta.get("epoch", 0))
    trainer.counters.epoch = epoch
    trainer.zero_grad()
    return epoch
