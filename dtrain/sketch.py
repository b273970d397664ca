"""The CountSketch every check in dtrain compares: gradient and range sketches.

A sketch is a sparse random projection of a flattened tensor to ``k`` buckets under a nonce;
it is linear, so the sketches of the pieces of a vector add up to the sketch of the whole.
Miners' fingerprints, work reports and contribution claims, and every audit of them, are
sketches under this one projection. The exact projection (seeds, row hashes, buckets) is
specified in docs/training.md, "Gradient fingerprint"; integer hashing gives the same
projection on every device.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Sequence

import numpy as np
import torch

# The seed tag of every sketch (gradient fingerprints, work sketches, claims): peers must agree on it.
SKETCH_VERSION = "dtrain/fingerprint/v2"
DEFAULT_K = 64
# Buckets of every work sketch and contribution claim: the one width the swarm and its audits compare.
WORK_SKETCH_K = 64
CHUNK = 1 << 20
LANES = 64  # elements per row: one 64-bit word holds their signs

# splitmix64 constants as signed int64 (torch has no uint64 arithmetic)
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_M1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_M2 = 0x94D049BB133111EB - (1 << 64)
_U64 = (1 << 64) - 1


def _nonce_bytes(nonce: str | bytes | int) -> bytes:
    if isinstance(nonce, bytes):
        return nonce
    return str(nonce).encode("utf-8")


def _param_seed(nonce: str | bytes | int, index: int) -> int:
    h = hashlib.sha256()
    for part in (SKETCH_VERSION.encode(), _nonce_bytes(nonce), str(index).encode()):
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


def _np_mix64(h: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on a uint64 array, in place (numpy's uint64 wraps modulo 2**64
    and shifts logically, so no masks; one scratch buffer instead of a temporary per operator)."""
    tmp = np.empty_like(h)
    h *= np.uint64(_GOLDEN & _U64)
    for mult, shift in ((_M1, 30), (_M2, 27), (None, 31)):
        np.right_shift(h, np.uint64(shift), out=tmp)
        h ^= tmp
        if mult is not None:
            h *= np.uint64(mult & _U64)
    return h


@functools.lru_cache(maxsize=16)
def _fold_index(k: int, device: str) -> torch.Tensor:
    """Bucket of table cell (offset o, lane j), row-major: (o + j) mod k."""
    cells = (torch.arange(k)[:, None] + torch.arange(LANES)[None, :]) % k
    return cells.reshape(-1).to(device)


def _row_hashes_cpu(seed: int, first_row: int, rows: int, k: int) -> tuple[np.ndarray, torch.Tensor]:
    """(negative uint8 [rows * 64]: 1 where the sign is -1, offsets int64 [rows]) of rows
    ``first_row ...``, with numpy's native uint64 arithmetic."""
    base = np.arange(first_row, first_row + rows, dtype=np.uint64)
    base *= np.uint64(2)
    base += np.uint64(seed & _U64)  # the seed as its two's-complement uint64
    signs = _np_mix64(base.copy())
    base += np.uint64(1)
    offsets = _np_mix64(base)
    offsets >>= np.uint64(32)
    offsets %= np.uint64(k)
    # bit j of a row's word is lane j: little-endian bytes, each read from its lowest bit
    bits = np.unpackbits(signs.astype("<u8", copy=False).view(np.uint8), bitorder="little")
    bits ^= np.uint8(1)
    return bits, torch.from_numpy(offsets.view(np.int64))


def _signed_table_cpu(values: torch.Tensor, negative: np.ndarray, pad: int, rows: int) -> torch.Tensor:
    """float64 [rows * 64]: each lane's value with its sign applied, zeros outside the range.

    The sign goes on by flipping the IEEE sign bit (an integer XOR: exact, and far cheaper than
    a multiply by +-1.0 after widening); float32 values, the common case, are flipped before
    they are widened, so the mask is 4 bytes a lane instead of 8."""
    n = values.numel()
    flat = values.detach().reshape(-1)
    if flat.dtype == torch.float32 and pad == 0 and n == rows * LANES:
        mask = negative.astype(np.int32)
        mask <<= 31
        np.bitwise_xor(flat.numpy().view(np.int32), mask, out=mask)
        return torch.from_numpy(mask.view(np.float32).astype(np.float64))
    table = np.zeros(rows * LANES, dtype=np.float64)
    table[pad:pad + n] = flat.to(torch.float64).numpy()
    mask = negative.astype(np.int64)
    mask <<= 63
    table.view(np.int64)[:] ^= mask
    return torch.from_numpy(table)


