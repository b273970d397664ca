"""The reducer's reply, both ways: what we return for our share, and our checks of what others return.

A reducer heads its replies with every sender's claims for its share, as they proved out
against the senders' committed roots (the heads it received), and sends with each averaged part
its *account*: the coefficients of the combination (accounts.py). A receiver checks the
forwarded claims against the roots, then each averaged part: finite, no larger than the largest
contribution, the combination its account states, under the reducer's own rule. A reducer that
fails any of these is refused (the wall zeroes the rest of its share on every receiver); one
whose account wrongs only our own part is recorded FAIL but applied, so that we hold what every
other receiver holds. docs/protocol.md, "Accountable reducers".
"""

from __future__ import annotations

import asyncio
import struct
from typing import Optional

import torch

from dtrain.swarm.averaging.accounts import Account, AccountError, account_problem, own_part_problem
from dtrain.swarm.averaging.claims_tree import ClaimsProofError
from dtrain.swarm.averaging.norms import part_check, within_norm
from dtrain.swarm.hivemind_internals import serialize_part


class ReducerReply:
    """The reply side of one round (the wall's ``ReplySide``): ``share`` is our reducer side."""

    def __init__(self, plan, share, tensors):
        self.plan, self.share, self.tensors = plan, share, tensors
        self._head: Optional[bytes] = None
        # (part index, compression) -> (averaged part, future of its serialised form)
        self._serialized: dict[tuple[int, int], tuple[torch.Tensor, asyncio.Future]] = {}
        self.forwarded_claims: dict[int, list] = {}  # reducer index -> per sender: claims or None
        self.forwarded_digests: dict[int, list] = {}  # reducer index -> per sender: part digests or None
        # global part -> (reducer index, coefficients) of each other reducer's part applied after its account checked out
        self.applied: dict[int, tuple[int, object]] = {}
        self.accused: dict[str, str] = {}  # reducer peer id -> how its account wronged our own part

    # -- what we return, as a reducer ---------------------------------------------------------
    def head(self) -> Optional[bytes]:
        """Every sender's head for our share (ours from our own tree), in sender order."""
        if not self.plan.reducers_account:
            return None
        if self._head is None:
            plan, pieces = self.plan, []
            for i in range(plan.num_senders):
                if i == plan.my_sender_index:
                    data = plan.own_tree.range_proof(*plan.share_of(plan.me)) if plan.own_tree else b""
                else:
                    data = self.share.heads.get(i, b"")
                pieces.append(struct.pack("<I", len(data)) + data)
            self._head = struct.pack("<I", len(pieces)) + b"".join(pieces)
        return self._head

    async def part(self, part_index: int, averaged: torch.Tensor, compression):
        """``(tensor message, account bytes)`` of averaged part ``part_index`` of our share."""
        tensor = await self.serialized(part_index, averaged, compression)
        account = self.share.reducer.accounts.get(part_index)
        return tensor, account.to_bytes() if account is not None else b""

    def serialized(self, part_index: int, averaged: torch.Tensor, compression):
        """An awaitable of the averaged part's wire form, computed once for every sender (all get
        the same tensor; a sender asks for part p + 1 only after it took part p, so only the newest
        part is kept)."""
        key, cache = (part_index, compression), self._serialized
        hit = cache.get(key)
        if hit is None or hit[0] is not averaged:
            for old in [k for k in cache if k[0] < part_index]:
                del cache[old]
            future = asyncio.get_event_loop().run_in_executor(None, serialize_part, averaged, compression)
            hit = cache[key] = (averaged, future)
        return asyncio.shield(hit[1])

    # -- what we check, as a receiver ------------------------------------------------------------
    def expects_head(self, reducer_index: int) -> bool:
        return self.plan.reducers_account and reducer_index != self.plan.me

    def read_head(self, reducer_index: int, data: bytes) -> Optional[str]:
        """Prove each sender's forwarded claims for that reducer's share against its root."""
        plan = self.plan
        if not plan.checks_accounts:
            return None  # read and set aside
        try:
            pieces = split_head(data, plan.num_senders)
        except ValueError as exc:
            return f"sent a malformed claims preamble ({exc})"
        first, end = plan.share_of(reducer_index)
        claims, digests = [], []
        for i, piece in enumerate(pieces):
            commitment = plan.commitment_of(i)
            if commitment is None or not piece:
                claims.append(None)
                digests.append(None)
                continue
            try:
                shown, shown_digests = commitment.share_claims(piece, first=first, end=end,
                                                               num_parts=len(plan.layout), with_digests=True)
            except ClaimsProofError as exc:
                return f"forwarded claims of sender #{i} that do not match its committed root ({exc})"
            claims.append(shown)
            digests.append(shown_digests)
        self.forwarded_claims[reducer_index] = claims
        self.forwarded_digests[reducer_index] = digests
        return None

    def check(self, reducer_index: int, part_index: int, part: torch.Tensor, note: bytes) -> Optional[str]:
        """Why an averaged part (a reducer's, or our own) must not be applied; None to apply it."""
        finite, norm = part_check(part)
        if not finite:
            return f"reducer #{reducer_index} returned non-finite values"
        if not within_norm(norm, self.plan.rules.max_norm):
            return f"reducer #{reducer_index} returned an average larger than any contribution"
        if self.plan.checks_accounts and reducer_index != self.plan.me:
            problem = self._account_problem(reducer_index, part_index, part, note)
            if problem:
                return f"reducer #{reducer_index} {problem}"
        return None

    def _account_problem(self, k: int, part_index: int, part: torch.Tensor, note: bytes) -> Optional[str]:
        plan = self.plan
        claims = self.forwarded_claims.get(k)
        if claims is None:
            return "sent averaged parts without the claims that account for them"
        try:
            account = Account.from_bytes(note, plan.num_senders)
        except AccountError as exc:
            return f"sent a malformed account: {exc}"
        g = plan.share_of(k)[0] + part_index
        param_index, start, length = plan.layout.parts[g]
        if part.numel() != length:
            return f"returned a part of {part.numel()} values, expected {length}"
        rule = plan.reducer_rules.get(k)
        if rule is None:
            return "reduced a share without a rule from its gather"
        weights, robust = rule
        problem = account_problem(part, account, [c[part_index] if c is not None else None for c in claims],
                                  plan.committed, weights, robust=robust, param_index=param_index, start=start,
                                  nonce=plan.rules.claims_nonce, rtol=plan.account_rtol)
        if problem:
            return problem
        self.applied[g] = (k, account.coefficients)
        self._check_own_part(k, g, part, account, weights, robust)
        return None

    def _check_own_part(self, k: int, g: int, part: torch.Tensor, account: Account, weights, robust: bool) -> None:
        """Accuse reducer ``k`` (FAIL, part still applied) when its account wrongs our own part."""
        plan, me = self.plan, self.plan.my_sender_index
        reducer = plan.rules.peer_ids[k]
        if me is None or reducer in self.accused:
            return
        mine = own_part_problem(part, account, weights, robust=robust, me=me,
                                my_part=lambda: self.share.as_received(plan.piece(self.tensors, g)),
                                rtol=plan.account_rtol)
        if mine:
            self.accused[reducer] = f"reducer #{k} {mine}"


def split_head(data: bytes, num_senders: int) -> list[bytes]:
    """A reply head's per-sender pieces: u32 count, then per sender u32 length and bytes."""
    if len(data) < 4:
        raise ValueError("too short")
    (count,) = struct.unpack_from("<I", data)
    if count != num_senders:
        raise ValueError(f"{count} senders, expected {num_senders}")
    pieces, offset = [], 4
    for _ in range(count):
        if offset + 4 > len(data):
            raise ValueError("truncated")
        (n,) = struct.unpack_from("<I", data, offset)
        offset += 4
        if offset + n > len(data):
            raise ValueError("truncated")
        pieces.append(data[offset:offset + n])
        offset += n
    if offset != len(data):
        raise ValueError("trailing bytes")
    return pieces
