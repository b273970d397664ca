"""Compatibility shims for hivemind 1.1.12 on the numpy/scipy versions dtrain supports.

Two known defects are fixed here, deliberately and in one place:

1. 8-bit quantizers (``Uniform8BitQuantization``, ``Quantile8BitQuantization``) decode the
   codebook length with ``int(np.frombuffer(buf, count=1, dtype=np.int64))``. numpy >= 2.4
   refuses ``int()`` on a 1-element, 1-d array (TypeError), so every 8-bit tensor received
   from a peer fails to decode and the sender looks faulty. We register subclasses that read
   the length as a scalar (``[0]``) under the same wire ids (UNIFORM_8BIT / QUANTILE_8BIT),
   so the bytes on the wire are unchanged and peers without the shim still interoperate.

2. The load balancer (``optimize_parts_lp``) calls ``scipy.optimize.linprog(method="interior-point")``
   which is deprecated (a DeprecationWarning, fatal under ``-W error``) and slated for removal.
   We replace it with the same linear program solved by HiGHS, and fall back to an equal
   split if the solver is missing or fails, so a round never dies in load balancing.

``apply()`` is idempotent and is called at import of ``dtrain.swarm.averaging``.
"""

from __future__ import annotations

import logging
import threading
from typing import Sequence

import numpy as np

logger = logging.getLogger(__name__)

_applied = False
_lock = threading.Lock()

# Same rounding as hivemind so partitions are identical to an unpatched peer's when both solve.
_LP_DECIMALS = 9


def _read_codebook_size(buffer: bytes) -> int:
    # np.frombuffer(..., count=1) is a 1-d array; index it instead of int() (numpy >= 2.4).
    return int(np.frombuffer(buffer, count=1, dtype=np.int64)[0])


def _make_fixed_quantizer(base: type) -> type:
    import torch

    class _Fixed(base):  # type: ignore[misc, valid-type]
        """hivemind 8-bit quantizer with a numpy-2.4-safe decoder (wire format unchanged)."""

        def extract(self, serialized_tensor):  # noqa: D401 - mirrors the hivemind signature
            size = _read_codebook_size(serialized_tensor.buffer)
            codebook = np.frombuffer(serialized_tensor.buffer, offset=8, count=size, dtype=self.codebook_dtype)
            indices = np.frombuffer(serialized_tensor.buffer, offset=8 + codebook.nbytes, dtype=self.indices_dtype)
            indices_t = torch.as_tensor(indices, dtype=torch.int64).reshape(tuple(serialized_tensor.size))
            codebook_t = torch.as_tensor(codebook).to(dtype=getattr(torch, serialized_tensor.dtype))
            return codebook_t[indices_t].requires_grad_(serialized_tensor.requires_grad)

    _Fixed.__name__ = f"Fixed{base.__name__}"
    _Fixed.__qualname__ = _Fixed.__name__
    return _Fixed


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


def load_balance(vector_size: int, bandwidths: Sequence[float | None], min_size: int = 0) -> tuple[int, ...]:
    """Entry point dtrain uses: hivemind's ``load_balance_peers`` with the shim in place."""
    apply()
    from hivemind.averaging.load_balancing import load_balance_peers

    return tuple(int(x) for x in load_balance_peers(vector_size, list(bandwidths), min_size))


def apply() -> None:
    """Install both shims into hivemind (idempotent, thread-safe)."""
    global _applied
    with _lock:
        if _applied:
            return
        from hivemind.averaging import load_balancing
        from hivemind.compression import quantization, serialization

        for key, base in (
            ("UNIFORM_8BIT", quantization.Uniform8BitQuantization),
            ("QUANTILE_8BIT", quantization.Quantile8BitQuantization),
        ):
            current = serialization._BASE_COMPRESSION_TYPES[key]
            if not getattr(type(current), "_dtrain_fixed", False):
                fixed_cls = _make_fixed_quantizer(base)
                fixed_cls._dtrain_fixed = True
                serialization._BASE_COMPRESSION_TYPES[key] = fixed_cls()
        # load_balance_peers looks optimize_parts_lp up as a module global at call time.
        load_balancing.optimize_parts_lp = optimize_parts_highs
        _applied = True


def make_compression(name: str):
    """Map a config string (none / fp16 / 8bit / 8bit-quantile) to a hivemind compression object."""
    apply()
    from hivemind.compression import NoCompression, serialization
    from hivemind.compression.floating import Float16Compression

    key = (name or "none").strip().lower()
    if key in ("none", "fp32", ""):
        return NoCompression()
    if key in ("fp16", "float16"):
        return Float16Compression()
    if key in ("8bit", "uniform8bit", "int8"):
        return serialization._BASE_COMPRESSION_TYPES["UNIFORM_8BIT"]
    if key in ("8bit-quantile", "quantile8bit"):
        return serialization._BASE_COMPRESSION_TYPES["QUANTILE_8BIT"]
    raise ValueError(f"unknown compression {name!r}; expected one of none, fp16, 8bit, 8bit-quantile")
