"""Per-micro-batch gradient fingerprints and their comparison.

A miner answering a Train challenge reports, for each micro-batch, its loss and the sketch
(dtrain.sketch) of the sample-summed gradient; the validator recomputes the same micro-batch
on its own replica with the same code and compares within a measured tolerance
(docs/training.md, "Gradient fingerprint").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

@dataclass(frozen=True)
class Fingerprint:
    """What a miner reports per micro-batch (JSON-friendly via to_dict)."""

    loss: float
    sketch: tuple[float, ...]
    samples: int
    nonce: str = ""

    def to_dict(self) -> dict:
        return {"loss": self.loss, "sketch": list(self.sketch), "samples": self.samples, "nonce": self.nonce}

    @classmethod
    def from_dict(cls, d: dict) -> "Fingerprint":
        return cls(loss=float(d["loss"]), sketch=tuple(float(x) for x in d["sketch"]),
                   samples=int(d["samples"]), nonce=str(d.get("nonce", "")))


@dataclass(frozen=True)
class Tolerance:
    """Pass thresholds.

    Honest recomputations differ only by rounding: same hardware and precision is
    bit-exact; bf16 autocast vs fp32 on CPU measured cosine 0.99998 and norm ratio
    0.9996 (tiny preset). A gradient g + e with |e| = r|g| (e unrelated to g) has
    cosine ~ 1/sqrt(1 + r^2), so min_cosine 0.995 rejects changes above ~10% of
    the gradient norm; another batch or model gives cosine < 0.9 (see
    tests/test_training_fingerprint.py and docs/training.md)."""

    min_cosine: float = 0.995
    norm_rtol: float = 0.02
    loss_atol: float = 0.02
    loss_rtol: float = 0.01


@dataclass(frozen=True)
class Comparison:
    passed: bool
    cosine: float
    norm_ratio: float
    loss_diff: float
    reasons: tuple[str, ...] = field(default_factory=tuple)


def compare_fingerprints(claimed: Fingerprint, reference: Fingerprint, tol: Tolerance = Tolerance()) -> Comparison:
    """Compare a miner's fingerprint with the validator's recomputation.

    Passes when cosine(sketches) >= min_cosine, | |claimed|/|reference| - 1 | <= norm_rtol,
    |loss diff| <= loss_atol + loss_rtol * |reference loss|, and the sample counts and
    nonces agree (an answer for another challenge proves nothing about this one).
    """
    a = torch.tensor(claimed.sketch, dtype=torch.float64)
    b = torch.tensor(reference.sketch, dtype=torch.float64)
    reasons = []
    if a.shape != b.shape:
        return Comparison(False, 0.0, 0.0, math.inf, (f"sketch sizes differ: {a.numel()} vs {b.numel()}",))
    na, nb = float(a.norm()), float(b.norm())
    finite = all(math.isfinite(x) for x in (na, nb, claimed.loss, reference.loss))
    if not finite:
        return Comparison(False, 0.0, 0.0, math.inf, ("non-finite loss or sketch",))
    cos = float(a @ b) / (na * nb) if na > 0 and nb > 0 else (1.0 if na == nb else 0.0)
    ratio = na / nb if nb > 0 else (1.0 if na == 0 else math.inf)
    loss_diff = abs(claimed.loss - reference.loss)
    if cos < tol.min_cosine:
        reasons.append(f"cosine {cos:.4f} < {tol.min_cosine}")
    if abs(ratio - 1) > tol.norm_rtol:
        reasons.append(f"norm ratio {ratio:.4f} outside 1 +- {tol.norm_rtol}")
    if loss_diff > tol.loss_atol + tol.loss_rtol * abs(reference.loss):
        reasons.append(f"loss differs by {loss_diff:.4g}")
    if claimed.samples != reference.samples:
        reasons.append(f"samples {claimed.samples} != {reference.samples}")
    if claimed.nonce != reference.nonce:
        reasons.append("answer is for another nonce")
    return Comparison(not reasons, cos, ratio, loss_diff, tuple(reasons))
