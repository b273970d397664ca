"""Robust aggregation of one all-reduce part: weighted CenteredClip.

A reducer receives the same slice (a *part*) of every sender's contribution. Plain
weighted averaging lets one sender move the result arbitrarily far; CenteredClip
(Karimireddy, He and Jaggi 2021, used per part by BTARD-SGD) bounds the pull of any one
sender to ``tau * weight / total_weight`` per iteration, so a contribution that slipped
past every check (negated, scaled up to the out-of-scale limit, crafted) moves the result
by at most about the honest spread.

The iteration starts from the coordinate-wise median of the senders that bring weight and
uses ``tau = TAU_SCALE x`` the median distance of those senders from that start, so honest
contributions are clipped little and a far outlier a lot. ``benchmarks/robust_aggregation.py``
measures what it does to training with and without an attacker.
"""

from __future__ import annotations

from typing import Sequence

import torch

TAU_SCALE = 1.0
ITERATIONS = 20
CONVERGED = 1e-6


def centered_clip(parts: Sequence[torch.Tensor], weights: Sequence[float], *, iterations: int = ITERATIONS,
                  tau_scale: float = TAU_SCALE) -> torch.Tensor:
    """Weighted CenteredClip of equally shaped ``parts`` (float32 result, computed in float32).

    Senders with weight 0 are left out. With fewer than three weighted senders no majority
    exists to clip against, and the weighted mean is returned; with none at all, the plain
    mean of every part (validators only: it is all zeros) or NaN if there are no parts.
    """
    if not parts:
        raise ValueError("centered_clip needs at least one part")
    weighted = [(p, float(w)) for p, w in zip(parts, weights, strict=True) if w > 0]
    if not weighted:
        return torch.stack([p.float() for p in parts]).mean(dim=0)
    x = torch.stack([p.float().reshape(-1) for p, _ in weighted])
    w = torch.tensor([w for _, w in weighted], dtype=torch.float32)
    shape = parts[0].shape
    if len(weighted) < 3:
        return ((w[:, None] * x).sum(0) / w.sum()).reshape(shape)
    # lower median per coordinate (sorting a handful of rows beats torch.median here)
    v = x.sort(dim=0).values[(x.shape[0] - 1) // 2].clone()
    diff = x - v
    tau = tau_scale * float(diff.norm(dim=1).median())
    if tau <= 0:
        # a majority sent exactly the median: clipping to radius 0 would keep it, which is right
        return v.reshape(shape)
    share = w / w.sum()
    for _ in range(iterations):
        scale = torch.clamp(tau / diff.norm(dim=1).clamp_min(1e-30), max=1.0)
        step = ((share * scale)[:, None] * diff).sum(0)
        v += step
        diff -= step
        # converged: the fixed point is reached to float32 precision, more iterations change nothing
        if float(step.norm()) <= CONVERGED * float(v.norm()):
            break
    return v.reshape(shape)


def weighted_mean(parts: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """Plain weighted mean (what hivemind's reducer computes), for baselines."""
    w = torch.tensor([float(x) for x in weights], dtype=torch.float64)
    x = torch.stack([p.double().reshape(-1) for p in parts])
    return ((w[:, None] * x).sum(0) / w.sum()).float().reshape(parts[0].shape)
