"""The result check: every receiver checks every reducer's result, before applying it, under a
seed that did not exist while the result could still be chosen.

A reducer's account (accounts.py) is checked under the epoch's *public* work nonce, and a
result can be altered inside that sketch's null space (``nullspace-reducer``: its result
reflected through it, about negated) with every public check still passing. The validators'
round audit (audit.py) catches it, but only after every peer has applied the round. So, at the
end of its butterfly, each receiver checks again under a seed fixed by the results themselves:

1. **The seed** (:func:`result_seed`) is a hash of every result this receiver holds, part by
   part (the group id first). A reducer's result is part of it, so the seed exists only once
   every result is final, and a reducer that changes its result changes the seed: it cannot
   choose a change in the null space of a sketch it does not know yet (the Fiat-Shamir
   heuristic). Every honest receiver holds the same results (the protocol makes them
   bit-identical), so they all derive the same seed and reach the same verdicts: a result that
   fails, fails for all of them, and they all zero the same share.
2. **The senders' sketches.** The receiver asks each sender with a coefficient in a part it
   applied (a unary p2p question, the wall's ``ask_member``) for the sketches, under that seed,
   of its parts as a receiver decodes them (:func:`encode_ask`, :func:`encode_answer`). A sender
   keeps what it sent until its next round for that; it computes each seed's sketches once.
3. **The check** (:func:`failing_parts`): each applied part's sketch must be the combination its
   reducer's account states, ``||S(r) - sum_i c_i A_i|| <= rho ||S(r)|| + 1e-4 sum_i c_i ||A_i||``
   (the public account check's tolerance), ``A_i`` the sketch sender ``i`` answered. A sender
   that did not answer is bounded instead: its term may be off by ``SILENT_SLACK`` times its
   claimed part's norm (a missing answer cannot hide a change larger than the silent sender's
   own share of the part; a silent peer never blocks a round).

A part that fails is not applied: its reducer's applied parts become zeros (as for a reducer
refused during the round, so every receiver holds the same values), and the reducer is recorded
FAIL. The receiver cannot tell a false result from a sender's false sketch, so it names no one
for the bench; what it saw is evidence (:class:`FailedPart`), which the validators' round audit
settles with the parts' committed bytes (audit.audit_round), naming whoever lied.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional, Sequence

import numpy as np
import torch

from dtrain.swarm.averaging.contribution import ABS_FLOOR, PART_RTOL
from dtrain.sketch import WORK_SKETCH_K

RESULT_SEED_TAG = b"dtrain-result-seed/v1"
RESULT_NONCE_PREFIX = "dtrain/result/v1:"
SEED_BYTES = 32
# Parts per question: an answer of 8192 sketches is 2 MiB, within p2pd's 4 MiB message.
MAX_ASK_PARTS = 8192
# A sender that did not answer: how far its term may be off, in units of its claimed part's
# norm. A sketch's norm is within about 20 % of the part's (64 buckets), so 2 covers any true
# sketch, and a change hidden behind a silent sender can be no larger than its own term.
SILENT_SLACK = 2.0
# Seeds a sender answers per round. Honest receivers derive one (the same); a receiver whose
# results differ (a reducer sent it other bytes) another. Bounded, so that a member cannot make
# a sender sketch its contribution again and again.
MAX_SEEDS_PER_ROUND = 4
# Why a receiver did not apply a reducer's parts (its record's reason; validators settle it).
REASON = "returned a part that does not add up under the round's result seed (or a sender's sketch is false)"


def result_seed(group_id: bytes, parts: Iterable[tuple[int, torch.Tensor]]) -> bytes:
    """The round's result seed: sha256 of the group id and every ``(global part index, result)``
    this receiver holds, in order (float32 bytes)."""
    h = hashlib.sha256(RESULT_SEED_TAG)
    h.update(struct.pack("<I", len(group_id)) + bytes(group_id))
    for g, values in parts:
        flat = values.detach().reshape(-1).to(dtype=torch.float32).contiguous()
        h.update(struct.pack("<II", int(g), flat.numel()))
        h.update(memoryview(flat.numpy()).cast("B"))
    return h.digest()


def result_nonce(seed: bytes) -> str:
    """The sketch nonce of a result seed (the same ``range_sketch`` as the claims)."""
    return RESULT_NONCE_PREFIX + bytes(seed).hex()


# The two questions a member asks (the first byte of a question)
ASK_SKETCHES = b"S"  # the sketches of parts under a result seed
ASK_BYTES = b"B"  # the wire bytes of parts (to re-reduce a refused reducer's share)
# Bytes of wire form per answer to ASK_BYTES: within p2pd's 4 MiB message.
MAX_ANSWER_BYTES = 3 << 20


def encode_ask(seed: bytes, parts: Sequence[int]) -> bytes:
    """A question for sketches: the kind, the seed, then the global part indices wanted (u32, ascending)."""
    if len(seed) != SEED_BYTES or not 0 < len(parts) <= MAX_ASK_PARTS:
        raise ValueError("a question names one 32-byte seed and 1 to MAX_ASK_PARTS parts")
    return ASK_SKETCHES + bytes(seed) + np.asarray(parts, dtype="<u4").tobytes()


def encode_fetch(parts: Sequence[int]) -> bytes:
    """A question for the wire bytes of the given global parts (u32, ascending)."""
    if not 0 < len(parts) <= MAX_ASK_PARTS:
        raise ValueError("a question names 1 to MAX_ASK_PARTS parts")
    return ASK_BYTES + np.asarray(parts, dtype="<u4").tobytes()


def decode_ask(payload: bytes, num_parts: int) -> tuple[bytes, Optional[bytes], list[int]]:
    """``(kind, seed or None, parts)`` of a question; ValueError naming what is wrong with it."""
    kind, payload = bytes(payload[:1]), bytes(payload[1:])
    if kind == ASK_SKETCHES:
        seed, body = payload[:SEED_BYTES], payload[SEED_BYTES:]
        if len(seed) < SEED_BYTES:
            raise ValueError("a question for sketches starts with a 32-byte seed")
    elif kind == ASK_BYTES:
        seed, body = None, payload
    else:
        raise ValueError("a question asks for sketches (S) or bytes (B)")
    if not body or len(body) % 4:
        raise ValueError("a question names whole u32 part indices")
    parts = np.frombuffer(body, dtype="<u4")
    if len(parts) > MAX_ASK_PARTS:
        raise ValueError(f"a question names at most {MAX_ASK_PARTS} parts")
    if (parts >= num_parts).any() or (np.diff(parts.astype(np.int64)) <= 0).any():
        raise ValueError(f"part indices must ascend and be below {num_parts}")
    return kind, seed, [int(g) for g in parts]


def encode_wires(wires: Sequence[bytes]) -> bytes:
    """An answer of wire bytes: per part, u32 length then the bytes."""
    return b"".join(struct.pack("<I", len(w)) + bytes(w) for w in wires)


def decode_wires(data: Optional[bytes], count: int) -> Optional[list[bytes]]:
    """The ``count`` wire forms of an answer, or None (no answer, or malformed)."""
    if data is None:
        return None
    out, at = [], 0
    for _ in range(count):
        if at + 4 > len(data):
            return None
        (n,) = struct.unpack_from("<I", data, at)
        at += 4
        if at + n > len(data):
            return None
        out.append(bytes(data[at:at + n]))
        at += n
    return out if at == len(data) else None


def encode_answer(sketches: np.ndarray) -> bytes:
    """An answer: the asked parts' sketches, float32 little-endian [parts, k]."""
    return np.ascontiguousarray(sketches, dtype="<f4").tobytes()


