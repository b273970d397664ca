"""The result check of a round on dtrain's own butterfly: after the butterfly, before the result
is used, every receiver checks each other reducer's results under a seed that did not exist
while they could still be chosen.

The seed hashes the round id and every result this receiver holds (averaging.result_check:
``result_seed``), so a reducer cannot aim a change at the null space of a sketch it did not
know, and receivers holding the same results derive the same seed and reach the same verdicts.
Each sender with a coefficient in an applied part is asked (dtrain.swarm.questions) for its
sketches of those parts under the seed; a part whose result is not the combination its account
states of those sketches fails (``judge``, which sets aside a sender whose answers alone make
several reducers fail), and a failing reducer's applied parts become zeros on this receiver and
it is refused. What the check saw goes into the round's evidence for the validators' round
audit, which settles it with the committed bytes (averaging.audit).

Then :func:`re_reduce`: every receiver reduces a refused reducer's zeroed parts itself, from the
senders' committed bytes, so that a cheating reducer costs the round nothing.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Optional, Sequence

import torch

from dtrain.sketch import WORK_SKETCH_K, range_sketch
from dtrain.swarm.averaging.kept import MAX_ANSWER_BYTES, SentContribution, ask_sketches, fetch_wires
from dtrain.swarm.averaging.result_check import REASON, FailedPart, ResultCheck, judge, result_nonce, result_seed
from dtrain.swarm.butterfly import ButterflyOutcome

logger = logging.getLogger(__name__)


async def check_results(checks, parts: Sequence[torch.Tensor], outcome: ButterflyOutcome, questions,
                        sent: Optional[SentContribution], timeout_s: float) -> Optional[ResultCheck]:
    """Check the results ``checks`` (commitments.CommittedChecks, after the butterfly) applied
    from other reducers; zero and refuse (in ``outcome``) the reducers whose results fail.
    ``questions``: how senders are asked (questions.KeptRounds); ``sent``: what we sent (None:
    we did not send). None when nothing was applied from another reducer."""
    evidence, membership = checks.evidence, checks.membership
    applied = dict(evidence.parts) if evidence is not None else {}
    if not applied:
        return None
    loop = asyncio.get_running_loop()
    first, end = membership.share_of(checks.me)
    own = [g for g in range(first, end) if g not in outcome.unaveraged_parts]
    held = sorted(set(applied) | set(own))
    round_key = membership.round_id.encode()
    seed = await loop.run_in_executor(None, result_seed, round_key, [(g, parts[g]) for g in held])
    nonce = result_nonce(seed)
    # every honest receiver derives this seed and will ask us with it: start sketching now
    if sent is not None:
        sent.sketches_for_seed(seed, nonce)
    ours = loop.run_in_executor(None, _sketches, checks.layout, parts, sorted(applied), nonce)
    wanted: dict[int, list[int]] = {}  # sender index -> the applied parts it has a coefficient in
    for g, reduced in sorted(applied.items()):
        for i, c in enumerate(reduced.coefficients):
            if c > 0:
                wanted.setdefault(i, []).append(g)

    async def answers_of(i: int):
        if i != checks.my_sender:
            return await ask_sketches(questions, evidence.senders[i], round_key, seed, wanted[i], timeout_s)
        future = None if sent is None else sent.sketches_for_seed(seed, nonce)
        sketches = None if future is None else await asyncio.shield(future)
        return None if sketches is None else {g: sketches[g] for g in wanted[i]}

    answered = dict(zip(wanted, await asyncio.gather(*(answers_of(i) for i in wanted))))
    got = await ours
    norms = {g: {i: checks.claimed_norm(g, i) for i, c in enumerate(r.coefficients) if c > 0}
             for g, r in applied.items()}
    failing, set_aside = judge(got, {g: r.coefficients for g, r in applied.items()},
                               {g: r.reducer for g, r in applied.items()}, answered, norms, checks.rtol)
    check = ResultCheck(nonce=nonce, parts_checked=len(applied),
                        silent=sorted(evidence.senders[i] for i, a in answered.items() if a is None))

    def seen(g: int) -> FailedPart:
        r = applied[g]
        return FailedPart(r.reducer, tuple(r.coefficients), tuple(r.digests), got[g],
                          {i: a[g] for i, a in answered.items() if a is not None and g in a})

    check.failed = {g: seen(g) for g in sorted(failing)}
    check.disputed = {g: seen(g) for g in sorted(set(set_aside.values()))}
    for i in set_aside:
        logger.warning("round %s: setting aside the result-check answers of %s: they alone contradict several "
                       "reducers", membership.round_id, evidence.senders[i])
    for reducer in sorted({applied[g].reducer for g in failing}):
        k = membership.peers.index(reducer)
        logger.warning("round %s: refusing reducer %s: %s", membership.round_id, reducer, REASON)
        outcome.refused_reducers[k] = REASON
        for g in [g for g, r in applied.items() if r.reducer == reducer]:
            parts[g].zero_()  # what every receiver of the same bytes and answers holds
            outcome.zeroed_parts.add(g)
            del evidence.parts[g]
        s = membership.sender_index(k)
        if s is not None:
            check.weights[reducer] = checks.weights[s]
    evidence.result_check = check
    return check


def _sketches(layout, parts: Sequence[torch.Tensor], wanted: Sequence[int], nonce: str) -> dict:
    """Global part -> the sketch (float64 numpy) of our result for it under ``nonce``."""
    out = {}
    for g in wanted:
        i, start, _ = layout.parts[g]
        out[g] = range_sketch(parts[g], i, start, nonce, k=WORK_SKETCH_K).numpy()
    return out


async def re_reduce(checks, parts: Sequence[torch.Tensor], outcome: ButterflyOutcome, questions,
                    sent: Optional[SentContribution], timeout_s: float) -> int:
    """Reduce every refused reducer's zeroed parts (``outcome.zeroed_parts``) ourselves, from the
    senders' wire bytes, and write them into ``parts``; the number of parts recovered.

    Each weighted sender is asked once for its bytes of those parts (``questions``: how members
    are asked; ``sent``: what we sent, for our own). A sender's bytes go in when they have the
    digest and meet the claim it committed for the part (as the reducer's forwarded proofs, which
    every receiver verified against its signed root, state them): a sender whose bytes miss the
    claim is left out, as the reducer should have left it; bytes of another digest, or a weighted
    sender that does not answer, leave the part at zeros (fewer senders would give another
    receiver other values). The rule and weights are the round's, in sender order, so every
    honest receiver of the same bytes holds the same values."""
    zeroed: dict[int, list[int]] = {}
    for g in sorted(outcome.zeroed_parts):
        zeroed.setdefault(checks.reducer_of(g), []).append(g)
    needed = [s for s, w in enumerate(checks.weights) if w > 0]
    if not zeroed or not needed or questions is None:
        return 0
    loop = asyncio.get_running_loop()
    round_key = checks.membership.round_id.encode()
    largest = max(length for _, _, length in checks.layout.parts)
    per_question = max(1, MAX_ANSWER_BYTES // max(1, 4 * largest))
    recovered = 0
    for k, wanted in sorted(zeroed.items()):
        proofs = checks.forwarded(k)
        if proofs is None:
            continue  # its forwarded claims did not prove out: nothing to check the bytes by

        async def bytes_of(s: int) -> dict[int, bytes]:
            if s == checks.my_sender:
                return {} if sent is None else dict(zip(wanted, await sent.wires(wanted)))
            return await fetch_wires(questions, checks.evidence.senders[s], round_key, wanted, per_question,
                                     timeout_s)

        fetched = dict(zip(needed, await asyncio.gather(*(bytes_of(s) for s in needed))))
        first = checks.membership.share_of(k)[0]
        for g in wanted:
            wires = {s: fetched[s].get(g) for s in needed}
            if any(w is None for w in wires.values()):
                continue
            values = await loop.run_in_executor(None, _combined, checks, proofs, g, g - first, wires)
            if values is not None:
                parts[g].copy_(values)
                outcome.zeroed_parts.discard(g)
                outcome.recovered_parts.add(g)
                recovered += 1
        logger.info("round %s: re-reduced %d of %d refused parts of reducer #%d", checks.membership.round_id,
                    sum(g in outcome.recovered_parts for g in wanted), len(wanted), k)
    return recovered


def _combined(checks, proofs, g: int, j: int, wires: dict[int, bytes]) -> Optional[torch.Tensor]:
    """Part ``g`` (``j`` of its reducer's share) from its senders' ``wires``, under the round's
    rule; None when a sender's bytes are not the ones it committed, or none meets its claim."""
    from dtrain.swarm.averaging.centered_clip import reduce_by_rule
    from dtrain.swarm.averaging.claims_tree import part_digest
    from dtrain.swarm.averaging.contribution import part_matches_claim

    i, start, length = checks.layout.parts[g]
    taken, weights = [], []
    for s in sorted(wires):
        proof = proofs[s]
        if proof is None:
            return None  # the reducer showed no proof of this weighted sender: nothing to hold its bytes to
        claims, digests = proof
        if part_digest(wires[s]) != bytes(digests[j]):
            return None
        try:
            x = checks.codec.decode(wires[s], length)
        except ValueError:
            return None
        if not bool(torch.isfinite(x).all()) or not part_matches_claim(x, claims[j], i, start, checks.nonce):
            continue  # what the reducer should have left out
        taken.append(x.float())
        weights.append(float(checks.weights[s]))
    if not taken:
        return None
    return reduce_by_rule(taken, weights, checks.robust)
