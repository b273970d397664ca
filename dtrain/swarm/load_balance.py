"""How much of the vector each member reduces: the butterfly's load-balancing linear program.

A member with upload bandwidth ``b_i`` that reduces a fraction ``w_i`` of a vector of D values
moves ``D * (1 + (n - 2) * w_i)`` values, so the round lasts as long as the slowest
``(1 + (n - 2) w_i) / b_i``. :func:`optimize_parts_highs` minimises that (hivemind's program,
solved with HiGHS: scipy's interior-point method is deprecated; the hivemind averager's load
balancing uses it); :func:`balanced_fractions` is the optimum dtrain's own butterfly uses, and
:func:`part_shares` turns it into whole parts. Pure: numpy and scipy only, no hivemind.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import numpy as np

logger = logging.getLogger(__name__)

# Same rounding as hivemind so partitions are identical to an unpatched peer's when both solve.
_LP_DECIMALS = 9


def optimize_parts_highs(vector_size: int, bandwidths: np.ndarray, min_size: int = 0) -> np.ndarray:
    """hivemind's load-balancing LP (minimise the slowest peer's butterfly traffic time), solved with HiGHS.

    Variables are the per-peer fractions w_1..w_n and the makespan xi. Peer i moves
    ``D * (1 + (n - 2) * w_i)`` values, so we minimise xi subject to
    ``(1 + (n-2) w_i) / b_i <= xi`` for peers with bandwidth, ``sum w = 1``, ``0 <= w_i``,
    and ``w_i = 0`` for zero-bandwidth (client) peers. Returns scores proportional to fractions.
    """
    import scipy.optimize

    bandwidths = np.asarray(bandwidths, dtype=np.float64)
    assert np.all(bandwidths >= 0) and np.any(bandwidths > 0)
    n = len(bandwidths)
    nonzero = bandwidths > 0
    c = np.zeros(n + 1)
    c[-1] = 1.0
    rows, rhs = [], []
    safe_bw = np.maximum(bandwidths, 10.0**-_LP_DECIMALS)
    for i in np.flatnonzero(nonzero):
        row = np.zeros(n + 1)
        row[i] = (n - 2.0) / safe_bw[i]
        row[-1] = -1.0
        rows.append(row)
        rhs.append(-1.0 / safe_bw[i])
    a_eq = np.ones((1, n + 1))
    a_eq[0, -1] = 0.0
    bounds = [(0.0, 1.0 if nonzero[i] else 0.0) for i in range(n)] + [(None, None)]
    try:
        solution = scipy.optimize.linprog(
            c, A_ub=np.array(rows), b_ub=np.array(rhs), A_eq=a_eq, b_eq=[1.0], bounds=bounds, method="highs"
        )
        ok = bool(solution.success)
    except Exception as exc:  # an old/odd scipy must not kill the round
        logger.warning("load balancing LP failed (%r); using an equal split", exc)
        ok = False
    if not ok:
        return nonzero.astype(np.float64)
    scores = np.asarray(solution.x[:n], dtype=np.float64)
    if vector_size > 0 and np.max(scores) >= min_size / float(vector_size):
        scores[scores < min_size / float(vector_size)] = 0.0
    scores = np.round(scores, _LP_DECIMALS)
    if not np.any(scores > 0):
        return nonzero.astype(np.float64)
    return scores


def balanced_fractions(bandwidths: Sequence[float]) -> np.ndarray:
    """The fraction of the vector each member reduces so that every member that reduces finishes
    at the same time T: ``w_i = max(0, b_i T - 1) / (n - 2)`` with the T at which they add up to
    1 (water-filling). It is the program's optimum, and of its many optima the one that loads no
    member more than its link needs: the program alone is degenerate whenever a slow member's own
    upload (every member sends its whole vector once) sets the round's length, and a solver then
    returns an arbitrary vertex (one member reducing everything). Two members, or members whose
    bandwidths are all equal, split evenly; a bandwidth of 0 reduces nothing."""
    b = np.asarray(bandwidths, dtype=np.float64)
    n = len(b)
    active = b > 0
    if n <= 2 or not np.any(active) or np.allclose(b[active], b[active][0]):
        return active.astype(np.float64) / max(1, int(active.sum()))

    def total(t: float) -> float:
        return float(np.maximum(0.0, b * t - 1.0).sum() / (n - 2))

    lo, hi = 0.0, (1.0 + (n - 2)) / float(b[active].min())  # at hi even the slowest takes everything
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if total(mid) < 1.0 else (lo, mid)
    w = np.maximum(0.0, b * hi - 1.0) / (n - 2)
    return w / w.sum()


def part_shares(num_parts: int, bandwidths: Sequence[Optional[float]]) -> tuple[int, ...]:
    """Whole parts per member from :func:`balanced_fractions` (largest remainders take the parts
    left over). A bandwidth of None is "like the others" (their mean, 1 when nobody said); when
    every member said 0, all reduce alike."""
    known = [float(b) for b in bandwidths if b is not None]
    fill = float(np.mean(known)) if known else 1.0
    values = np.array([fill if b is None else max(0.0, float(b)) for b in bandwidths], dtype=np.float64)
    if not np.any(values > 0):
        values = np.ones(len(values))
    exact = balanced_fractions(values) * num_parts
    shares = np.floor(exact).astype(int)
    for i in np.argsort(-(exact - shares), kind="stable")[: num_parts - int(shares.sum())]:
        shares[i] += 1
    return tuple(int(x) for x in shares)
