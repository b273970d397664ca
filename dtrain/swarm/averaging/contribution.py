"""Contribution commitments: binding what a peer sends into a round to its work report.

A peer that brings weight commits, for every part of its contribution, a *claim* (the part's
range sketch as it arrives, after the wire codec) and its wire bytes' digest, in a claims tree
whose root goes in its gather with its work report (:class:`Commitment`). Every peer checks
from the gather that the claims add up to the report (:func:`binding_verdict`); each reducer
checks every part it receives against its claim and digest (share.py). docs/protocol.md,
"Work commitments", gives the format and the tolerances' arithmetic.
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
from dtrain.sketch import WORK_SKETCH_K, range_sketch

# How far the sum of the claims may be from the report's mean sketch, relative to its norm (the
# binding check): rho = SKETCH_MARGIN * eps for a codec whose relative error is at most eps. An
# honest peer at its codec's worst case exceeds it with odds of 6e-23 (an F(64, 64) variable
# past 16), and a contribution off its committed mean by SKETCH_MARGIN * rho is refused with
# the same odds (docs/swarm.md, "Wire compression").
SKETCH_MARGIN = 4.0
# Per codec: none is exact but for float32 summation order; fp16 keeps a measured 5e-3 (its
# rule value, 2e-3, holds only in half precision's normal range); 8bit is dtrain's blockwise codec
# (codecs.BLOCKWISE_ERROR_BOUND); hivemind's 8-bit codecs have no bound and get 8bit's
# tolerance, for experiments only (docs/swarm.md, "Wire compression").
_EIGHT_BIT_RTOL = SKETCH_MARGIN * BLOCKWISE_ERROR_BOUND
# The ternary codec's error is a projection's: below the values, not below any fraction of them
# (up to 0.9 on honest inputs), so its rule is the margin over a bound of 1. That is too loose to
# hold a peer to its work, which is why allreduce.compression does not offer it yet
# (docs/swarm.md, "Wire compression"); benchmarks and tests reach it through GradientSwarm.
BINDING_RTOL = {"none": 1e-4, "fp16": 5e-3, "8bit": _EIGHT_BIT_RTOL, "ternary": SKETCH_MARGIN * 1.0,
                "8bit-uniform": _EIGHT_BIT_RTOL, "8bit-quantile": _EIGHT_BIT_RTOL}
# A received part against its claim: both are sketches of the very same decoded float32 values
# (the sender decodes its own encoding, the codecs are deterministic), so only the order of
# float64 additions could separate them; 1e-4 is far above that and far below any altered part.
PART_RTOL = 1e-4
# Both checks are relative, so they hold a contribution of tiny values (a late-training gradient,
# a short DiLoCo step) to the same standard as a large one; only norms at float64's underflow,
# that is exact zeros, fall back to comparing absolutely.
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

    @classmethod
    def of_values(cls, tensors: Sequence[torch.Tensor], values_per_part: int) -> "PartLayout":
        """dtrain's own butterfly: each tensor in consecutive parts of at most ``values_per_part``
        values, tensor after tensor (the same on every peer of a run: it reads only the shapes)."""
        if values_per_part < 1:
            raise ValueError(f"a part needs at least one value, got {values_per_part}")
        return cls(tuple((i, start, min(values_per_part, t.numel() - start))
                         for i, t in enumerate(tensors) for start in range(0, t.numel(), values_per_part)))

    def views(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Each part as a flat view of its (contiguous) tensor: a result written into a part
        lands in the tensor."""
        return [tensors[i].view(-1)[start:start + length] for i, start, length in self.parts]

    def __len__(self) -> int:
        return len(self.parts)

    def split(self, peer_fractions) -> tuple[int, ...]:
        """How many parts each peer reduces under load-balanced ``peer_fractions``: consecutive
        parts in order, up to each peer's pivot of the vector, a part that straddles pivots going
        to the peer that holds most of it (the same arithmetic as hivemind's TensorPartContainer,
        which the wall's runner compares before it starts)."""
        sizes = [length for _, _, length in self.parts]
        total = sum(sizes)
        pivots = (np.cumsum(peer_fractions) / np.sum(peer_fractions) * total).astype(np.int64)
        pivots[-1] = total
        counts = [0] * len(pivots)
        done, peer = 0, 0
        for n in sizes:
            if done + n > pivots[peer]:
                first, overlaps = peer, [pivots[peer] - done]
                while done + n > pivots[peer]:
                    peer += 1
                    overlaps.append(min(done + n, pivots[peer]) - pivots[peer - 1])
                counts[first + int(np.argmax(overlaps))] += 1
            else:
                counts[peer] += 1
            done += n
        return tuple(counts)


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
    return claims_of(lambda i, start, length: tensors[i].detach().reshape(-1)[start:start + length], layout, nonce,
                     compression, k, parts)


def claims_of(piece_of, layout: PartLayout, nonce: str, compression, k: int = WORK_SKETCH_K,
              parts: Optional[Sequence[int]] = None) -> np.ndarray:
    """compute_claims with each part's values read by ``piece_of(tensor index, start, length)``."""
    wanted = range(len(layout)) if parts is None else parts
    out = np.zeros((len(wanted), k), dtype="<f4")
    for row, g in enumerate(wanted):
        i, start, length = layout.parts[g]
        out[row] = range_sketch(as_received(piece_of(i, start, length), compression), i, start, nonce, k=k).numpy()
    return out


class CommitmentError(ValueError):
    """A gather commitment that cannot be parsed."""


@dataclass
class Commitment:
    """A peer's gather commitment: its work report and the root of the tree of its claims."""

    nonce: str
    report: object  # the mode's work report (samples, contribution_sketch(k), to_wire())
    root: bytes  # the claims tree's root hash
    total: np.ndarray  # [k] float64: the sum of the claims, as the tree adds them

    @classmethod
    def of_claims(cls, nonce: str, report, claims: np.ndarray, digests=None) -> "Commitment":
        """The commitment of a peer whose claims are ``claims`` [num_parts, k] and whose parts'
        digests are ``digests`` [num_parts, 32] (None: zeros)."""
        root = ClaimsTree(claims, digests).root
        return cls(nonce=nonce, report=report, root=root.digest, total=root.total)

    @classmethod
    def parse(cls, data: object, report_type, k: int = WORK_SKETCH_K) -> "Commitment":
        """Parse and bound a gather commitment; its work report with ``report_type.from_wire``
        (the report class of this swarm's averaging mode, which refuses a report of another kind).
        ValueError names what is wrong."""
        if not isinstance(data, dict):
            raise CommitmentError("commitment must be a map")
        nonce, root, total = data.get("nonce"), data.get("root"), data.get("total")
        if not isinstance(nonce, str):
            raise CommitmentError("commitment nonce must be a string")
        if not isinstance(root, bytes) or len(root) != HASH_BYTES:
            raise CommitmentError(f"claims root must be {HASH_BYTES} bytes")
        if not isinstance(total, bytes) or len(total) != k * 8:
            raise CommitmentError(f"claims total must be {k} float64 values")
        arr = np.frombuffer(total, dtype="<f8")
        if not np.isfinite(arr).all():
            raise CommitmentError("claims total holds non-finite values")
        return cls(nonce=nonce, report=report_type.from_wire(data.get("work"), k=k), root=root, total=arr)

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