def decode_answer(data: Optional[bytes], num_parts: int, k: int = WORK_SKETCH_K) -> Optional[np.ndarray]:
    """The sketches of an answer, or None (no answer, the wrong size, or non-finite values:
    the sender is then treated as silent)."""
    if data is None or len(data) != num_parts * k * 4:
        return None
    sketches = np.frombuffer(data, dtype="<f4").reshape(num_parts, k)
    return sketches if np.isfinite(sketches).all() else None


def adds_up(got: np.ndarray, coefficients: np.ndarray, sketches: Mapping[int, np.ndarray], rtol: float,
            slack: float = 0.0) -> bool:
    """Whether ``got`` (a result's sketch) is ``sum_i c_i sketches[i]`` within the account check's
    tolerance (accounts.account_problem), plus ``slack`` (silent senders' bound)."""
    want, spread = np.zeros(got.shape, dtype=np.float64), 0.0
    for i, s in sketches.items():
        s = np.asarray(s, dtype=np.float64)
        want += coefficients[i] * s
        spread += coefficients[i] * float(np.linalg.norm(s))
    err = float(np.linalg.norm(np.asarray(got, dtype=np.float64) - want))
    return err <= rtol * float(np.linalg.norm(got)) + PART_RTOL * spread + slack + ABS_FLOOR


@dataclass
class FailedPart:
    """A part a receiver did not apply: its reducer and account (coefficients and each sender's
    committed digest, as for audit.ReducedPart), the result's sketch under the result seed, and
    each sender's answer for it (sender index -> sketch; a silent sender is absent)."""

    reducer: str
    coefficients: tuple[float, ...]
    digests: tuple[Optional[bytes], ...]
    got: np.ndarray
    answered: dict[int, np.ndarray] = field(default_factory=dict)


