"""The secret-seed round audit a validator runs after each round.

Every check during a round reads sketches under the epoch's public work nonce, and a change
crafted into that sketch's null space passes all of them. So after a round a validator draws a
fresh seed and checks the round again under it: each sender's sketches of what it sent (its
kept contribution, kept.py), each applied part against its reducer's account
(:func:`audit_round`), a part that does not add up settled with the senders' committed bytes,
naming whoever lied; and, for sampled miners, what they sent against their recomputed batch
(:func:`batch_problem`). docs/protocol.md, "Round audit".
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Sequence

import numpy as np
import torch

from dtrain.swarm.averaging.claims_tree import part_digest
from dtrain.swarm.averaging.contribution import ABS_FLOOR, PART_RTOL, PartLayout
from dtrain.swarm.wire import decode_wire, make_compression
from dtrain.swarm.averaging.result_check import ResultCheck, adds_up
from dtrain.sketch import WORK_SKETCH_K, range_sketch

AUDIT_NONCE_PREFIX = "dtrain/audit/v1:"
# The most parts an audit answer may carry: 8 MiB of float32 sketches (an answer must fit the
# API client's 16 MiB JSON limit in base64): 4 GiB of float32 contribution at 128 KiB parts,
# 16 GiB at the 512 KiB parts of every GPT-2 preset (gpt2-1b is 4.1 GB: 7,760 parts).
MAX_AUDIT_PARTS = 32768


def audit_nonce(seed: bytes) -> str:
    """The sketch nonce of an audit seed (a validator draws 32 random bytes after the round)."""
    return AUDIT_NONCE_PREFIX + bytes(seed).hex()


@dataclass(frozen=True)
class ReducedPart:
    """One averaged part as a receiver applied it: who reduced it and how (its account), and
    the digest each sender committed for its bytes (None: not shown, the sender had no weight)."""

    reducer: str  # peer id
    coefficients: tuple[float, ...]  # per sender, in sender order
    digests: tuple[Optional[bytes], ...]


@dataclass
class RoundEvidence:
    """What a receiver keeps of a round for the audit: the senders in order, the part layout
    and codec, every applied part's account (global part index -> ReducedPart), and what its
    result check saw (result_check.py: the parts it refused, with the sketches it was answered)."""

    senders: list[str]
    layout: PartLayout
    compression: str  # the wire codec's setting (allreduce.compression)
    parts: dict[int, ReducedPart] = field(default_factory=dict)
    result_check: Optional[ResultCheck] = None
    codec: Optional[object] = None  # dtrain's PartCodec of a round on its own butterfly (None: hivemind's)


# (peer id, part) -> that part's wire bytes as the sender shows them (None: it did not)
FetchPart = Callable[[str, int], Optional[bytes]]


@dataclass
class AuditResult:
    """The audit's findings: peer id -> why it failed, and per sender the parts whose reported
    sketches the audit confirmed (against a result that adds up, or against the bytes)."""

    problems: dict[str, str] = field(default_factory=dict)
    # the peers named on evidence (bytes that hash to their commitment, or a result that does
    # not add up with them), not for a missing or malformed answer, which a fault can explain
    proven: set[str] = field(default_factory=set)
    confirmed: dict[str, set[int]] = field(default_factory=dict)
    parts_checked: int = 0
    parts_skipped: int = 0  # a sender with a coefficient that we did not ask (another validator)
    disputes: int = 0


def audit_round(evidence: RoundEvidence, result: Sequence[torch.Tensor], reports: Mapping[str, Optional[np.ndarray]],
                nonce: str, rtol: float, fetch: FetchPart) -> AuditResult:
    """Check every applied part of the round under the secret ``nonce``.

    ``result``: the averaged tensors as this receiver applied them; ``reports``: per sender we
    asked, its sketches of all its parts [num_parts, k] (None: it did not answer); ``rtol``: the
    wire codec's tolerance (contribution.binding_rtol), as for the public account check.
    """
    out = AuditResult()
    k = WORK_SKETCH_K
    for peer, sketches in reports.items():
        if sketches is None:
            continue
        if sketches.shape != (len(evidence.layout), k):
            out.problems[peer] = f"answered the round audit with {sketches.shape[0]} parts, expected {len(evidence.layout)}"
        elif not np.isfinite(sketches).all():
            # NaN would compare unequal to nothing and confirm nothing: a way out of the batch audit
            out.problems[peer] = "answered the round audit with non-finite sketches"
    for g, reduced in sorted(evidence.parts.items()):
        c = np.asarray(reduced.coefficients, dtype=np.float64)
        used = [i for i in range(len(c)) if c[i] > 0]
        if not used:
            continue
        senders = [evidence.senders[i] for i in used]
        if any(s not in reports for s in senders):
            out.parts_skipped += 1
            continue
        silent = [s for s in senders if reports[s] is None]
        for s in silent:  # only a sender whose parts are in what we applied owes an answer
            out.problems.setdefault(s, "did not answer the round audit, though its parts are in the result")
        if silent or reduced.reducer in out.problems or any(s in out.problems for s in senders):
            # nothing to weigh this part against, or its verdict is in: one dispute per cheat, so
            # a cheat cannot make us download its whole share (or every share it is in) part by part
            continue
        out.parts_checked += 1
        param, start, length = evidence.layout.parts[g]
        got = range_sketch(result[param].reshape(-1)[start:start + length], param, start, nonce, k=k).numpy()
        claimed = {i: reports[evidence.senders[i]][g].astype(np.float64) for i in used}
        if adds_up(got, c, claimed, rtol):
            for i in used:
                out.confirmed.setdefault(evidence.senders[i], set()).add(g)
            continue
        out.disputes += 1
        _settle(out, evidence, g, reduced, c, used, claimed, got, nonce, rtol, fetch)
    _settle_result_check(out, evidence, rtol, fetch)
    return out


def _settle_result_check(out: AuditResult, evidence: RoundEvidence, rtol: float, fetch: FetchPart) -> None:
    """The parts our result check refused during the round, and those it applied after setting
    a sender's answers aside (result_check.judge): settle each with the committed bytes, under
    the result seed it was checked under, as a dispute. A sender whose bytes contradict the
    sketch it answered lied; when every answer is true, the reducer's result was false. One
    dispute per cheat."""
    check = evidence.result_check
    if check is None:
        return
    for g, failed in sorted({**check.disputed, **check.failed}.items()):
        c = np.asarray(failed.coefficients, dtype=np.float64)
        used = [i for i in range(len(c)) if c[i] > 0]
        senders = [evidence.senders[i] for i in used]
        if failed.reducer in out.problems or any(s in out.problems for s in senders):
            continue
        out.disputes += 1
        reduced = ReducedPart(failed.reducer, failed.coefficients, failed.digests)
        _settle(out, evidence, g, reduced, c, used, dict(failed.answered), np.asarray(failed.got), check.nonce,
                rtol, fetch)


def _settle(out: AuditResult, evidence: RoundEvidence, g: int, reduced: ReducedPart, c: np.ndarray,
            used: list[int], claimed: dict[int, np.ndarray], got: np.ndarray, nonce: str, rtol: float,
            fetch: FetchPart) -> None:
    """A part that does not add up: sketch each sender's committed bytes ourselves and name who lied."""
    param, start, length = evidence.layout.parts[g]
    true: dict[int, np.ndarray] = {}
    for i in used:
        peer = evidence.senders[i]
        wire = fetch(peer, g)
        digest = reduced.digests[i] if i < len(reduced.digests) else None
        if wire is None:
            out.problems.setdefault(peer, f"did not show the bytes of part {g} in the round audit")
            continue
        if digest is None:
            # its reducer used a part it did not prove the digest of; with required commitments
            # the public account check refuses that, so this is a peer without commitments
            out.problems.setdefault(peer, f"committed no digest for part {g}, so its bytes cannot be checked")
            continue
        if part_digest(wire) != digest:
            out.problems.setdefault(peer, f"showed bytes of part {g} that are not the ones it committed")
            out.proven.add(peer)
            continue
        try:
            decoded = decode_wire(wire, length, evidence.codec or make_compression(evidence.compression))
        except ValueError as exc:
            out.problems.setdefault(peer, f"showed bytes of part {g} that do not decode ({exc})")
            continue
        true[i] = range_sketch(decoded, param, start, nonce, k=got.shape[0]).numpy()
        if i not in claimed:
            continue  # it did not answer (the result check's silent sender): nothing to hold it to
        scale = max(float(np.linalg.norm(true[i])), float(np.linalg.norm(claimed[i])))
        if not float(np.linalg.norm(true[i] - claimed[i])) <= PART_RTOL * scale + ABS_FLOOR:
            out.problems.setdefault(peer, f"reported a sketch of part {g} that its own bytes contradict "
                                          "(secret-seed round audit)")
            out.proven.add(peer)
    if len(true) == len(used) and not adds_up(got, c, true, rtol):
        out.problems.setdefault(reduced.reducer, f"returned part {g} that is not the combination its account "
                                                 "states (secret-seed check)")
        out.proven.add(reduced.reducer)


