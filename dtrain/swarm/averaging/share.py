"""Our share of the butterfly, as its reducer: the senders' heads and parts, checked, then reduced.

A sender heads its stream with its claims for our share, its parts' digests and the nodes that
prove them against the root it committed (claims_tree.py); a sender whose proof fails is
refused. Each part it then sends is checked, in the thread that decodes it, against its claim
and its digest (contribution.py): a part that contradicts either bans the sender. The reducer
(reducer.py) combines what passes. docs/protocol.md, "Work commitments".
"""

from __future__ import annotations

from typing import Optional

import torch

from dtrain.swarm.averaging.claims_tree import ClaimsProofError, part_digest
from dtrain.swarm.averaging.contribution import part_matches_claim
from dtrain.swarm.averaging.norms import part_check
from dtrain.swarm.averaging.reducer import CheckedReducer, SenderBanned
from dtrain.swarm.wire import as_received


class ShareChecks:
    """The reducer side of one round (the wall's ``ShareSide``)."""

    def __init__(self, plan):
        self.plan = plan
        self.first, end = plan.share_of(plan.me)
        self.reducer = self.new_reducer(tuple(torch.Size([plan.layout.parts[g][2]]) for g in range(self.first, end)))
        self.claims: dict[int, object] = {}  # sender index -> its proven claims for our share
        self.digests: dict[int, object] = {}  # sender index -> its proven part digests for our share
        self.heads: dict[int, bytes] = {}  # sender index -> its head as received (our reply forwards them)
        self.unproven: set[int] = set()  # senders whose claims did not prove out against their root

    def new_reducer(self, part_shapes: tuple) -> CheckedReducer:
        """The reducer of our share, with the senders' weights and norms as the group rules set them."""
        rules = self.plan.rules
        return CheckedReducer(part_shapes, self.plan.num_senders, rules.sender_weights, rules.sender_norms,
                              robust=rules.robust)

    def as_received(self, part: torch.Tensor) -> torch.Tensor:
        return as_received(part, self.plan.compression)

    def expects_head(self, sender_index: int) -> bool:
        heads = self.plan.rules.senders_with_claims
        return sender_index < len(heads) and heads[sender_index]

    def accept_head(self, sender_index: int, data: bytes) -> Optional[str]:
        commitment = self.plan.commitment_of(sender_index)
        if commitment is None:
            self.heads[sender_index] = data  # not checked by this peer: forwarded as is
            return None
        try:
            self.claims[sender_index], self.digests[sender_index] = commitment.share_claims(
                data, first=self.first, end=self.first + self.reducer.num_parts, num_parts=len(self.plan.layout),
                with_digests=True)
        except ClaimsProofError as exc:
            self.unproven.add(sender_index)
            self.reducer.on_sender_failed(sender_index)
            return f"its claims for our share do not match its committed root ({exc})"
        self.heads[sender_index] = data
        return None

    def inspect(self, sender_index: int, part_index: int, part: torch.Tensor, wire: bytes):
        """Worker thread: ``(part_check, matches its claim and committed digest)`` of a received part."""
        return part_check(part), self.as_claimed(sender_index, part_index, part, wire)

    def as_claimed(self, sender_index: int, part_index: int, part: torch.Tensor, wire: Optional[bytes] = None) -> bool:
        """True unless the sender committed and this part contradicts its claim or (given its
        ``wire`` bytes) its committed digest, or it sent a part without first proving its claims."""
        if self.plan.commitment_of(sender_index) is None:
            return True
        claims = self.claims.get(sender_index)
        if claims is None:
            return False
        param_index, start, length = self.plan.layout.parts[self.first + part_index]
        if part.numel() != length:
            return False
        if wire is not None and part_digest(wire) != bytes(self.digests[sender_index][part_index]):
            return False  # other bytes than committed: the round audit could not hold it to them
        return part_matches_claim(part, claims[part_index], param_index, start, self.plan.rules.claims_nonce)

    async def serve(self, sender_index: int, parts):
        """Reduce a sender's parts in order; stop at its first refused part. The verdicts come from
        the decode thread and are applied here, in order, so bans do not depend on the threads."""
        reducer = self.reducer
        part_index = 0
        async for part, compression, (check, as_claimed) in parts:
            try:
                if not as_claimed:
                    reducer.reject(sender_index, reducer.contradicted, "sent a part that contradicts its commitment")
                averaged = await reducer.accumulate_part(sender_index, part_index, part, check=check)
                part_index += 1
            except SenderBanned:
                return  # banned (timeout, disconnect, non-finite): stop serving this sender
            yield averaged, compression
