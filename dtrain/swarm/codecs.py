"""Wire compression: what each ``allreduce.compression`` setting means, and dtrain's 8-bit codec.

The names and the codec's arithmetic, free of hivemind: the gather's ``wire`` (``wire_format``)
and the tolerances read them without importing it. How a part reaches the wire (hivemind's
serializer, the codec registered in the wall) is dtrain/swarm/wire.py.
"""

from __future__ import annotations

import math

import numpy as np

from dtrain.swarm.codec_tensors import flat_float32, restored, value_count
from dtrain.swarm.ternary import FORMAT as TERNARY_FORMAT

# Values per block of BlockwiseAbsmax8Bit: each block carries one float32 scale (4 bytes per 64
# values, +6 % on the wire) and its error bound grows as sqrt(BLOCK - 1) (see the class).
BLOCK = 64
# Largest code: symmetric int8 levels -127..127 (-128 unused, so 0 and +-absmax are exact).
_LEVELS = 127
# ||decode(encode(x)) - x|| <= BLOCKWISE_ERROR_BOUND * ||x|| for every finite x whose blocks'
# absmax values are normal float32 numbers, above about 1.5e-36 (derivation in
# BlockwiseAbsmax8Bit; below that the float32 scale absmax / 127 loses precision, and a block
# under about 1.8e-43 decodes to zeros). The 8-bit tolerances of the contribution rules start
# from it.
BLOCKWISE_ERROR_BOUND = math.sqrt(BLOCK - 1) / (2 * _LEVELS)


