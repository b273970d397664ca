"""Robust aggregation of one all-reduce part: weighted CenteredClip.

CenteredClip (Karimireddy, He and Jaggi 2021, used per part by BTARD-SGD) bounds the pull of any
one sender to ``tau * weight / total_weight`` per iteration, so a contribution that slipped past
every check moves the result by about the honest spread. It starts from the coordinate-wise
median of the weighted senders with ``tau = TAU_SCALE x`` their median distance from it.
docs/swarm.md, "Robust aggregation (CenteredClip)", has the rule, its cost and
``benchmarks/robust_aggregation.py``'s figures.
"""

from __future__ import annotations

import functools
from typing import Sequence

import numpy as np
import torch

from dtrain.swarm.averaging.norms import part_check

TAU_SCALE = 1.0
ITERATIONS = 20
CONVERGED = 1e-6


def centered_clip(parts: Sequence[torch.Tensor], weights: Sequence[float], *, iterations: int = ITERATIONS,
                  tau_scale: float = TAU_SCALE) -> torch.Tensor:
    """Weighted CenteredClip of equally shaped ``parts`` (float32 result); see :func:`clip_account`."""
    return clip_account(parts, weights, iterations=iterations, tau_scale=tau_scale)[0]


def clip_account(parts: Sequence[torch.Tensor], weights: Sequence[float], *, iterations: int = ITERATIONS,
                 tau_scale: float = TAU_SCALE) -> tuple[torch.Tensor, np.ndarray, float]:
    """Weighted CenteredClip of equally shaped ``parts``, with its account.

    Returns ``(result, coefficients, tau)``: ``result`` (float32) is ``sum_i c_i parts_i`` with
    ``c`` (float64, >= 0, summing to 1) the coefficients a reducer publishes with the part, and
    ``tau`` the clip radius (0 where no clipping applied). Senders with weight 0 get 0; below
    three weighted senders it is the weighted mean; with none, the plain mean. The iteration runs
    on the senders' n coefficients over their Gram matrix, and the result is the fixed-point map
    at its last iterate, a convex combination by construction (docs/swarm.md, "Robust
    aggregation (CenteredClip)").
    """
    if not parts:
        raise ValueError("centered_clip needs at least one part")
    n_all = len(parts)
    all_w = [float(w) for w in weights]
    if len(all_w) != n_all:
        raise ValueError(f"{n_all} parts but {len(all_w)} weights")
    index = [i for i, w in enumerate(all_w) if w > 0]
    shape = parts[0].shape
    coefficients = np.zeros(n_all)
    if not index:
        coefficients[:] = 1.0 / n_all
        return torch.stack([p.float() for p in parts]).mean(dim=0), coefficients, 0.0
    rows = [parts[i].float().reshape(-1) for i in index]
    w = np.array([all_w[i] for i in index], dtype=np.float64)
    share = w / w.sum()
    if len(index) < 3:
        coefficients[index] = share
        return _combine(rows, share).reshape(shape), coefficients, 0.0
    v0 = lower_median(rows)
    d = torch.stack(rows).sub_(v0)  # the offsets D
    gram = (d @ d.T).double().numpy()
    radii = np.sort(np.sqrt(np.maximum(np.diagonal(gram), 0.0)))
    tau = tau_scale * float(radii[(len(radii) - 1) // 2])  # the lower median, as torch's median
    if tau <= 0:
        # a majority sent exactly the median, which is then one of the parts: keep it
        coefficients[index[int(np.argmin(np.diagonal(gram)))]] = 1.0
        return v0.reshape(shape), coefficients, 0.0
    v0_sq = part_check(v0)[1] ** 2  # float32's precision is plenty for the convergence test
    a = clip_coefficients(gram, share, tau, iterations=iterations, v0_sq=v0_sq,
                          d_v0=(d @ v0).double()).numpy()
    ga = gram @ a
    dist = np.sqrt(np.maximum(np.diagonal(gram) - 2 * ga + a @ ga, 0.0))
    c = share * np.minimum(tau / np.maximum(dist, 1e-30), 1.0)
    c /= c.sum()
    coefficients[index] = c
    # sum_i c_i x_i = v0 + D^T c (the c sum to 1): the offsets are already in memory
    return v0.add_(torch.from_numpy(c).float() @ d).reshape(shape), coefficients, tau


def reduce_by_rule(parts: Sequence[torch.Tensor], weights: Sequence[float], robust: bool) -> torch.Tensor:
    """``parts`` combined under a round's rule, as a receiver re-reducing a refused reducer's share
    does: CenteredClip when ``robust``, else the weighted mean summed in float64, in the given order."""
    if robust:
        return clip_account(parts, weights)[0]
    w = torch.tensor(list(weights), dtype=torch.float64)
    return (torch.stack([p.double() for p in parts]) * w[:, None]).sum(0).div_(w.sum()).float()


def _combine(rows: Sequence[torch.Tensor], coefficients: np.ndarray) -> torch.Tensor:
    out = rows[0] * float(coefficients[0])
    for row, c in zip(rows[1:], coefficients[1:]):
        out.add_(row, alpha=float(c))
    return out


@functools.lru_cache(maxsize=64)
def _sorting_network(n: int) -> tuple[int, tuple[tuple[int, int], ...]]:
    """Batcher's odd-even merge sort for ``p`` = the power of two >= ``n`` inputs: its
    compare-exchange pairs, in order (a fixed network: what each input ends up as does not depend
    on the values, so it runs as whole-tensor minimum/maximum operations)."""
    p = 1
    while p < n:
        p *= 2
    pairs: list[tuple[int, int]] = []

    def merge(lo: int, size: int, r: int) -> None:
        step = 2 * r
        if step < size:
            merge(lo, size, step)
            merge(lo + r, size, step)
            pairs.extend((i, i + r) for i in range(lo + r, lo + size - r, step))
        else:
            pairs.append((lo, lo + r))

    def sort(lo: int, size: int) -> None:
        if size > 1:
            sort(lo, size // 2)
            sort(lo + size // 2, size // 2)
            merge(lo, size, 1)

    sort(0, p)
    return p, tuple(pairs)


@functools.lru_cache(maxsize=64)
def _median_network(n: int) -> tuple[int, tuple[tuple[int, int, bool, bool], ...]]:
    """The compare-exchanges of the sorting network that the lower median's wire depends on:
    ``(i, j, keep min on i, keep max on j)``, in order. Walking the network backwards from the
    median's wire keeps only the outputs something later reads (for 4 rows, 7 of 10 tensor
    operations; for 8, 27 of 38)."""
    p, pairs = _sorting_network(n)
    needed = {(n - 1) // 2}
    kept = []
    for i, j in reversed(pairs):
        lo, hi = i in needed, j in needed
        if lo or hi:
            kept.append((i, j, lo, hi))
            needed |= {i, j}
    return p, tuple(reversed(kept))


def lower_median(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """The coordinate-wise lower median of equally shaped ``rows`` (a new tensor).

    A sorting network of elementwise minimum/maximum, pruned to what the median needs: for the
    handful of rows of a group it is about ten times faster than ``torch.sort`` (or
    ``kthvalue``) along the short axis, which walks each coordinate's column on its own."""
    n = len(rows)
    p, network = _median_network(n)
    work = list(rows) + [torch.full_like(rows[0], float("inf"))] * (p - n)
    for i, j, lo, hi in network:
        a, b = work[i], work[j]
        if lo:
            work[i] = torch.minimum(a, b)
        if hi:
            work[j] = torch.maximum(a, b)
    median = work[(n - 1) // 2]
    return median.clone() if any(median is r for r in rows) else median


def clip_coefficients(gram, share, tau: float, *, iterations: int = ITERATIONS,
                      v0_sq: float = 0.0, d_v0=None) -> torch.Tensor:
    """The CenteredClip iteration on the coefficients ``a`` of ``v = v0 + D^T a`` (float64).

    ``gram``: ``D D^T``; ``share``: the senders' weights over their total; ``v0_sq`` and ``d_v0``
    (``|v0|^2`` and ``D v0``) give ``|v|`` for the convergence test, which is the direct
    iteration's: a step below ``CONVERGED x |v|`` ends it. The n x n arithmetic runs in numpy:
    at this size each torch call costs more than its arithmetic, and the loop ran up to 20
    iterations of ten calls per part.
    """
    g = np.asarray(gram, dtype=np.float64)
    share = np.asarray(share, dtype=np.float64)
    n = g.shape[0]
    a = np.zeros(n)
    diag = np.diagonal(g)
    d_v0 = np.zeros(n) if d_v0 is None else np.asarray(d_v0, dtype=np.float64)
    for _ in range(iterations):
        ga = g @ a
        dist = np.sqrt(np.maximum(diag - 2 * ga + a @ ga, 0.0))
        c = share * np.minimum(tau / np.maximum(dist, 1e-30), 1.0)
        delta = c - c.sum() * a  # the step sum_i c_i (d_i - D^T a), as coefficients
        a += delta
        step_sq = float(delta @ g @ delta)
        v_sq = v0_sq + 2 * float(a @ d_v0) + float(a @ g @ a)
        # converged: the fixed point is reached to float32 precision, more iterations change nothing
        if step_sq <= CONVERGED ** 2 * max(v_sq, 0.0):
            break
    return torch.from_numpy(a)


def weighted_mean(parts: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """Plain weighted mean (what hivemind's reducer computes), for baselines."""
    w = torch.tensor([float(x) for x in weights], dtype=torch.float64)
    x = torch.stack([p.double().reshape(-1) for p in parts])
    return ((w[:, None] * x).sum(0) / w.sum()).float().reshape(parts[0].shape)