@dataclass
class ResultCheck:
    """What a receiver's result check saw (audit.RoundEvidence.result_check): the nonce of its
    result seed, the parts it checked, the senders that did not answer, and the parts it refused."""

    nonce: str
    parts_checked: int = 0
    silent: list[str] = field(default_factory=list)
    failed: dict[int, FailedPart] = field(default_factory=dict)
    # parts applied after their sender's answers were set aside (judge): one per such sender,
    # with its answer, for the validators to settle
    disputed: dict[int, FailedPart] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)  # refused reducer -> its weight as a sender

    def to_plain(self) -> dict:
        """Plain values, to leave the averager process through its result pipe."""
        return dict(nonce=self.nonce, parts_checked=self.parts_checked, silent=list(self.silent),
                    weights=dict(self.weights), failed=_plain(self.failed), disputed=_plain(self.disputed))

    @classmethod
    def from_plain(cls, data: dict) -> "ResultCheck":
        return cls(nonce=str(data["nonce"]), parts_checked=int(data["parts_checked"]),
                   silent=list(data["silent"]), failed=_parts(data["failed"]), disputed=_parts(data.get("disputed") or {}),
                   weights={str(p): float(w) for p, w in (data.get("weights") or {}).items()})


def _plain(parts: Mapping[int, FailedPart]) -> dict:
    return {g: (f.reducer, tuple(f.coefficients), tuple(f.digests), np.asarray(f.got).tolist(),
                {i: np.asarray(a).tolist() for i, a in f.answered.items()}) for g, f in parts.items()}


def _parts(data: Mapping) -> dict[int, FailedPart]:
    return {int(g): FailedPart(reducer, tuple(c), tuple(d), np.asarray(got, dtype=np.float64),
                               {int(i): np.asarray(a, dtype=np.float64) for i, a in answered.items()})
            for g, (reducer, c, d, got, answered) in data.items()}


def failing_parts(got: Mapping[int, np.ndarray], coefficients: Mapping[int, Sequence[float]],
                  answers: Mapping[int, Optional[Mapping[int, np.ndarray]]],
                  claimed_norms: Mapping[int, Mapping[int, float]], rtol: float) -> set[int]:
    """The parts whose result does not add up.

    ``got``: global part -> the result's sketch under the result seed; ``coefficients``: part ->
    its reducer's coefficients per sender; ``answers``: sender index -> (part -> its sketch) or
    None (silent); ``claimed_norms``: part -> sender index -> the norm of its public claim for the
    part (bounds a silent sender's term).
    """
    failing = set()
    for g, sketch in got.items():
        c = np.asarray(coefficients[g], dtype=np.float64)
        terms, slack = {}, 0.0
        for i in np.flatnonzero(c > 0):
            i = int(i)
            answer = answers.get(i)
            if answer is not None and g in answer:
                terms[i] = answer[g]
            else:
                slack += SILENT_SLACK * c[i] * float(claimed_norms.get(g, {}).get(i, 0.0))
        if not adds_up(sketch, c, terms, rtol, slack):
            failing.add(g)
    return failing


def judge(got: Mapping[int, np.ndarray], coefficients: Mapping[int, Sequence[float]], reducers: Mapping[int, int],
          answers: Mapping[int, Optional[Mapping[int, np.ndarray]]], claimed_norms: Mapping[int, Mapping[int, float]],
          rtol: float) -> tuple[set[int], dict[int, int]]:
    """``(failing parts, set-aside senders)``: :func:`failing_parts`, after setting aside each
    sender whose answers alone make the parts of two or more reducers fail.

    One false sender would otherwise void the round: it has a coefficient in every part, so
    false sketches make every reducer's parts fail. A sender that explains the failures of
    several reducers at once, each of which adds up without its answers (bounded as a silent
    sender's), is far likelier to be lying than all of them; its answers are set aside (the
    silent bound holds what it could cover for) and one part it contradicted is kept as
    evidence (``set-aside``: sender index -> that part), which the validators settle with its
    committed bytes. A failure of one reducer alone is that reducer's. ``reducers``: part ->
    its reducer's peer index. Deterministic, so every receiver of the same bytes and answers
    reaches the same verdict.
    """
    answers = dict(answers)
    set_aside: dict[int, int] = {}
    failing = failing_parts(got, coefficients, answers, claimed_norms, rtol)
    while len({reducers[g] for g in failing}) >= 2:
        best, best_failing = None, None
        for i in sorted(i for i, a in answers.items() if a is not None):
            touched = {g for g in failing if g in answers[i]}
            if len({reducers[g] for g in touched}) < 2:
                continue
            without = failing_parts({g: got[g] for g in failing}, coefficients, {**answers, i: None},
                                    claimed_norms, rtol)
            if best_failing is None or len(without) < len(best_failing):
                best, best_failing = i, without
        if best is None or len({reducers[g] for g in best_failing}) >= len({reducers[g] for g in failing}):
            break
        set_aside[best] = min(failing - best_failing)
        answers[best] = None
        failing = best_failing
    return failing, set_aside
