"""The checked butterfly: one round's checks as the wall's runner calls them, and what they found.

:class:`CheckedButterfly` is the wall's ``ButterflyChecks``: what we send each reducer
(:class:`OurParts`), our share as its reducer (share.py) and the reducer's reply both ways
(reply.py). After the butterfly it holds what the result check and re-reduction read and
change (which parts were applied on whose account, which are zeros), and the evidence the
validators' round audit reads (audit.RoundEvidence).
"""

from __future__ import annotations

from typing import Optional

import torch

from dtrain.swarm.averaging.audit import ReducedPart, RoundEvidence


class OurParts:
    """What we send each reducer: our claims for its share, with their proof against our
    committed root (claims_tree.py), then our parts."""

    def __init__(self, plan):
        self.plan = plan

    def head_for(self, reducer_index: int) -> Optional[bytes]:
        tree = self.plan.own_tree
        return None if tree is None else tree.range_proof(*self.plan.share_of(reducer_index))

    async def stream(self, reducer_index: int, parts):
        head = self.head_for(reducer_index)
        if head is not None:
            yield head
        async for message in parts:
            yield message


class CheckedButterfly:
    """One round's checks (``plan``: formation.RoundPlan; ``tensors``: the averaged tensors;
    ``mechanisms``: the classes of its parts, mechanisms.Mechanisms)."""

    def __init__(self, plan, tensors, mechanisms):
        self.plan, self.tensors = plan, tensors
        self.sending = mechanisms.sending(plan)
        self.share = mechanisms.share(plan)
        self.reply = mechanisms.reply(plan, self.share, tensors)
        self.unconfirmed_reducers: dict[str, str] = {}  # reducer -> why the result check refused its parts
        self.zeroed: set[tuple[int, int]] = set()  # (reducer index, part index in its share) that hold zeros
        self.failed_size = self.refused_size = self.recovered_size = 0

    def butterfly_done(self, facts) -> None:
        """Take the wall's facts of the butterfly (the zeros and sizes the checks after it change)."""
        self.zeroed = set(facts.zeroed)
        self.failed_size, self.refused_size = int(facts.failed_size), int(facts.refused_size)

    # -- the result check (result_check.py) ----------------------------------------------------
    def applied_by_others(self) -> dict[int, tuple[int, object]]:
        """Global part -> (reducer index, coefficients) of every other reducer's part we applied
        after its account checked out (empty without accounts)."""
        return dict(self.reply.applied) if self.plan.checks_accounts else {}

    def claimed_norm(self, part: int, sender_index: int) -> float:
        """The norm of a sender's claim for global part ``part``, as its reducer forwarded it (0: none)."""
        k, _ = self.reply.applied.get(part, (None, None))
        claims = self.reply.forwarded_claims.get(k) if k is not None else None
        if claims is None or sender_index >= len(claims) or claims[sender_index] is None:
            return 0.0
        return float(torch.as_tensor(claims[sender_index][part - self.plan.share_of(k)[0]], dtype=torch.float64).norm())

    def digests_of(self, part: int) -> tuple:
        """Each sender's committed digest of another reducer's global part ``part``, as forwarded."""
        k, _ = self.reply.applied[part]
        return tuple(self.sender_proof(k, i, part)[0] for i in range(self.plan.num_senders))

    def refuse_unconfirmed(self, k: int, reason: str) -> None:
        """The result check refused reducer ``k``: every part of it we applied becomes zeros (as every
        receiver of the same bytes does), out of the applied evidence; ``k`` is recorded FAIL."""
        first = self.plan.share_of(k)[0]
        for g in [g for g, (p, _) in self.reply.applied.items() if p == k]:
            piece = self.plan.piece(self.tensors, g)
            piece.zero_()
            self.failed_size += piece.numel()
            self.refused_size += piece.numel()
            self.zeroed.add((k, g - first))
            del self.reply.applied[g]
        self.unconfirmed_reducers[self.plan.rules.peer_ids[k]] = f"reducer #{k} {reason}"

    # -- re-reduction (re_reduction.py) ------------------------------------------------------------
    def refused_parts(self) -> dict[int, list[int]]:
        """Refused reducer index -> the global parts of its share that are zeros here, ascending."""
        if not self.plan.checks_accounts:
            return {}
        out: dict[int, list[int]] = {}
        for k, part_index in sorted(self.zeroed):
            if k != self.plan.me:
                out.setdefault(k, []).append(self.plan.share_of(k)[0] + part_index)
        return out

    def sender_proof(self, k: int, sender_index: int, part: int):
        """``(digest, claim)`` a sender committed for global part ``part`` of reducer ``k``'s share,
        as ``k`` forwarded them (ours from our own tree); ``(None, None)`` when we do not hold them."""
        plan = self.plan
        if sender_index == plan.my_sender_index and plan.own_tree is not None:
            return bytes(plan.own_tree.digests[part]), plan.own_tree.claims[part]
        digests, claims = self.reply.forwarded_digests.get(k), self.reply.forwarded_claims.get(k)
        if not digests or not claims or sender_index >= len(digests) or digests[sender_index] is None \
                or claims[sender_index] is None:
            return None, None
        offset = part - plan.share_of(k)[0]
        return bytes(digests[sender_index][offset]), claims[sender_index][offset]

    def write_recovered(self, k: int, part: int, values: torch.Tensor) -> None:
        """Part ``part`` of refused reducer ``k``'s share, re-reduced, replaces its zeros."""
        piece = self.plan.piece(self.tensors, part)
        piece.copy_(values.reshape(-1))
        self.zeroed.discard((k, part - self.plan.share_of(k)[0]))
        self.failed_size -= piece.numel()
        self.refused_size -= piece.numel()
        self.recovered_size += piece.numel()

    # -- the round audit's evidence (audit.py) -----------------------------------------------------
    def evidence(self, result_check) -> Optional[RoundEvidence]:
        """Every part we applied that a reducer accounted for (other reducers' and ours): the reducer,
        its coefficients and each sender's committed digest; None without accounts."""
        plan = self.plan
        if not plan.checks_accounts:
            return None
        senders = plan.sender_ids
        parts = {g: ReducedPart(plan.rules.peer_ids[k], tuple(float(c) for c in coefficients), self.digests_of(g))
                 for g, (k, coefficients) in self.reply.applied.items()}
        first = plan.share_of(plan.me)[0]
        own = [self.share.digests.get(i) for i in range(len(senders))]
        if plan.my_sender_index is not None and plan.own_tree is not None:
            own[plan.my_sender_index] = plan.own_tree.digests[first:first + self.share.reducer.num_parts]
        for part_index, account in self.share.reducer.accounts.items():
            parts[first + part_index] = (ReducedPart(
                plan.rules.peer_ids[plan.me], tuple(float(c) for c in account.coefficients),
                tuple(None if own[i] is None else bytes(own[i][part_index]) for i in range(len(senders)))))
        return RoundEvidence(senders=list(senders), layout=plan.layout, compression=plan.compression_name, parts=parts,
                             result_check=result_check)
