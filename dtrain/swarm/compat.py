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

It also registers dtrain's own 8-bit wire codec, :class:`BlockwiseAbsmax8Bit` (what the
``8bit`` setting means), under hivemind's ``BLOCKWISE_8BIT`` wire id: hivemind's codec of that
id needs bitsandbytes, which dtrain does not install, so the id is otherwise unusable here.

``apply()`` is idempotent and is called at import of ``dtrain.swarm.averaging``.
"""

from __future__ import annotations

import logging
import math
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


# Values per block of BlockwiseAbsmax8Bit: each block carries one float32 scale (4 bytes per 64
# values, +6 % on the wire) and its error bound grows as sqrt(BLOCK - 1) (see the class).
BLOCK = 64
# Largest code: symmetric int8 levels -127..127 (-128 unused, so 0 and +-absmax are exact).
_LEVELS = 127
# ||decode(encode(x)) - x|| <= BLOCKWISE_ERROR_BOUND * ||x|| for every finite x whose blocks'
# absmax values are normal float32 numbers, above about 1.5e-36 (derivation in
# BlockwiseAbsmax8Bit; below that the float32 scale absmax / 127 loses precision, and a block
# under about 1.8e-43 decodes to zeros). The 8-bit tolerances of dtrain.swarm.contribution
# start from it.
BLOCKWISE_ERROR_BOUND = math.sqrt(BLOCK - 1) / (2 * _LEVELS)


def _make_blockwise_codec() -> type:
    import torch
    from hivemind.compression.base import CompressionBase
    from hivemind.proto import runtime_pb2

    class BlockwiseAbsmax8Bit(CompressionBase):
        """8-bit wire codec with one scale per block of ``BLOCK`` values: ``code = round(x / s)``, ``s = absmax / 127``.

        Why not hivemind's 8-bit codecs: one codebook per part (up to 131 072 values) cannot
        follow gradients whose scale varies. Uniform 8-bit clips everything beyond +-3 sigma of
        the part into its edge buckets, quantile 8-bit lumps the top 1/256 of the values
        together; measured on Student-t(3), 0.1 % outliers or 99 %-sparse gradients both lose
        48-78 % of the vector (relative L2), so an honest peer's contribution could not be told
        from a cheat's. Here the error has a bound that holds for *every* input:

        Rounding to the nearest level moves an element by at most ``s / 2``, and by at most
        ``|x_i|`` (0 is a level). The block's largest element is a level (code +-127) and
        exact. So a block of B values with absmax m has ``||e||^2 <= (B - 1) (m / 254)^2`` while
        ``||x||^2 >= m^2``: ``||e|| / ||x|| <= sqrt(B - 1) / 254`` (0.031 for B = 64) per block,
        hence for the whole vector. An all-zero block is exact (scale 0), and no sum of squares
        is formed, so tiny or huge magnitudes do not underflow or overflow.

        Wire format (``runtime_pb2.Tensor.buffer``): ``ceil(n / B)`` float32 scales (little
        endian), then ``n`` int8 codes; ``size`` and ``dtype`` as hivemind's other codecs.
        """

        compression_type = runtime_pb2.BLOCKWISE_8BIT

        def compress(self, tensor, info, allow_inplace: bool = False):
            if not torch.is_floating_point(tensor):
                raise ValueError(f"{type(self).__name__} does not support {tensor.dtype} tensors")
            requires_grad = tensor.requires_grad
            src = tensor.detach().cpu()
            dtype_name = "bfloat16" if src.dtype == torch.bfloat16 else src.numpy().dtype.name
            flat = src.reshape(-1).to(torch.float32)
            n = flat.numel()
            blocks = torch.nn.functional.pad(flat, (0, (-n) % BLOCK)).view(-1, BLOCK)
            scales = blocks.abs().amax(dim=1) / _LEVELS
            # a zero block keeps scale 0 (decodes to exact zeros); divide by 1 there instead of 0
            divisor = torch.where(scales > 0, scales, torch.ones_like(scales)).unsqueeze(1)
            codes = torch.round(blocks / divisor).clamp_(-_LEVELS, _LEVELS).to(torch.int8).reshape(-1)[:n]
            return runtime_pb2.Tensor(
                compression=self.compression_type,
                buffer=scales.numpy().astype("<f4").tobytes() + codes.numpy().tobytes(),
                size=src.shape,
                dtype=dtype_name,
                requires_grad=requires_grad,
            )

        def extract(self, serialized_tensor):
            shape = tuple(serialized_tensor.size)
            n = int(np.prod(shape, dtype=np.int64)) if shape else 1
            num_blocks = -(-n // BLOCK)
            buffer = serialized_tensor.buffer
            # a peer's malformed message must fail loudly (hivemind then bans the sender), not misdecode
            if len(buffer) != 4 * num_blocks + n:
                raise ValueError(f"blockwise 8-bit part of {n} values must be {4 * num_blocks + n} bytes, "
                                 f"got {len(buffer)}")
            scales = torch.as_tensor(np.frombuffer(buffer, dtype="<f4", count=num_blocks).astype(np.float32))
            # astype copies into a writable array (torch refuses to wrap the read-only message buffer)
            codes = np.frombuffer(buffer, dtype=np.int8, offset=4 * num_blocks, count=n)
            codes = torch.as_tensor(codes.astype(np.float32))
            padded = torch.nn.functional.pad(codes, (0, num_blocks * BLOCK - n))
            values = (padded.view(num_blocks, BLOCK) * scales.unsqueeze(1)).reshape(-1)[:n]
            dtype = getattr(torch, serialized_tensor.dtype) if serialized_tensor.dtype else torch.float32
            return values.reshape(shape).to(dtype).requires_grad_(serialized_tensor.requires_grad)

        def estimate_compression_ratio(self, info) -> float:
            # one byte per value plus a float32 scale per BLOCK values
            return (8.0 + 32.0 / BLOCK) / torch.finfo(info.descriptor.dtype).bits

    return BlockwiseAbsmax8Bit


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
        if not getattr(type(serialization._BASE_COMPRESSION_TYPES["BLOCKWISE_8BIT"]), "_dtrain_fixed", False):
            blockwise = _make_blockwise_codec()
            blockwise._dtrain_fixed = True
            serialization._BASE_COMPRESSION_TYPES["BLOCKWISE_8BIT"] = blockwise()
        # load_balance_peers looks optimize_parts_lp up as a module global at call time.
        load_balancing.optimize_parts_lp = optimize_parts_highs
        _applied = True


# Config names (and aliases) of the wire compressions -> the canonical name the tolerances use.
_NAMES = {
    "none": "none", "fp32": "none", "": "none",
    "fp16": "fp16", "float16": "fp16",
    "8bit": "8bit", "int8": "8bit", "blockwise8bit": "8bit",
    "8bit-uniform": "8bit-uniform", "uniform8bit": "8bit-uniform",
    "8bit-quantile": "8bit-quantile", "quantile8bit": "8bit-quantile",
}


def canonical_compression(name: str) -> str:
    """The canonical name of a compression setting (raises ValueError for an unknown one)."""
    key = (name or "none").strip().lower()
    if key not in _NAMES:
        raise ValueError(f"unknown compression {name!r}; expected one of none, fp16, 8bit, 8bit-uniform, "
                         "8bit-quantile")
    return _NAMES[key]


# What each setting puts on the wire. "8bit" meant hivemind's uniform codec before dtrain's
# blockwise one; peers that read the same setting differently cannot decode each other's parts, so
# the swarm's identity should name the format, not just the setting.
_WIRE_FORMATS = {"none": "fp32", "fp16": "fp16", "8bit": f"blockwise-absmax-int8/{BLOCK}",
                 "8bit-uniform": "hivemind-uniform-8bit", "8bit-quantile": "hivemind-quantile-8bit"}


def wire_format(name: str) -> str:
    """A stable description of what a compression setting sends (for the swarm fingerprint)."""
    return _WIRE_FORMATS[canonical_compression(name)]


def make_compression(name: str):
    """Map a config string to a hivemind compression object.

    ``8bit`` is dtrain's :class:`BlockwiseAbsmax8Bit` (bounded error for any gradient);
    ``8bit-uniform`` / ``8bit-quantile`` are hivemind's single-codebook quantizers, kept for
    experiments: their error has no bound (docs/swarm.md, "Wire compression").
    """
    apply()
    from hivemind.compression import NoCompression, serialization
    from hivemind.compression.floating import Float16Compression

    key = canonical_compression(name)
    if key == "none":
        return NoCompression()
    if key == "fp16":
        return Float16Compression()
    return serialization._BASE_COMPRESSION_TYPES[
        {"8bit": "BLOCKWISE_8BIT", "8bit-uniform": "UNIFORM_8BIT", "8bit-quantile": "QUANTILE_8BIT"}[key]]
