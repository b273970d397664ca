"""A Merkle sum tree over a peer's per-part claims: commit to all of them in 32 + 8·k bytes.

The gather holds only the tree's root (its hash and the claims' sum); a sender hands each
reducer the claims of its share with the nodes that prove them (:meth:`ClaimsTree.range_proof`,
:func:`verify_range`). Each leaf also binds the digest of its part's wire bytes
(:func:`part_digest`), so the bytes a sender can show after the round are the bytes its
reducer checked. The tree's layout and why the binding holds: docs/protocol.md, "Work commitments".
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import numpy as np

HASH_BYTES = 32
_LEAF, _NODE, _PART = b"dtrain-claim", b"dtrain-node", b"dtrain-part"


def part_digest(wire: bytes) -> bytes:
    """The digest of a part's wire bytes (``Tensor.buffer``, after the wire codec)."""
    h = hashlib.sha256(_PART)
    h.update(wire)  # no concatenated copy of the part
    return h.digest()


class ClaimsProofError(ValueError):
    """Claims and proof nodes that do not hash to the committed root (or do not parse)."""


@dataclass(frozen=True)
class Node:
    digest: bytes
    total: np.ndarray  # float64 [k]


def _leaf(index: int, claim: np.ndarray, digest: bytes) -> Node:
    c = np.ascontiguousarray(claim, dtype="<f4")
    return Node(hashlib.sha256(_LEAF + struct.pack("<Q", index) + digest + c.tobytes()).digest(), c.astype("<f8"))


def _parent(left: Node, right: Node) -> Node:
    digest = hashlib.sha256(_NODE + left.digest + left.total.tobytes() + right.digest + right.total.tobytes()).digest()
    return Node(digest, left.total + right.total)


def _levels(claims: np.ndarray, digests: np.ndarray) -> list[list[Node]]:
    level = [_leaf(i, c, d.tobytes()) for i, (c, d) in enumerate(zip(claims, digests))]
    if not level:
        raise ValueError("a claims tree needs at least one part")
    levels = [level]
    while len(level) > 1:
        level = [_parent(level[j], level[j + 1]) if j + 1 < len(level) else level[j] for j in range(0, len(level), 2)]
        levels.append(level)
    return levels


def as_digests(data, num_parts: int) -> np.ndarray:
    """Part digests as a uint8 array [num_parts, HASH_BYTES] (None: all zero, for claims of
    parts whose bytes nobody will check, as in tests of the sketches alone)."""
    if data is None:
        return np.zeros((num_parts, HASH_BYTES), dtype=np.uint8)
    arr = np.frombuffer(bytes(data), dtype=np.uint8) if isinstance(data, (bytes, bytearray)) else np.asarray(data)
    if arr.size != num_parts * HASH_BYTES:
        raise ValueError(f"{arr.size} digest bytes for {num_parts} parts")
    return np.ascontiguousarray(arr, dtype=np.uint8).reshape(num_parts, HASH_BYTES)


class ClaimsTree:
    """The tree over one peer's claims [num_parts, k] (float32) and its parts' digests
    [num_parts, 32] (part_digest; None: zeros)."""

    def __init__(self, claims: np.ndarray, digests=None):
        self.claims = np.ascontiguousarray(claims, dtype="<f4")
        self.digests = as_digests(digests, self.claims.shape[0])
        self.levels = _levels(self.claims, self.digests)

    @property
    def root(self) -> Node:
        return self.levels[-1][0]

    @property
    def num_parts(self) -> int:
        return self.claims.shape[0]

    def range_proof(self, first: int, end: int) -> bytes:
        """The claims of parts ``first .. end - 1``, their digests and the nodes that prove them, as bytes."""
        if not 0 <= first < end <= self.num_parts:
            raise ValueError(f"no parts {first}..{end - 1} in a tree of {self.num_parts}")
        nodes = []
        lo, hi = first, end
        for level in self.levels[:-1]:
            if lo % 2:
                nodes.append(level[lo - 1])
            if hi % 2 and hi < len(level):
                nodes.append(level[hi])
            lo, hi = lo // 2, (hi + 1) // 2
        return (self.claims[first:end].tobytes() + self.digests[first:end].tobytes()
                + b"".join(n.digest + n.total.tobytes() for n in nodes))


def proof_nodes(first: int, end: int, num_parts: int) -> int:
    """How many nodes a range proof of parts ``first .. end - 1`` carries (its size is fixed)."""
    count, lo, hi, n = 0, first, end, num_parts
    while n > 1:
        count += lo % 2
        count += 1 if hi % 2 and hi < n else 0
        lo, hi, n = lo // 2, (hi + 1) // 2, (n + 1) // 2
    return count


def proof_bytes(first: int, end: int, num_parts: int, k: int) -> int:
    return (end - first) * (k * 4 + HASH_BYTES) + proof_nodes(first, end, num_parts) * (HASH_BYTES + 8 * k)


def verify_range(data: bytes, *, first: int, end: int, num_parts: int, k: int, root: bytes,
                 total: np.ndarray, with_digests: bool = False):
    """The claims [end - first, k] of parts ``first .. end - 1`` that ``data`` proves against the
    committed ``root`` hash and ``total`` sum (with ``with_digests``: and their part digests
    [end - first, 32], as a pair); ClaimsProofError when it does not."""
    if not 0 <= first < end <= num_parts:
        raise ClaimsProofError(f"no parts {first}..{end - 1} among {num_parts}")
    want = proof_bytes(first, end, num_parts, k)
    if len(data) != want:
        raise ClaimsProofError(f"claims proof has {len(data)} bytes, expected {want}")
    head = (end - first) * (k * 4 + HASH_BYTES)
    claims = np.frombuffer(data, dtype="<f4", count=(end - first) * k).reshape(end - first, k)
    digests = np.frombuffer(data, dtype=np.uint8, count=(end - first) * HASH_BYTES,
                            offset=(end - first) * k * 4).reshape(end - first, HASH_BYTES)
    if not np.isfinite(claims).all():
        raise ClaimsProofError("claims hold non-finite values")
    node_size = HASH_BYTES + 8 * k
    proof = []
    for off in range(head, len(data), node_size):
        total_i = np.frombuffer(data, dtype="<f8", count=k, offset=off + HASH_BYTES)
        if not np.isfinite(total_i).all():
            raise ClaimsProofError("proof node holds non-finite sums")
        proof.append(Node(bytes(data[off:off + HASH_BYTES]), total_i))
    nodes = iter(proof)
    current = [_leaf(first + i, c, d.tobytes()) for i, (c, d) in enumerate(zip(claims, digests))]
    lo, hi, n = first, end, num_parts
    while n > 1:
        if lo % 2:
            current.insert(0, next(nodes))
            lo -= 1
        if hi % 2 and hi < n:
            current.append(next(nodes))
            hi += 1
        current = [_parent(current[j], current[j + 1]) if j + 1 < len(current) else current[j]
                   for j in range(0, len(current), 2)]
        lo, hi, n = lo // 2, (hi + 1) // 2, (n + 1) // 2
    top = current[0]
    if top.digest != root or not np.array_equal(top.total, np.asarray(total, dtype="<f8")):
        raise ClaimsProofError("claims do not hash to the committed root")
    return (claims, digests) if with_digests else claims
