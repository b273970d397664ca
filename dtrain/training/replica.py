"""How far apart two honest replicas of the model are, and how far they may be.

Honest replicas differ only by floating-point rounding (fused vs plain AdamW, CUDA vs CPU
kernels), so parameters are compared with a relative L2 tolerance, ``REPLICA_RTOL``, never bit
for bit; docs/scoring.md ("Replica tolerance") gives the measured drift it was chosen from.
A *parameter sketch* is the CountSketch of the flat float32 parameters (under its own seed):
linear, so the distance of two sketches estimates the distance of the parameter vectors
(within about ``sqrt(2 / k)`` relative, 9 % at k = 256) without sending them.
"""

from __future__ import annotations

import math
from typing import Sequence

REPLICA_RTOL = 2e-6
PARAMS_SKETCH_NONCE = "dtrain/params/v1"
PARAMS_SKETCH_K = 256


def params_distance(a: Sequence, b: Sequence) -> float:
    """Exact ||a - b|| / ||b|| over matching lists of tensors (float64)."""
    num = den = 0.0
    for x, y in zip(a, b, strict=True):
        x64, y64 = x.detach().double().cpu(), y.detach().double().cpu()
        num += float((x64 - y64).pow(2).sum())
        den += float(y64.pow(2).sum())
    return _ratio(math.sqrt(num), math.sqrt(den))


def params_sketch(params: Sequence, k: int = PARAMS_SKETCH_K) -> tuple[float, ...]:
    """The k-dimensional parameter sketch (see the module docstring)."""
    from dtrain.sketch import gradient_sketch

    return tuple(gradient_sketch([p.detach() for p in params], PARAMS_SKETCH_NONCE, k=k).tolist())


def sketch_distance(a: Sequence[float], b: Sequence[float]) -> float:
    """||a - b|| / ||b|| of two sketches; inf when they cannot be compared."""
    if len(a) != len(b) or not a:
        return math.inf
    if not all(math.isfinite(x) for x in a) or not all(math.isfinite(x) for x in b):
        return math.inf
    return _ratio(math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b))), math.sqrt(sum(y * y for y in b)))


def slice_distance(a: bytes, b: bytes, params_rms: float) -> float:
    """Distance of two float32 slices of the parameters, relative to the whole model's scale:
    ``rms(a - b) / rms(all parameters)``, comparable with ``params_distance``. (A slice's own
    norm would overstate the drift of a slice that happens to hold near-zero biases.)"""
    import numpy as np

    if len(a) != len(b) or len(a) % 4 or not len(a):
        return math.inf
    x = np.frombuffer(a, dtype="<f4").astype(np.float64)
    y = np.frombuffer(b, dtype="<f4").astype(np.float64)
    if not (np.isfinite(x).all() and np.isfinite(y).all()):
        return math.inf
    rms = float(np.sqrt(np.mean((x - y) ** 2)))
    return _ratio(rms, float(params_rms))


def params_rms(params: Sequence) -> float:
    total = sum(float(p.detach().double().pow(2).sum()) for p in params)
    count = sum(p.numel() for p in params)
    return math.sqrt(total / count) if count else 0.0


def within_tolerance(distance: float, rtol: float = REPLICA_RTOL) -> bool:
    return math.isfinite(distance) and distance <= rtol


def _ratio(num: float, den: float) -> float:
    if den > 0:
        return num / den
    return 0.0 if num == 0 else math.inf
