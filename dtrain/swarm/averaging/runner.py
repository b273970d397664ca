"""The butterfly runner with dtrain's checks on what crosses the wire, both ways.

* Claims. Each part a sender sends is checked, in the thread that decodes it, against the
  sketch its sender committed for that part (contribution.py); a part that contradicts it
  bans the sender.
* Averaged parts. What a reducer returns (and what we reduce ourselves) is applied only if
  it is finite and no larger than the largest announced contribution (``NORM_SLACK``); else
  that reducer's share keeps our local values and the reducer is recorded FAIL.
* Serialisation once. All senders of a part receive the same averaged tensor, so its wire
  form is computed once and shared.
* Reply streams. A reducer keeps a sender's stream open after the last averaged part until
  the sender hangs up (``REPLY_LINGER_S``, see the wall's CountingStub).

Transport and the butterfly itself are hivemind's (the wall's ButterflyRunner).
"""

from __future__ import annotations

import asyncio
from typing import Optional, Sequence

import torch

from dtrain.swarm.averaging.contribution import as_received
from dtrain.swarm.averaging.reducer import CheckedReducer, SenderBanned, part_check, within_norm
from dtrain.swarm.hivemind_internals import ButterflyRunner, serialize_part

# How long a reducer keeps a sender's stream open after its last averaged part, waiting for
# the sender to hang up (it does so at once; this only bounds a sender that does not).
REPLY_LINGER_S = 30.0


class CheckedRunner(ButterflyRunner):
    """One peer's butterfly in one group: reducer weights and norms fixed at group formation."""

    reply_linger_s = REPLY_LINGER_S

    def __init__(self, *, sender_weights: Sequence[float], sender_norms: Optional[Sequence[float]] = None,
                 max_norm: Optional[float] = None, robust: bool = False, sender_claims: Optional[Sequence] = None,
                 claims_nonce: str = "", layout=None, **kwargs):
        # read by new_reducer, which the base class calls
        self.sender_weights = list(sender_weights)
        self.sender_norms = list(sender_norms) if sender_norms is not None else None
        self.max_norm = max_norm
        self.robust = robust
        # per sender (in sender order): its claims array [num_parts, k], or None (not checked)
        self.sender_claims = list(sender_claims) if sender_claims is not None else None
        self.claims_nonce = claims_nonce
        self.layout = layout
        # (part index, compression) -> (averaged part, future of its serialised form)
        self._serialized_cache: dict[tuple[int, int], tuple[torch.Tensor, asyncio.Future]] = {}
        super().__init__(**kwargs)
        self._first_part = self.first_part

    def as_received(self, part: torch.Tensor) -> torch.Tensor:
        # the one definition, shared with the claims (compute_claims), so they agree bit for bit
        return as_received(part, self.wire_compression)

    def new_reducer(self, part_shapes: tuple, num_senders: int) -> CheckedReducer:
        return CheckedReducer(part_shapes, num_senders, self.sender_weights, self.sender_norms, robust=self.robust)

    def check_averaged_part(self, peer_index: int, part_index: int, part: torch.Tensor) -> Optional[str]:
        # one pass (part_check): torch.isfinite(...).all() alone costs ~10x the float64 norm
        finite, norm = part_check(part)
        if not finite:
            return f"reducer #{peer_index} returned non-finite values"
        if self.max_norm is not None and not within_norm(norm, self.max_norm):
            return f"reducer #{peer_index} returned an average larger than any contribution"
        return None

    def inspect_part(self, sender_index: int, part_index: int, part: torch.Tensor):
        """Worker thread: ``(part_check, matches its claim)`` of a received part."""
        return part_check(part), self.part_as_claimed(sender_index, part_index, part)

    async def serve_stream(self, sender_index: int, parts):
        """Reduce a sender's parts in order; stop at its first refused part.

        The verdicts computed in the decode thread are applied here, in the same order as the
        checks would run on the loop, so bans and their reasons do not depend on the threads.
        """
        reducer = self.reducer
        part_index = 0
        async for tensor_part, compression, (check, as_claimed) in parts:
            try:
                if not as_claimed:
                    reducer.reject(sender_index, reducer.contradicted, "sent a part that contradicts its commitment")
                averaged = await reducer.accumulate_part(sender_index, part_index, tensor_part, check=check)
                part_index += 1
            except SenderBanned:
                return  # banned (timeout, disconnect, non-finite): stop serving this sender
            yield averaged, compression

    def serialized_average(self, part_index: int, averaged: torch.Tensor, compression):
        """The averaged part as sent back, serialised once and shared by every sender asking for it.

        All senders receive the same averaged tensor, so the bytes are the same for all; parts
        complete in order and a sender asks for part p + 1 only after it has taken part p, so
        only the newest part's entries are kept.
        """
        key = (part_index, compression)
        cache = self._serialized_cache
        hit = cache.get(key)
        if hit is None or hit[0] is not averaged:
            for old in [k for k in cache if k[0] < part_index]:
                del cache[old]
            future = asyncio.get_event_loop().run_in_executor(None, serialize_part, averaged, compression)
            hit = cache[key] = (averaged, future)
        return asyncio.shield(hit[1])

    def part_as_claimed(self, sender_index: int, part_index: int, tensor_part: torch.Tensor) -> bool:
        """True unless the sender committed a claim for this part and the part contradicts it."""
        if self.sender_claims is None or self.layout is None:
            return True
        claims = self.sender_claims[sender_index]
        if claims is None:
            return True
        from dtrain.swarm.averaging.contribution import part_matches_claim

        g = self._first_part + part_index
        param_index, start, length = self.layout.parts[g]
        if tensor_part.numel() != length:
            return False
        return part_matches_claim(tensor_part, claims[g], param_index, start, self.claims_nonce)
