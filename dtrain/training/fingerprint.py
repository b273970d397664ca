"""Per-micro-batch gradient fingerprints: compact random-projection sketches.

A miner answering a Train challenge reports, for each micro-batch, its loss and a
``k``-dimensional sketch of the flattened gradient. The validator recomputes the
same micro-batch on its own copy of the model with the same code and compares.

The sketch is a sparse random projection (CountSketch): parameter ``i`` (in
``named_parameters`` order), element ``n`` of its flattened gradient gets the
64-bit hash ``h = mix64(seed_i + n)`` with
``seed_i = SHA256(len-prefixed "dtrain/fingerprint/v1", nonce, str(i))[:8]`` and
mix64 the splitmix64 finaliser (all arithmetic modulo 2**64). Then

    bucket = (h >> 32) mod k,   sign = +1 if h is odd else -1
    sketch[bucket] += sign * g_i[n]

so E[<S a, S b>] = <a, b>: cosines and norms of sketches estimate those of the
gradients. Integer hashing gives the same projection on every device (CPU
validator, GPU miner); it costs O(#params) and is computed in chunks, so the only
extra memory is a few chunk-sized vectors. The sketch is of the *sum* over the
micro-batch's samples of per-sample mean-token-loss gradients (what the trainer
accumulates).
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

FINGERPRINT_VERSION = "dtrain/fingerprint/v1"
DEFAULT_K = 64
CHUNK = 1 << 20

# splitmix64 constants as signed int64 (torch has no uint64 arithmetic)
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_M1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_M2 = 0x94D049BB133111EB - (1 << 64)


def _nonce_bytes(nonce: str | bytes | int) -> bytes:
    if isinstance(nonce, bytes):
        return nonce
    return str(nonce).encode("utf-8")


def _param_seed(nonce: str | bytes | int, index: int) -> int:
    h = hashlib.sha256()
    for part in (FINGERPRINT_VERSION.encode(), _nonce_bytes(nonce), str(index).encode()):
        h.update(len(part).to_bytes(8, "big"))
        h.update(part)
    return int.from_bytes(h.digest()[:8], "big", signed=True)


def _lshr(x: torch.Tensor, s: int) -> torch.Tensor:
    # logical right shift of int64 (torch's >> is arithmetic on signed ints)
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix64(x: torch.Tensor) -> torch.Tensor:
    x = x * _GOLDEN  # int64 multiply wraps modulo 2**64 on every backend
    x = (x ^ _lshr(x, 30)) * _M1
    x = (x ^ _lshr(x, 27)) * _M2
    return x ^ _lshr(x, 31)


def gradient_sketch(
    grads: Sequence[torch.Tensor | None],
    nonce: str | bytes | int,
    k: int = DEFAULT_K,
    chunk: int = CHUNK,
) -> torch.Tensor:
    """The k-dimensional sketch (float64, on CPU) of the concatenated gradients.

    ``grads`` must be in the model's stable parameter order; a None gradient counts
    as zeros (and costs nothing).
    """
    if k < 1:
        raise ValueError("k must be >= 1")
    out = None
    for i, g in enumerate(grads):
        if g is None:
            continue
        flat = g.detach().reshape(-1)
        if out is None:
            out = torch.zeros(k, dtype=torch.float64, device=flat.device)
        seed = _param_seed(nonce, i)
        for start in range(0, flat.numel(), chunk):
            _add_range(out, flat[start : start + chunk], seed, start)
    if out is None:
        return torch.zeros(k, dtype=torch.float64)
    return out.cpu()


def _add_range(out: torch.Tensor, values: torch.Tensor, seed: int, start: int) -> None:
    if values.device.type == "cpu":
        # Same buckets and signs as the torch path below, computed in numpy's native uint64
        # (no masking for logical shifts) and cached for part-sized ranges; multiplying by an
        # exact +-1.0 equals the where(sign, v, -v) below bit for bit. Each element is still
        # added with index_add_, in order, so the sums are the same to the last bit.
        bucket, sign = _cpu_hash(seed, start, values.numel(), out.numel())
        out.index_add_(0, bucket, torch.mul(values, sign))
        return
    dev = values.device
    part = values.double()
    h = _mix64(torch.arange(start, start + part.numel(), device=dev, dtype=torch.int64) + seed)
    bucket = _lshr(h, 32) % out.numel()
    out.index_add_(0, bucket, torch.where((h & 1).bool(), part, -part))


# A reducer checks the same range (same parameter, start, length and nonce) of every sender's
# part against its claim, so the hash of a range is kept for a few recent ranges: it is then
# computed once per part, not once per sender. Only part-sized ranges are kept (a 32 768-value
# part costs 512 KB here), and only a handful, so memory stays small whatever the model size.
_HASH_CACHE_MAX_VALUES = 1 << 18
_HASH_CACHE_ENTRIES = 16
_hash_cache: "OrderedDict[tuple[int, int, int, int], tuple[torch.Tensor, torch.Tensor]]" = OrderedDict()
_hash_lock = threading.Lock()
_U64 = (1 << 64) - 1


def _cpu_hash(seed: int, start: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(bucket int64, sign float64 of +-1) of elements ``start .. start + n`` under ``seed``."""
    key = (seed, start, n, k)
    cacheable = n <= _HASH_CACHE_MAX_VALUES
    if cacheable:
        with _hash_lock:
            hit = _hash_cache.get(key)
            if hit is not None:
                _hash_cache.move_to_end(key)
                return hit
    # In place, with one scratch buffer: numpy's `h ^= h >> 30` allocates a temporary per
    # operator, and the allocations and extra passes were half of this function's time (it is
    # the largest CPU cost of a round's claims: each sender hashes its whole vector, each reducer
    # its share). uint64 arithmetic wraps modulo 2**64 silently.
    h = np.arange(start, start + n, dtype=np.uint64)
    tmp = np.empty_like(h)
    h += np.uint64(seed & _U64)  # the seed as its two's-complement uint64
    h *= np.uint64(_GOLDEN & _U64)
    for mult, shift in ((_M1, 30), (_M2, 27), (None, 31)):
        np.right_shift(h, np.uint64(shift), out=tmp)
        h ^= tmp
        if mult is not None:
            h *= np.uint64(mult & _U64)
    np.right_shift(h, np.uint64(32), out=tmp)  # the high word
    # k a power of two (the default 64): the remainder is a mask
    if k & (k - 1) == 0:
        tmp &= np.uint64(k - 1)
    else:
        tmp %= np.uint64(k)
    bucket = torch.from_numpy(tmp.view(np.int64))  # < k: the same values as int64
    h &= np.uint64(1)
    sign = torch.from_numpy(h.view(np.int64)).to(torch.float64).mul_(2.0).sub_(1.0)  # odd: +1, even: -1 (exact)
    if cacheable:
        with _hash_lock:
            _hash_cache[key] = (bucket, sign)
            while len(_hash_cache) > _HASH_CACHE_ENTRIES:
                _hash_cache.popitem(last=False)
    return bucket, sign


def range_sketch(
    values: torch.Tensor,
    param_index: int,
    start: int,
    nonce: str | bytes | int,
    k: int = DEFAULT_K,
    chunk: int = CHUNK,
) -> torch.Tensor:
    """The sketch (float64, CPU) of elements ``start .. start + len(values)`` of parameter
    ``param_index``'s flattened tensor, all other elements taken as zero.

    The sketch is linear, so the range sketches of the pieces of a gradient add up to
    ``gradient_sketch`` of the whole: a reducer can check the one piece it received.
    """
    flat = values.detach().reshape(-1)
    out = torch.zeros(k, dtype=torch.float64, device=flat.device)
    seed = _param_seed(nonce, param_index)
    for offset in range(0, flat.numel(), chunk):
        _add_range(out, flat[offset : offset + chunk], seed, start + offset)
    return out.cpu()


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
