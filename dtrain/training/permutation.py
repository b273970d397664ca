"""A keyed pseudo-random permutation of ``[0, domain)``: the bijection page assignment draws with.

A 6-round balanced Feistel network with a SHA-256 round function, cycle-walked into the
domain; docs/training.md ("Assignment") gives the exact construction.
"""

from __future__ import annotations

import hashlib


def _feistel(key: bytes, x: int, half_bits: int, rounds: int = 6) -> int:
    mask = (1 << half_bits) - 1
    left, right = x >> half_bits, x & mask
    nbytes = (half_bits + 7) // 8
    for r in range(rounds):
        f = hashlib.sha256(key + bytes([r]) + right.to_bytes(max(nbytes, 1), "big")).digest()
        left, right = right, left ^ (int.from_bytes(f[:8], "big") & mask)
    return (left << half_bits) | right


def permute(index: int, domain: int, key: bytes) -> int:
    """A keyed bijection of [0, domain): Feistel on the next even power of two, cycle-walked."""
    if not 0 <= index < domain:
        raise ValueError(f"index {index} outside [0, {domain})")
    half = max(1, ((domain - 1).bit_length() + 1) // 2)
    x = index
    while True:  # expected < 4 iterations: the Feistel domain is < 4 * domain
        x = _feistel(key, x, half)
        if x < domain:
            return x