def clear_framed_reducers(record, evidence: RoundEvidence, result: AuditResult) -> list[str]:
    """Give back SUCCESS, in ``record`` (our RoundRecord), to every reducer our result check
    refused whose dispute named someone else (a sender's sketch was false) and not it: no honest
    peer is marked down for another's lie. Returns the reducers cleared."""
    check = evidence.result_check
    if check is None:
        return []
    framed = set()
    for g, failed in check.failed.items():
        named = {evidence.senders[i] for i, c in enumerate(failed.coefficients) if c > 0} & set(result.problems)
        if failed.reducer not in result.problems and named - {failed.reducer}:
            framed.add(failed.reducer)
    guilty = {f.reducer for f in check.failed.values()} - framed
    cleared = []
    for p in record.peers:
        if p.peer_id in framed and p.peer_id not in guilty and p.peer_id not in result.problems:
            from dtrain.swarm.records import Outcome

            p.outcome, p.reason = Outcome.SUCCESS, ""
            p.weight_used = float(check.weights.get(p.peer_id, p.weight_claimed))
            cleared.append(p.peer_id)
    if cleared:
        record.total_weight = float(sum(p.weight_used for p in record.peers))
    return cleared


# How many rounds a validator names a peer its audit *proved* at fault (see AuditResult.proven)
# in its AllReduce queries, so that the miners bench it as a reducer: the evidence is bytes that
# hash to its own commitment, no accident explains it, and a bench of BENCH_ROUNDS (10) would let
# it alter one round in eleven. A peer named for a missing or malformed answer gets 10.
PROVEN_BENCH_ROUNDS = 100