def _add_pieces_torch(out: torch.Tensor, pieces: Sequence[tuple[torch.Tensor, int, int]]) -> None:
    """Add the sketches of ``pieces`` = ``(values, seed, start)`` into ``out`` with torch ops
    alone (what a GPU runs), all pieces in one pass.

    On a GPU the cost of a sketch is the number of kernel launches, not the arithmetic: a model
    has a hundred-odd parameters, many of a few hundred values, and each range of v1's design
    cost a dozen launches. Here every piece costs one copy into a shared row-aligned table, and
    the hashes, signs and additions of all of them run as one set of kernels.
    """
    dev, k = out.device, out.numel()
    firsts, rows, pads = [], [], []
    for values, _, start in pieces:
        first = start // LANES
        firsts.append(first)
        rows.append((start + values.numel() + LANES - 1) // LANES - first)
        pads.append(start - first * LANES)
    total = sum(rows)
    table = torch.zeros(total * LANES, dtype=torch.float64, device=dev)
    row = 0
    for (values, _, _), n_rows, pad in zip(pieces, rows, pads):
        at = row * LANES + pad
        table[at:at + values.numel()] = values.detach().reshape(-1)
        row += n_rows
    # row r of piece p hashes seed_p + 2 (first_p + r), all rows at once
    meta = torch.tensor([[seed for _, seed, _ in pieces], firsts, rows], dtype=torch.int64).to(dev)
    piece_of_row = torch.repeat_interleave(torch.arange(len(pieces), device=dev), meta[2], output_size=total)
    row_in_piece = torch.arange(total, device=dev) - (torch.cumsum(meta[2], 0) - meta[2])[piece_of_row]
    base = meta[0][piece_of_row] + 2 * (meta[1][piece_of_row] + row_in_piece)
    signs = _mix64(base)
    offsets = _lshr(_mix64(base + 1), 32) % k
    lanes = torch.arange(LANES, device=dev, dtype=torch.int64)
    positive = ((signs[:, None] >> lanes[None, :]) & 1).reshape(-1).bool()  # bit 63 too: >> keeps it in bit 0
    table = torch.where(positive, table, -table)
    by_offset = torch.zeros(k, LANES, dtype=torch.float64, device=dev)
    by_offset.index_add_(0, offsets, table.view(total, LANES))
    out.index_add_(0, _fold_index(k, str(dev)), by_offset.reshape(-1))


def _add_range(out: torch.Tensor, values: torch.Tensor, seed: int, start: int) -> None:
    """Add the sketch of ``values`` = elements ``start ...`` of one parameter into ``out`` (CPU)."""
    n = values.numel()
    if n == 0:
        return
    k = out.numel()
    first_row = start // LANES
    rows = (start + n + LANES - 1) // LANES - first_row
    pad = start - first_row * LANES
    negative, offsets = _row_hashes_cpu(seed, first_row, rows, k)
    table = _signed_table_cpu(values, negative, pad, rows)
    by_offset = torch.zeros(k, LANES, dtype=torch.float64)
    by_offset.index_add_(0, offsets, table.view(rows, LANES))
    out.index_add_(0, _fold_index(k, "cpu"), by_offset.reshape(-1))


# Values per pass of the device path: bounds its transient memory (the float64 table, its
# signed copy and the sign bits' int64 intermediate: 206 MB measured on an H100 at this size).
DEVICE_BATCH = 1 << 23


def _device_batches(pieces: list, limit: int) -> list[list]:
    """``pieces`` in order, grouped into batches of at most ``limit`` values (a larger piece
    alone); empty pieces dropped."""
    batches, size = [], 0
    for piece in pieces:
        n = piece[0].numel()
        if not n:
            continue
        if not batches or size + n > limit:
            batches.append([])
            size = 0
        batches[-1].append(piece)
        size += n
    return batches


def _add_pieces(out: torch.Tensor, pieces: list) -> None:
    """Add ``(values, seed, start)`` pieces (each at most a chunk) into ``out``: one by one on
    CPU, batched up to DEVICE_BATCH values elsewhere."""
    if out.device.type == "cpu":
        for values, seed, start in pieces:
            _add_range(out, values, seed, start)
        return
    for batch in _device_batches(pieces, DEVICE_BATCH):
        _add_pieces_torch(out, batch)


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
    out, pieces = None, []
    for i, g in enumerate(grads):
        if g is None:
            continue
        flat = g.detach().reshape(-1)
        if out is None:
            out = torch.zeros(k, dtype=torch.float64, device=flat.device)
        seed = _param_seed(nonce, i)
        pieces.extend((flat[start : start + chunk], seed, start) for start in range(0, flat.numel(), chunk))
    if out is None:
        return torch.zeros(k, dtype=torch.float64)
    _add_pieces(out, pieces)
    return out.cpu()


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
    _add_pieces(out, [(flat[offset : offset + chunk], seed, start + offset) for offset in range(0, flat.numel(), chunk)])
    return out.cpu()


def sketch_buckets(n: int, param_index: int, start: int, nonce: str | bytes | int,
                   k: int = DEFAULT_K) -> tuple[np.ndarray, np.ndarray]:
    """(bucket int64 [n] in [0, k), sign float64 [n] of +-1) of elements ``start .. start + n - 1``
    of parameter ``param_index`` under ``nonce``: the projection ``range_sketch`` applies, element
    by element (it is computed from the same row hashes, so the two cannot drift apart)."""
    if n <= 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float64)
    first_row = start // LANES
    rows = (start + n + LANES - 1) // LANES - first_row
    pad = start - first_row * LANES
    negative, offsets = _row_hashes_cpu(_param_seed(nonce, param_index), first_row, rows, k)
    # the lane of every cell of the row-aligned table, and its row's offset: bucket (offset + lane) mod k
    lanes = np.tile(np.arange(LANES, dtype=np.int64), rows)
    buckets = (np.repeat(offsets.numpy(), LANES) + lanes) % k
    signs = 1.0 - 2.0 * negative.astype(np.float64)
    return buckets[pad:pad + n], signs[pad:pad + n]


