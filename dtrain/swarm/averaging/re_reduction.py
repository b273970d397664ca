"""Re-reduction: every receiver reduces a refused reducer's share itself, from the senders' bytes.

A refused reducer's share is zeros on every receiver (the same values everywhere). Its senders
still keep what they sent (kept.py), so each receiver fetches every weighted sender's bytes for
the zeroed parts, checks them as the reducer should have (the committed digest, finiteness, the
announced norm, the claim) and combines them under the reducer's own rule and weights, in sender
order: every honest receiver then holds the same values. A part for which any weighted sender's
bytes are missing stays zeros (fewer senders would give another receiver other values).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Optional

import torch

from dtrain.swarm.averaging.centered_clip import reduce_by_rule
from dtrain.swarm.averaging.claims_tree import part_digest
from dtrain.swarm.averaging.contribution import part_matches_claim
from dtrain.swarm.averaging.kept import MAX_ANSWER_BYTES, fetch_wires
from dtrain.swarm.averaging.norms import part_check, within_norm
from dtrain.swarm.averaging.result_check import question_timeout
from dtrain.swarm.wire import decode_wire

logger = logging.getLogger(__name__)


async def re_reduce(plan, butterfly, io, kept, part_size_bytes: int) -> None:
    """Re-reduce every refused reducer's zeroed parts (``butterfly.refused_parts``) and write
    them in (``butterfly.write_recovered``). ``io``: the averager (``ask_member``); ``kept``: what
    we sent this round (None: nothing)."""
    refused = butterfly.refused_parts()
    if not refused:
        return
    loop = asyncio.get_event_loop()
    timeout_s = question_timeout(plan)
    per_question = max(1, MAX_ANSWER_BYTES // max(1, part_size_bytes))

    async def bytes_of(i: int, parts: list[int]) -> dict[int, bytes]:
        if i == plan.my_sender_index:
            return {} if kept is None else dict(zip(parts, await kept.wires(parts)))
        return await fetch_wires(io, plan.sender_ids[i], plan.group_id, parts, per_question, timeout_s)

    for k, parts in refused.items():
        rule = plan.reducer_rules.get(k)
        if rule is None:
            continue
        weights, robust = rule
        needed = [i for i, w in enumerate(weights) if w > 0]
        fetched = dict(zip(needed, await asyncio.gather(*(bytes_of(i, parts) for i in needed))))
        recovered = 0
        for g in parts:
            wires = {i: fetched[i][g] for i in needed if g in fetched[i]}
            if len(wires) != len(needed):
                continue
            values = await loop.run_in_executor(None, combine, plan, butterfly, k, g, wires, weights, robust)
            if values is not None:
                butterfly.write_recovered(k, g, values)
                recovered += 1
        logger.info("swarm: re-reduced %d of %d refused parts of reducer %s", recovered, len(parts),
                    plan.rules.peer_ids[k])


def combine(plan, butterfly, k: int, g: int, wires: dict[int, bytes], weights, robust: bool) -> Optional[torch.Tensor]:
    """Part ``g`` of refused reducer ``k``'s share from its senders' ``wires``, under its rule; None
    when a sender's bytes are not the ones it committed (nothing every receiver would agree on)."""
    param_index, start, length = plan.layout.parts[g]
    parts, used = [], []
    for i in sorted(wires):
        digest, claim = butterfly.sender_proof(k, i, g)
        if digest is None or part_digest(wires[i]) != digest:
            return None
        try:
            x = decode_wire(wires[i], length, plan.compression)
        except ValueError:
            return None
        finite, norm = part_check(x)
        bound = plan.rules.sender_norms[i]
        if not finite or not within_norm(norm, bound) \
                or not part_matches_claim(x, claim, param_index, start, plan.rules.claims_nonce):
            continue  # what the reducer should have refused: left out, as it would have been
        parts.append(x.float())
        used.append(float(weights[i]))
    if not parts:
        return None
    return reduce_by_rule(parts, used, robust)