# How far a recomputed batch's secret-seed sketch may be from what the miner sent, relative to its
# norm, beyond the wire codec's own tolerance: the page audits' recomputation tolerance (cosine
# >= 0.995 and norm within 2 % allow a relative error of about 0.1; docs/scoring.md). A
# contribution hidden in the public sketch's null space is off by its own size (the sandbox's
# null-space sender: about 2), caught; a change below this bound passes, and CenteredClip bounds it.
BATCH_AUDIT_RTOL = 0.1


@dataclass(frozen=True)
class SenderAudit:
    """The round audit of one sender: its sketches of what it sent under the secret nonce, and the
    parts whose sketches the audit confirmed (against a result that adds up, or the bytes)."""

    nonce: str
    sketches: np.ndarray  # float32 [num_parts, k]
    confirmed: frozenset[int]
    layout: PartLayout
    rtol: float  # the wire codec's tolerance (contribution.binding_rtol)


def batch_problem(work_mean: Sequence[Optional[torch.Tensor]], sent: SenderAudit) -> str:
    """"" when what a miner sent (``sent``: its round audit, the confirmed parts) sketches
    under the secret nonce like ``work_mean``, the mean gradient its committed batch gives as
    the validator recomputed it (None: a parameter without gradient, zeros); else why not."""
    parts = sorted(sent.confirmed)
    if not parts:
        return ""
    k = sent.sketches.shape[1]
    want, got = np.zeros(k), np.zeros(k)
    for g in parts:
        param, start, length = sent.layout.parts[g]
        got += sent.sketches[g].astype(np.float64)
        grad = work_mean[param]
        if grad is not None:
            want += range_sketch(grad.reshape(-1)[start:start + length], param, start, sent.nonce, k=k).numpy()
    err, scale = float(np.linalg.norm(got - want)), float(np.linalg.norm(want))
    if err > (sent.rtol + BATCH_AUDIT_RTOL) * scale + ABS_FLOOR:
        return (f"sent a contribution that its committed batch does not give (secret-seed sketch error "
                f"{err / max(scale, ABS_FLOOR):.2g} over {len(parts)} parts)")
    return ""


def draw_seed() -> bytes:
    """A fresh audit seed, 32 bytes from the OS's randomness: drawn only after the round is over."""
    return secrets.token_bytes(32)

