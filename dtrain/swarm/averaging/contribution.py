"""Contribution commitments: binding what a peer sends into a round to its work report.

hivemind splits every averaged tensor into fixed *parts* (``part_size_bytes`` after
compression), independent of the group, and hands consecutive parts to consecutive
reducers. A peer that brings weight computes, for every part, its *claim*: the range sketch
of that part *as it goes on the wire* (after the lossy compression round trip), float32,
parts in order. It puts in its gather:

* ``work``: its work report (``dtrain.training.work``): per page, the sketch of that page's
  gradient under the epoch's public work nonce;
* ``root`` and ``total``: the root of a Merkle sum tree over its claims and the digests of its
  parts' wire bytes (claims_tree.py): a 32-byte hash and the claims' sum, 64 float64. The
  claims themselves stay with the peer.

Every peer checks, from the gather alone, that the claims add up to the report's mean
sketch (``binding_error`` of ``total`` within ``BINDING_RTOL`` for the wire compression) and
that the weight claimed is at most the report's samples; a peer failing either is excluded
from the round like a wrong model. At the head of its stream to each reducer, a sender
sends the claims of that reducer's share with the tree nodes that prove them against its
root; the reducer refuses a sender whose proof does not check out, then checks every part
it receives against its claim (``PART_RTOL``) and its digest, and bans a sender whose part
contradicts either: the bytes a sender committed are the bytes its reducer used, which the
secret-seed round audit after the round rests on (audit.py).
So a negated, zeroed, rescaled, noisy or replayed contribution is caught either in the
gather (claims that are honest about what is sent) or by a reducer (claims that lie).
A peer's claims cost O(parts + reducers x log parts) bytes on the wire, not O(members x
parts) through every member's gather.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from dtrain.swarm.averaging.claims_tree import HASH_BYTES, ClaimsTree, part_digest, verify_range
from dtrain.swarm.codecs import BLOCKWISE_ERROR_BOUND, canonical_compression
from dtrain.swarm.wire import as_received, wire_form
from dtrain.sketch import range_sketch
from dtrain.sketch import WORK_SKETCH_K
from dtrain.training.work import WorkReport, WorkReportError

# How far the sum of the claims may be from the report's mean sketch, relative to its norm
# (the binding check). The claims are sketches of the parts as decoded, the report's of the exact
# gradient, so an honest peer's binding error is the sketch of the codec's error e against the
# sketch of its contribution x: ||S e|| / ||S x||. The tolerance follows one rule for every codec
# with a proven relative error bound eps (||e|| <= eps ||x|| for every input):
#
#     rho = SKETCH_MARGIN * eps.
#
# For a contribution of many more than k = 64 effective coordinates the sketch of a vector is
# k near-Gaussian buckets, so ||S e||^2 / ||S x||^2 is about (||e|| / ||x||)^2 times an F(64, 64)
# variable; F(64, 64) exceeds SKETCH_MARGIN^2 = 16 with probability 6e-23. An honest peer at the
# worst case of its codec is therefore never excluded, and a contribution that deviates from its
# committed mean by SKETCH_MARGIN * rho or more (relative L2) is refused with the same odds:
# with 8-bit that is 0.5, the smallest of the cheats the sandbox plays (x0.5, noise at half the
# norm; negated 2, zeroed 1, x2 1, a replayed gradient about 1.4). Measured margins are in
# tests/test_swarm_compression.py and docs/swarm.md ("Wire compression").
SKETCH_MARGIN = 4.0
# Per codec: none: the claims are exact, only float32 summation order separates them (the old
# 1e-4, far above it); fp16: round-to-nearest half-precision is within 2**-11 relative per element
# in its normal range [6.1e-5, 65504], so rho = 4 * 2**-11 ~ 2e-3 is the rule's value, but values
# below 6.1e-5 lose precision (below 6e-8 they vanish) and per-element gradients are often that
# small, so fp16 keeps the measured-with-headroom 5e-3 and is not recommended for tiny gradients;
# 8bit: dtrain's blockwise codec, eps = sqrt(63)/254 (dtrain.swarm.codecs.BLOCKWISE_ERROR_BOUND);
# 8bit-uniform / 8bit-quantile: hivemind's codecs have no bound (measured 0.48-0.78 on heavy-tailed
# or sparse gradients), they get 8bit's tolerance so cheats are caught alike, and an honest peer
# with such gradients can be excluded: experiments only.
_EIGHT_BIT_RTOL = SKETCH_MARGIN * BLOCKWISE_ERROR_BOUND
BINDING_RTOL = {"none": 1e-4, "fp16": 5e-3, "8bit": _EIGHT_BIT_RTOL, "8bit-uniform": _EIGHT_BIT_RTOL,
                "8bit-quantile": _EIGHT_BIT_RTOL}
# A received part against its claim: both are sketches of the very same decoded float32 values
# (the sender decodes its own encoding, the codecs are deterministic), so only the order of
# float64 additions could separate them; 1e-4 is far above that and far below any altered part.
PART_RTOL = 1e-4
# Both checks are relative, so they hold a contribution of tiny values (a late-training gradient,
# a short DiLoCo step) to the same standard as a large one; only norms at float64's underflow,
# that is exact zeros, fall back to comparing absolutely. (An absolute 1e-12 let any cheat whose
# gradient sketch was below it pass both checks.)
ABS_FLOOR = 1e-300


@dataclass(frozen=True)
class PartLayout:
    """Where each of hivemind's parts lies: (tensor index, first element, length), in order."""

    parts: tuple[tuple[int, int, int], ...]

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor], compression, part_size_bytes: int, tensor_infos=None) -> "PartLayout":
        # The same arithmetic as hivemind's TensorPartContainer (tests compare the two).
        from hivemind.compression import CompressionInfo

        if tensor_infos is None:
            tensor_infos = tuple(CompressionInfo.from_tensor(t, key=i) for i, t in enumerate(tensors))
        parts = []
        for i, (t, info) in enumerate(zip(tensors, tensor_infos)):
            per_value = t.element_size() * compression.estimate_compression_ratio(info)
            size = int(part_size_bytes / per_value)
            n = t.numel()
            for start in range(0, n, size):
                parts.append((i, start, min(size, n - start)))
        return cls(tuple(parts))

    def __len__(self) -> int:
        return len(self.parts)


