"""The result check: every receiver checks every reducer's result, before applying it, under a
seed that did not exist while the result could still be chosen.

The seed is a hash of every result this receiver holds (:func:`result_seed`), so a reducer
cannot aim a change at the null space of a sketch it does not know yet, and every honest
receiver, holding the same results, derives the same seed and reaches the same verdicts. Each
applied part's sketch must be the combination its reducer's account states of the sketches its
senders answer under that seed (:func:`judge`); a reducer whose part fails has its applied parts
zeroed and is recorded FAIL, and what the receiver saw is evidence the validators' round audit
settles (audit.py). docs/protocol.md, "Result check", gives the protocol and its arithmetic.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import struct
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional, Sequence

import numpy as np
import torch

from dtrain.sketch import WORK_SKETCH_K, range_sketch
from dtrain.swarm.averaging.contribution import ABS_FLOOR, PART_RTOL
from dtrain.swarm.averaging.kept import ask_sketches

logger = logging.getLogger(__name__)

RESULT_SEED_TAG = b"dtrain-result-seed/v1"
RESULT_NONCE_PREFIX = "dtrain/result/v1:"
# A sender that did not answer: how far its term may be off, in units of its claimed part's
# norm. A sketch's norm is within about 20 % of the part's (64 buckets), so 2 covers any true
# sketch, and a change hidden behind a silent sender can be no larger than its own term.
SILENT_SLACK = 2.0
# The least time a member is given to answer a question (its sender timeout when longer): it
# sketches what it sent once per round, a fraction of a second per 16 MiB.
MIN_QUESTION_TIMEOUT_S = 10.0
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


def question_timeout(plan) -> float:
    """How long a member has to answer a question after the butterfly."""
    return max(MIN_QUESTION_TIMEOUT_S, plan.sender_timeout)


async def check_results(plan, butterfly, tensors, io, kept) -> Optional[ResultCheck]:
    """Check every part another reducer returned that we applied, under the round's result seed;
    refuse (zero) the applied parts of a reducer that fails (``butterfly.refuse_unconfirmed``).
    ``io``: the averager (``ask_member``); ``kept``: what we sent this round (None: nothing).
    None when nothing was applied from another reducer."""
    applied = butterfly.applied_by_others()
    if not applied:
        return None
    loop = asyncio.get_event_loop()
    held = sorted(set(applied) | set(plan.own_share))
    seed = await loop.run_in_executor(None, result_seed, plan.group_id, [(g, plan.piece(tensors, g)) for g in held])
    nonce = result_nonce(seed)
    # Every honest member derives this seed, so the others will ask us with it: start sketching
    # what we sent now, and our own results while our questions are out.
    if kept is not None:
        kept.sketches_for_seed(seed, nonce)
    ours = loop.run_in_executor(None, _sketch_parts, plan, tensors, sorted(applied), nonce)
    wanted: dict[int, list[int]] = {}  # sender index -> the parts it has a coefficient in
    for g, (_, coefficients) in sorted(applied.items()):
        for i, c in enumerate(coefficients):
            if c > 0:
                wanted.setdefault(i, []).append(g)
    timeout_s = question_timeout(plan)

    async def answers_of(i: int):
        if i != plan.my_sender_index:
            return await ask_sketches(io, plan.sender_ids[i], plan.group_id, seed, wanted[i], timeout_s)
        future = None if kept is None else kept.sketches_for_seed(seed, nonce)
        sketches = None if future is None else await asyncio.shield(future)
        return None if sketches is None else {g: sketches[g] for g in wanted[i]}

    answered = dict(zip(wanted, await asyncio.gather(*(answers_of(i) for i in wanted))))
    return _verdict(plan, butterfly, applied, await ours, answered, nonce)


def _verdict(plan, butterfly, applied: dict, got: dict, answered: dict, nonce: str) -> ResultCheck:
    """Judge the answers, refuse the reducers whose parts fail, and keep what was seen."""
    norms = {g: {i: butterfly.claimed_norm(g, i) for i, c in enumerate(applied[g][1]) if c > 0} for g in applied}
    failing, set_aside = judge(got, {g: c for g, (_, c) in applied.items()}, {g: p for g, (p, _) in applied.items()},
                               answered, norms, plan.account_rtol)
    senders = plan.sender_ids
    check = ResultCheck(nonce=nonce, parts_checked=len(applied),
                        silent=sorted(senders[i] for i, a in answered.items() if a is None))

    def evidence_of(g: int) -> FailedPart:
        peer_index, coefficients = applied[g]
        return FailedPart(plan.rules.peer_ids[peer_index], tuple(coefficients), butterfly.digests_of(g), got[g],
                          {i: a[g] for i, a in answered.items() if a is not None and g in a})

    check.failed = {g: evidence_of(g) for g in sorted(failing)}
    check.disputed = {g: evidence_of(g) for g in sorted(set(set_aside.values()))}
    for i in set_aside:
        logger.warning("swarm: setting aside the result-check answers of %s: they alone contradict several "
                       "reducers", senders[i])
    for peer_index in sorted({applied[g][0] for g in failing}):
        logger.warning("swarm: refusing reducer %s: %s", plan.rules.peer_ids[peer_index], REASON)
        butterfly.refuse_unconfirmed(peer_index, REASON)
    # the weight each refused reducer had as a sender: a validator that finds a sender lied gives it back
    rules = plan.rules
    check.weights = {p: rules.used[rules.peer_ids.index(p)] for p in butterfly.unconfirmed_reducers}
    return check


def _sketch_parts(plan, tensors, parts, nonce: str) -> dict:
    """Global part -> the sketch (float64 numpy) of our result for it under ``nonce``."""
    out = {}
    for g in parts:
        param_index, start, _ = plan.layout.parts[g]
        out[g] = range_sketch(plan.piece(tensors, g), param_index, start, nonce, k=WORK_SKETCH_K).numpy()
    return out