def project_out_sketch(values: torch.Tensor, param_index: int, start: int, nonce: str | bytes | int,
                       k: int = DEFAULT_K) -> torch.Tensor:
    """The orthogonal projection of ``values`` (elements ``start ...`` of parameter
    ``param_index``) onto the null space of their range sketch under ``nonce``.

    Each bucket b of the sketch reads the signed sum of its elements, so the rows of the
    projection have disjoint supports; removing ``sign_n * (sum_{m in b} sign_m * values_m) / |b|``
    from every element n of b zeroes each signed sum and changes nothing orthogonal to it.

    This is what a cheater can craft when the seed is public (the epoch's work nonce is): any
    vector it adds after this projection leaves every public range sketch unchanged, so claims,
    binding checks and page audits cannot see it, while it is almost all of the vector (k of
    the n dimensions are removed). Only a sketch under a seed the cheater does not know when it
    sends can catch such a change: why the protocol needs a secret one.
    Returns the input's dtype, on its device (computed in float64 on CPU).
    """
    flat = values.detach().reshape(-1)
    x = flat.to(device="cpu", dtype=torch.float64).numpy()
    buckets, signs = sketch_buckets(x.size, param_index, start, nonce, k)
    signed_sums = np.bincount(buckets, weights=signs * x, minlength=k)
    sizes = np.maximum(np.bincount(buckets, minlength=k), 1)  # empty buckets are never indexed
    projected = x - signs * (signed_sums / sizes)[buckets]
    return torch.from_numpy(projected).to(device=flat.device, dtype=values.dtype).reshape(values.shape)