def commit_parts(tensors: Sequence[torch.Tensor], layout: PartLayout, nonce: str, compression,
                 k: int = WORK_SKETCH_K) -> tuple[np.ndarray, np.ndarray]:
    """Per part, its claim (the range sketch as it will arrive) and the digest of its wire
    bytes: float32 [num_parts, k] and uint8 [num_parts, 32]."""
    claims = np.zeros((len(layout), k), dtype="<f4")
    digests = np.zeros((len(layout), HASH_BYTES), dtype=np.uint8)
    for g, (i, start, length) in enumerate(layout.parts):
        wire, decoded = wire_form(tensors[i].detach().reshape(-1)[start:start + length], compression)
        claims[g] = range_sketch(decoded, i, start, nonce, k=k).numpy()
        digests[g] = np.frombuffer(part_digest(wire), dtype=np.uint8)
    return claims, digests


def compute_claims(tensors: Sequence[torch.Tensor], layout: PartLayout, nonce: str, compression,
                   k: int = WORK_SKETCH_K, parts: Optional[Sequence[int]] = None) -> np.ndarray:
    """Per-part range sketches of ``tensors`` as they will arrive: float32 [num_parts, k]
    (with ``parts``, of those parts only, in that order: [len(parts), k])."""
    wanted = range(len(layout)) if parts is None else parts
    out = np.zeros((len(wanted), k), dtype="<f4")
    for row, g in enumerate(wanted):
        i, start, length = layout.parts[g]
        piece = tensors[i].detach().reshape(-1)[start:start + length]
        out[row] = range_sketch(as_received(piece, compression), i, start, nonce, k=k).numpy()
    return out


