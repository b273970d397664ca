"""Unicode sparklines and a tiny text plot, for loss and throughput histories.

Pure functions over lists of floats: no Rich needed, so line logs and tests can use them too.
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

BLOCKS = "▁▂▃▄▅▆▇█"
GAP = " "  # a missing (NaN/inf) point shows as a hole rather than a fake value


def _finite(v: object) -> float | None:
    try:
        f = float(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def resample(values: Sequence[object], width: int) -> list[float | None]:
    """Shrink to ``width`` points by averaging equal buckets (non-finite points are left out of each mean).

    Averaging rather than picking every k-th point keeps a spike visible as a bump instead of
    letting it vanish or dominate depending on where the stride lands. Shorter series are kept as is.
    """
    pts = [_finite(v) for v in values]
    if width <= 0:
        return []
    if len(pts) <= width:
        return pts
    out: list[float | None] = []
    n = len(pts)
    for i in range(width):
        lo, hi = i * n // width, (i + 1) * n // width
        bucket = [p for p in pts[lo:hi] if p is not None]
        out.append(sum(bucket) / len(bucket) if bucket else None)
    return out


def sparkline(values: Iterable[object], width: int = 40) -> str:
    """Block sparkline, at most ``width`` characters; '' for no data.

    A constant series draws a flat mid-height line, so "steady" is not mistaken for "zero".
    """
    pts = resample(list(values), width)
    finite = [p for p in pts if p is not None]
    if not finite:
        return GAP * len(pts) if pts else ""
    lo, hi = min(finite), max(finite)
    span = hi - lo
    top = len(BLOCKS) - 1
    chars = []
    for p in pts:
        if p is None:
            chars.append(GAP)
        elif span <= 0:
            chars.append(BLOCKS[top // 2])
        else:
            chars.append(BLOCKS[min(top, int(round((p - lo) / span * top)))])
    return "".join(chars)


def text_plot(values: Iterable[object], width: int = 48, height: int = 8) -> list[str]:
    """A small line chart as text rows (top first), with the y range labelled on the left.

    Good enough to see the shape of a loss curve in a terminal or a CI log without matplotlib.
    """
    pts = resample(list(values), max(1, width))
    finite = [p for p in pts if p is not None]
    if not finite or height < 1:
        return []
    lo, hi = min(finite), max(finite)
    span = hi - lo
    rows = [[" "] * len(pts) for _ in range(height)]
    for x, p in enumerate(pts):
        if p is None:
            continue
        level = 0 if span <= 0 else int(round((p - lo) / span * (height - 1)))
        rows[height - 1 - level][x] = "•"
    label_hi, label_lo = f"{hi:.4g}", f"{lo:.4g}"
    pad = max(len(label_hi), len(label_lo))
    out = []
    for i, row in enumerate(rows):
        label = label_hi if i == 0 else (label_lo if i == height - 1 else "")
        out.append(f"{label:>{pad}} ┤{''.join(row)}")
    out.append(f"{'':>{pad}} └{'─' * len(pts)}")
    return out
