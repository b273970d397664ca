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
"""

from __future__ import annotations

import asyncio
import logging
from typing import Optional, Sequence

import torch

from dtrain.sketch import WORK_SKETCH_K, range_sketch
from dtrain.swarm.averaging.kept import SentContribution, ask_sketches
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