@dataclass
class Commitment:
    """A peer's gather commitment: its work report and the root of the tree of its claims."""

    nonce: str
    report: WorkReport
    root: bytes  # the claims tree's root hash
    total: np.ndarray  # [k] float64: the sum of the claims, as the tree adds them

    @classmethod
    def of_claims(cls, nonce: str, report, claims: np.ndarray, digests=None) -> "Commitment":
        """The commitment of a peer whose claims are ``claims`` [num_parts, k] and whose parts'
        digests are ``digests`` [num_parts, 32] (None: zeros)."""
        root = ClaimsTree(claims, digests).root
        return cls(nonce=nonce, report=report, root=root.digest, total=root.total)

    @classmethod
    def parse(cls, data: object, k: int = WORK_SKETCH_K, kind: Optional[type] = None) -> "Commitment":
        """Parse and bound a gather commitment. ``kind`` (WorkReport or TrajectoryReport): the
        report kind of this swarm's mode; a report of the other kind is refused, so a per-step
        validator never audits a trajectory, nor a DiLoCo one a page list."""
        if not isinstance(data, dict):
            raise WorkReportError("commitment must be a map")
        nonce, root, total = data.get("nonce"), data.get("root"), data.get("total")
        if not isinstance(nonce, str):
            raise WorkReportError("commitment nonce must be a string")
        if not isinstance(root, bytes) or len(root) != HASH_BYTES:
            raise WorkReportError(f"claims root must be {HASH_BYTES} bytes")
        if not isinstance(total, bytes) or len(total) != k * 8:
            raise WorkReportError(f"claims total must be {k} float64 values")
        arr = np.frombuffer(total, dtype="<f8")
        if not np.isfinite(arr).all():
            raise WorkReportError("claims total holds non-finite values")
        from dtrain.training.trajectory import parse_report

        report = parse_report(data.get("work"), k=k)
        if kind is not None and type(report) is not kind:
            raise WorkReportError(f"{'DiLoCo' if type(report) is not WorkReport else 'per-step'} work report "
                                  "in a swarm of the other averaging mode")
        return cls(nonce=nonce, report=report, root=root, total=arr)

    def to_gather(self) -> dict:
        return {"nonce": self.nonce, "work": self.report.to_wire(), "root": bytes(self.root),
                "total": np.asarray(self.total, dtype="<f8").tobytes()}

    def share_claims(self, data: bytes, *, first: int, end: int, num_parts: int, with_digests: bool = False):
        """The claims of parts ``first .. end - 1`` that a sender's proof ``data`` shows to be
        under this commitment (with ``with_digests``: and the parts' digests, as a pair;
        claims_tree.verify_range; ClaimsProofError when it does not)."""
        return verify_range(data, first=first, end=end, num_parts=num_parts, k=self.total.shape[0], root=self.root,
                            total=self.total, with_digests=with_digests)


# Why a peer of another epoch is refused (gather check; dtrain.swarm.averaging.group_rules).
OTHER_EPOCH = "work committed under another epoch's nonce"


def binding_error(commitment: Commitment) -> float:
    """||sum of claims - report mean sketch|| / ||report mean sketch|| (inf if undefined)."""
    folded = np.asarray(commitment.total, dtype=np.float64)
    expected = np.asarray(commitment.report.contribution_sketch(k=folded.shape[0]), dtype=np.float64)
    num = float(np.linalg.norm(folded - expected))
    den = float(np.linalg.norm(expected))
    if den <= ABS_FLOOR:
        return 0.0 if num <= ABS_FLOOR else math.inf
    return num / den


def binding_rtol(compression: str) -> float:
    """The binding tolerance of a compression setting (any alias; an unknown name gets the loosest)."""
    try:
        return BINDING_RTOL[canonical_compression(compression)]
    except ValueError:
        return max(BINDING_RTOL.values())


def binding_verdict(commitment: Optional[Commitment], *, weight: float, nonce: str, compression: str) -> str:
    """"" when a weighted peer's commitment binds its contribution, else the reason it does not."""
    if commitment is None:
        return "no work commitment"
    if commitment.nonce != nonce:
        return OTHER_EPOCH
    if weight > commitment.report.samples:
        return f"claims weight {weight:g} but committed {commitment.report.samples} samples"
    err = binding_error(commitment)
    if not err <= binding_rtol(compression):
        return f"contribution does not match its committed pages (sketch error {err:.2g})"
    return ""


def part_matches_claim(part: torch.Tensor, claim: np.ndarray, param_index: int, start: int, nonce: str) -> bool:
    """Whether a received (decoded) part has the sketch its sender claimed for it."""
    got = range_sketch(part, param_index, start, nonce, k=claim.shape[0]).numpy()
    want = claim.astype(np.float64)
    scale = max(float(np.linalg.norm(want)), float(np.linalg.norm(got)))
    return float(np.linalg.norm(got - want)) <= PART_RTOL * scale + ABS_FLOOR