class BlockwiseAbsmax8Bit:
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

    Wire format (the ``buffer`` of hivemind's tensor message): ``ceil(n / B)`` float32 scales
    (little endian), then ``n`` int8 codes; shape and dtype travel beside it, as with
    hivemind's other codecs.
    """

    # hivemind's wire id this codec is registered under (its own codec of that id needs
    # bitsandbytes, which dtrain does not install, so the id is otherwise unusable here)
    WIRE_ID = "BLOCKWISE_8BIT"

    @staticmethod
    def encode(tensor) -> tuple[bytes, tuple[int, ...], str]:
        """``(buffer, shape, dtype name)`` of a floating-point tensor."""
        import torch

        flat, shape, dtype_name = flat_float32(tensor, "BlockwiseAbsmax8Bit")
        n = flat.numel()
        blocks = torch.nn.functional.pad(flat, (0, (-n) % BLOCK)).view(-1, BLOCK)
        scales = blocks.abs().amax(dim=1) / _LEVELS
        # a zero block keeps scale 0 (decodes to exact zeros); divide by 1 there instead of 0
        divisor = torch.where(scales > 0, scales, torch.ones_like(scales)).unsqueeze(1)
        codes = torch.round(blocks / divisor).clamp_(-_LEVELS, _LEVELS).to(torch.int8).reshape(-1)[:n]
        return scales.numpy().astype("<f4").tobytes() + codes.numpy().tobytes(), shape, dtype_name

    @staticmethod
    def decode(buffer: bytes, shape, dtype_name: str):
        """The tensor a buffer of :meth:`encode` stands for (ValueError when its length is wrong)."""
        import torch

        n = value_count(shape)
        num_blocks = -(-n // BLOCK)
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
        return restored(values, shape, dtype_name)

    @staticmethod
    def compression_ratio(bits_per_value: int) -> float:
        # one byte per value plus a float32 scale per BLOCK values
        return (8.0 + 32.0 / BLOCK) / bits_per_value


# Config names (and aliases) of the wire compressions -> the canonical name the tolerances use.
_NAMES = {
    "none": "none", "fp32": "none", "": "none",
    "fp16": "fp16", "float16": "fp16",
    "8bit": "8bit", "int8": "8bit", "blockwise8bit": "8bit",
    "8bit-uniform": "8bit-uniform", "uniform8bit": "8bit-uniform",
    "8bit-quantile": "8bit-quantile", "quantile8bit": "8bit-quantile",
    "ternary": "ternary", "1.5bit": "ternary", "trit": "ternary",
}


def canonical_compression(name: str) -> str:
    """The canonical name of a compression setting (raises ValueError for an unknown one)."""
    key = (name or "none").strip().lower()
    if key not in _NAMES:
        raise ValueError(f"unknown compression {name!r}; expected one of none, fp16, 8bit, ternary, "
                         "8bit-uniform, 8bit-quantile")
    return _NAMES[key]


# What each setting puts on the wire. "8bit" meant hivemind's uniform codec before dtrain's
# blockwise one; peers that read the same setting differently cannot decode each other's parts, so
# the gather names the format and version, not just the setting (group_rules.incompatibility).
_WIRE_FORMATS = {"none": "fp32", "fp16": "fp16", "8bit": f"blockwise-absmax-int8/{BLOCK}",
                 "ternary": TERNARY_FORMAT,
                 "8bit-uniform": "hivemind-uniform-8bit", "8bit-quantile": "hivemind-quantile-8bit"}


def wire_format(name: str) -> str:
    """A stable description of what a compression setting sends (for the swarm fingerprint)."""
    return _WIRE_FORMATS[canonical_compression(name)]


class PartCodec:
    """How one part (a flat float32 tensor) travels in dtrain's own butterfly: ``encode`` gives
    the wire bytes, ``decode`` the float32 values a receiver reads from them (ValueError for
    bytes that are not such a part). Deterministic, so a part's bytes are the evidence of what
    was sent. ``name`` is the canonical setting, ``wire`` its format (``wire_format``)."""

    def __init__(self, name: str, encode, decode):
        self.name, self.wire = name, wire_format(name)
        self._encode, self._decode = encode, decode

    def encode(self, part) -> bytes:
        return self._encode(part.detach().reshape(-1).float().cpu())

    def decode(self, data: bytes, length: int):
        try:
            values = self._decode(bytes(data), int(length))
        except ValueError:
            raise
        except Exception as exc:  # a hostile buffer must be a refusal, never another error type
            raise ValueError(f"{type(exc).__name__}: {exc}"[:200]) from None
        if values.numel() != length:
            raise ValueError(f"{values.numel()} values, expected {length}")
        return values

    def round_trip(self, part):
        """What a receiver decodes of ``part`` (the part itself when the codec is exact)."""
        if self.name == "none":
            return part
        return self.decode(self.encode(part), part.numel())


def _exact_bytes(dtype: str):
    limit = float(np.finfo(dtype).max)

    def encode(flat) -> bytes:
        # clipped to the type's range: a value past it would travel as infinity
        return np.clip(flat.numpy(), -limit, limit).astype(dtype).tobytes()

    def decode(data: bytes, length: int):
        import torch

        size = np.dtype(dtype).itemsize
        if len(data) != size * length:
            raise ValueError(f"a {dtype} part of {length} values must be {size * length} bytes, got {len(data)}")
        return torch.from_numpy(np.frombuffer(data, dtype=dtype).astype(np.float32))

    return encode, decode


def _blockwise(codec):
    def encode(flat) -> bytes:
        return codec.encode(flat)[0]

    def decode(data: bytes, length: int):
        return codec.decode(data, (length,), "float32")

    return encode, decode


def part_codec(name: str) -> PartCodec:
    """The part codec of a compression setting; ValueError for a setting dtrain's own butterfly
    does not carry (hivemind's single-codebook 8-bit codecs, kept only for experiments)."""
    from dtrain.swarm.ternary import BlockwiseTernary

    key = canonical_compression(name)
    coders = {"none": _exact_bytes("<f4"), "fp16": _exact_bytes("<f2"), "8bit": _blockwise(BlockwiseAbsmax8Bit),
              "ternary": _blockwise(BlockwiseTernary)}
    if key not in coders:
        raise ValueError(f"compression {name!r} is hivemind's codec; dtrain's butterfly carries none, fp16, 8bit "
                         "and ternary")
    return PartCodec(key, *coders[key])
