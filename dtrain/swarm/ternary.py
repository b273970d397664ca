"""dtrain's ternary wire codec: every value is -s, 0 or +s of its block, five values to a byte.

Free of hivemind (the wall registers it: dtrain/swarm/hivemind_internals/shims.py). Format,
arithmetic and figures: docs/swarm.md, "Wire compression".
"""

from __future__ import annotations

import numpy as np

from dtrain.swarm.codec_tensors import flat_float32, restored, value_count

# Values per block: one float32 scale each (0.25 bits per value on top of the 1.6 of the codes).
BLOCK = 128
# A value is coded when its magnitude exceeds this fraction of its block's mean magnitude: the
# threshold that minimises the L2 error of a ternary code for Gaussian-like values (Li et al.,
# "Ternary Weight Networks", 2016); the scale is then the mean magnitude of the coded values.
THRESHOLD = 0.7
# 3**5 = 243 <= 256: five trits to a byte, 1.6 bits a value (the 1.58 of log2(3) would need
# arithmetic coding across bytes for 1 %).
TRITS_PER_BYTE = 5
# The first byte of every buffer: a receiver refuses a buffer of another version by name.
FORMAT_VERSION = 1
FORMAT = f"blockwise-ternary/{BLOCK}/5-per-byte/v{FORMAT_VERSION}"
_POWERS = np.array([1, 3, 9, 27, 81], dtype=np.int32)


def _trit_table() -> np.ndarray:
    """byte -> its five codes (-1, 0, +1), least significant trit first; [243, 5] int8."""
    table = np.zeros((243, TRITS_PER_BYTE), dtype=np.int8)
    for byte in range(243):
        v = byte
        for j in range(TRITS_PER_BYTE):
            table[byte, j] = v % 3 - 1
            v //= 3
    return table


_TABLE = _trit_table()


def packed_size(n: int) -> int:
    """Bytes of a buffer of ``n`` values."""
    return 1 + 4 * (-(-n // BLOCK)) + -(-n // TRITS_PER_BYTE)


def ternarize(flat):
    """``(scales [num_blocks] float32, codes [n] int8 in -1..1)`` of a flat float32 tensor.

    Per block: codes are the signs of the values above THRESHOLD x the block's mean magnitude,
    the scale the mean magnitude of those values. ``scale x code`` is then the orthogonal
    projection of the block onto its sign pattern: its error is orthogonal to it and never
    larger than the block (relative L2 error below 1 for every input; 0.5-0.6 on gradients).
    """
    import torch

    n = flat.numel()
    num_blocks = -(-n // BLOCK)
    blocks = torch.nn.functional.pad(flat, (0, num_blocks * BLOCK - n)).view(num_blocks, BLOCK)
    mags = blocks.abs()
    counts = torch.full((num_blocks,), float(BLOCK), dtype=torch.float64)
    if n % BLOCK:
        counts[-1] = float(n % BLOCK)  # the last block's padding zeros do not lower its mean
    # sums in float64: a block of values near float32's largest must not overflow to inf
    threshold = (THRESHOLD * mags.sum(dim=1, dtype=torch.float64) / counts).to(torch.float32)
    coded = mags > threshold.unsqueeze(1)
    kept = coded.sum(dim=1)
    sums = (mags * coded).sum(dim=1, dtype=torch.float64)
    scales = torch.where(kept > 0, sums / kept.clamp(min=1), torch.zeros_like(sums)).to(torch.float32)
    codes = (torch.sign(blocks) * coded).to(torch.int8).reshape(-1)[:n]
    return scales, codes


def expand(scales, codes):
    """The float32 values of ``scales`` and ``codes`` (ternarize's output, or a buffer's)."""
    import torch

    n = codes.numel()
    num_blocks = scales.numel()
    padded = torch.nn.functional.pad(codes.to(torch.float32), (0, num_blocks * BLOCK - n))
    return (padded.view(num_blocks, BLOCK) * scales.unsqueeze(1)).reshape(-1)[:n]


class BlockwiseTernary:
    """Ternary codec: ``FORMAT_VERSION`` (1 byte), ``ceil(n / BLOCK)`` float32 scales (little
    endian), then the codes five to a byte (``sum(3**j x (code_j + 1))``, the first value in
    the lowest trit; trailing trits of the last byte are 0). Shape and dtype travel beside it,
    as with hivemind's codecs. 1.85 bits a value."""

    # The id hivemind's enum has no free value for: MEANSTD_16BIT's, which dtrain never sends.
    WIRE_ID = "MEANSTD_16BIT"

    @staticmethod
    def encode(tensor) -> tuple[bytes, tuple[int, ...], str]:
        """``(buffer, shape, dtype name)`` of a floating-point tensor."""
        flat, shape, dtype_name = flat_float32(tensor, "BlockwiseTernary")
        scales, codes = ternarize(flat)
        n = codes.numel()
        trits = np.ones(-(-n // TRITS_PER_BYTE) * TRITS_PER_BYTE, dtype=np.int32)
        trits[:n] = codes.numpy().astype(np.int32) + 1
        packed = (trits.reshape(-1, TRITS_PER_BYTE) @ _POWERS).astype(np.uint8)
        return bytes([FORMAT_VERSION]) + scales.numpy().astype("<f4").tobytes() + packed.tobytes(), shape, dtype_name

    @staticmethod
    def decode(buffer: bytes, shape, dtype_name: str):
        """The tensor a buffer of :meth:`encode` stands for; ValueError when the buffer is not
        one (another version, a wrong length, a byte past 242, padding or scales out of form):
        a peer's malformed message must fail loudly, never decode to something else."""
        import torch

        n = value_count(shape)
        if len(buffer) and buffer[0] != FORMAT_VERSION:
            raise ValueError(f"ternary part of format version {buffer[0]}, this peer reads {FORMAT}")
        if len(buffer) != packed_size(n):
            raise ValueError(f"ternary part of {n} values must be {packed_size(n)} bytes, got {len(buffer)}")
        num_blocks = -(-n // BLOCK)
        scales = np.frombuffer(buffer, dtype="<f4", count=num_blocks, offset=1).astype(np.float32)
        if not (np.isfinite(scales).all() and (scales >= 0).all()):
            raise ValueError("ternary part has a negative or non-finite block scale")
        packed = np.frombuffer(buffer, dtype=np.uint8, offset=1 + 4 * num_blocks)
        if packed.size and int(packed.max()) > 242:
            raise ValueError("ternary part has a byte past 242 (five trits are 0..242)")
        trits = _TABLE[packed].reshape(-1)
        if trits[n:].any():
            raise ValueError("ternary part has non-zero padding trits")
        return restored(expand(torch.as_tensor(scales), torch.as_tensor(trits[:n])), shape, dtype_name)

    @staticmethod
    def compression_ratio(bits_per_value: int) -> float:
        return (8.0 / TRITS_PER_BYTE + 32.0 / BLOCK) / bits_per_value
