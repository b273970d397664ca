"""The butterfly runner with dtrain's checks on what crosses the wire, both ways.

* Claims. A sender heads its stream with its claims for this reducer's share, its parts'
  digests and the nodes that prove them against the root it committed in the gather
  (claims_tree.py); a sender whose proof fails is refused. Each part it then sends is checked,
  in the thread that decodes it, against its claim (contribution.py) and its bytes against
  their digest; a part that contradicts either bans the sender.
* Averaged parts. What a reducer returns (and what we reduce ourselves) is applied only if
  it is finite and no larger than the largest announced contribution (``NORM_SLACK``); else
  that reducer's share keeps our local values and the reducer is recorded FAIL.
* Serialisation once. All senders of a part receive the same averaged tensor, so its wire
  form is computed once and shared.
* Reply streams. A reducer keeps a sender's stream open after the last averaged part until
  the sender hangs up (``REPLY_LINGER_S``, see the wall's CountingStub).
* Accountable reducers. A reducer heads its replies with every sender's claims for its share
  (the preambles it received, which prove out against each sender's committed root), and sends
  with each averaged part its *account*: the coefficients of the combination (reducer.Account;
  CenteredClip's result is a convex combination of the parts). A receiver checks the claims
  against the roots, then each averaged part against ``sum_i c_i claim_i`` and the
  coefficients against the reducer's rule (accounts.py); a reducer whose claims, parts or
  coefficients do not check out is refused: recorded FAIL, the rest of its share zeros on
  every receiver (the wall's register_failed_reducer), and named in our next gathers. One
  whose account leaves out or down-weights our own part (which only we can tell) is recorded
  FAIL, but its parts are applied, so that we hold what every other receiver holds.
* The result check. After the butterfly the averager checks every applied part again under
  the round's result seed (result_check.py); a reducer whose part fails it has its applied
  parts zeroed here (:meth:`refuse_unconfirmed`) and is recorded FAIL. Then the averager
  re-reduces every refused reducer's zeroed parts itself from the senders' committed bytes
  (:meth:`refused_parts`, :meth:`sender_proof`, :meth:`write_recovered`).
* Evidence. What we applied, and how each reducer accounted for it, is reported with the
  round (``evidence``) for the secret-seed round audit a validator runs after it (audit.py),
  with what the result check refused.

Transport and the butterfly itself are hivemind's (the wall's ButterflyRunner).
"""

from __future__ import annotations

import asyncio
import functools
import struct
from typing import Optional, Sequence

import torch

from dtrain.swarm.averaging.claims_tree import ClaimsProofError, ClaimsTree, part_digest
from dtrain.swarm.averaging.accounts import Account, AccountError, account_problem, own_part_problem
from dtrain.swarm.wire import as_received
from dtrain.swarm.averaging.norms import part_check, within_norm
from dtrain.swarm.averaging.reducer import CheckedReducer, SenderBanned
from dtrain.swarm.hivemind_internals import ButterflyRunner, serialize_part

# How long a reducer keeps a sender's stream open after its last averaged part, waiting for
# the sender to hang up (it does so at once; this only bounds a sender that does not).
REPLY_LINGER_S = 30.0


class CheckedRunner(ButterflyRunner):
    """One peer's butterfly in one group: reducer weights and norms fixed at group formation."""

    reply_linger_s = REPLY_LINGER_S

    def __init__(self, *, sender_weights: Sequence[float], sender_norms: Optional[Sequence[float]] = None,
                 max_norm: Optional[float] = None, robust: bool = False,
                 sender_commitments: Optional[Sequence] = None, senders_with_claims: Sequence[bool] = (),
                 own_claims=None, own_digests=None, claims_nonce: str = "", layout=None, account_rtol: float = 1e-4,
                 require_commitments: bool = True, reducer_rules: Optional[dict] = None, **kwargs):
        # read by new_reducer, which the base class calls
        self.sender_weights = list(sender_weights)
        self.sender_norms = list(sender_norms) if sender_norms is not None else None
        self.max_norm = max_norm
        self.robust = robust
        # per sender (in sender order): its Commitment, or None (not checked); None: no checks
        self.sender_commitments = list(sender_commitments) if sender_commitments is not None else None
        self.senders_with_claims = list(senders_with_claims)  # whose streams start with their claims
        # our own claims [num_parts, k] and part digests: each reducer gets those of its share, with their proof
        self.own_tree = ClaimsTree(own_claims, own_digests) if own_claims is not None else None
        self.share_claims: dict[int, object] = {}  # sender index -> its proven claims for our share
        self.share_digests: dict[int, object] = {}  # sender index -> its proven part digests for our share
        self.unproven: set[int] = set()  # senders whose claims did not check out against their root
        self.claims_nonce = claims_nonce
        self.layout = layout
        # accountable reducers: what we forward, and what reducers forwarded to us
        self.account_rtol = account_rtol  # the wire codec's binding tolerance (contribution.py)
        self.require_commitments = require_commitments
        # reducer peer index -> (the weight it gives each sender, whether it runs CenteredClip)
        self.reducer_rules = dict(reducer_rules or {})
        self.share_preambles: dict[int, bytes] = {}  # sender index -> its preamble, as received
        self._reply_preamble: Optional[bytes] = None
        self.forwarded_claims: dict[int, list] = {}  # reducer peer index -> per sender: claims or None
        self.forwarded_digests: dict[int, list] = {}  # reducer peer index -> per sender: part digests or None
        # the secret-seed audit's evidence (audit.py): global part -> (reducer peer index, coefficients)
        # of every other reducer's part we applied after its account checked out
        self.applied_accounts: dict[int, tuple[int, object]] = {}
        self.reply_notes: dict[tuple[int, int], bytes] = {}  # (reducer peer index, part) -> its account
        # reducer peer id -> how its account wronged our own part (recorded FAIL, still applied)
        self.accused_reducers: dict[str, str] = {}
        # reducer peer id -> why the result check refused its parts (result_check.py)
        self.unconfirmed_reducers: dict[str, str] = {}
        self.recovered_size = 0  # values of refused shares re-reduced from the senders' bytes
        self.result_check = None  # what the result check saw (a result_check.ResultCheck)
        # (part index, compression) -> (averaged part, future of its serialised form)
        self._serialized_cache: dict[tuple[int, int], tuple[torch.Tensor, asyncio.Future]] = {}
        super().__init__(**kwargs)
        self._first_part = self.first_part
        self._num_parts = len(layout) if layout is not None else None

    def as_received(self, part: torch.Tensor) -> torch.Tensor:
        # the one definition, shared with the claims (compute_claims), so they agree bit for bit
        return as_received(part, self.wire_compression)

    def new_reducer(self, part_shapes: tuple, num_senders: int) -> CheckedReducer:
        return CheckedReducer(part_shapes, num_senders, self.sender_weights, self.sender_norms, robust=self.robust)

    def check_averaged_part(self, peer_index: int, part_index: int, part: torch.Tensor) -> Optional[str]:
        # one pass (part_check): finiteness and norm together
        finite, norm = part_check(part)
        if not finite:
            return f"reducer #{peer_index} returned non-finite values"
        if self.max_norm is not None and not within_norm(norm, self.max_norm):
            return f"reducer #{peer_index} returned an average larger than any contribution"
        if self._checks_accounts() and peer_index != self._my_index:
            problem = self._account_problem(peer_index, part_index, part)
            if problem:
                return f"reducer #{peer_index} {problem}"
        return None

    # -- accountable reducers ---------------------------------------------------------------
    @property
    def _my_index(self) -> int:
        return self.ordered_peer_ids.index(self.peer_id)

    @functools.cached_property
    def _committed(self) -> list[bool]:
        """Per sender, whether it committed (its claims are owed to every receiver)."""
        return [self._commitment_of(i) is not None for i in range(len(self.sender_peer_ids))]

    @functools.cached_property
    def _my_sender_index(self) -> Optional[int]:
        # PeerID's str() is a base58 encoding in Python: once per round, not once per part
        me = str(self.peer_id)
        return self.sender_ids.index(me) if me in self.sender_ids else None

    def _checks_accounts(self) -> bool:
        # with required commitments only: a weighted sender that committed nothing is then
        # excluded, so every weighted contribution has claims to check an account against
        return self.require_commitments and self.sender_commitments is not None and self.layout is not None

    def _reducers_account(self) -> bool:
        # from the gathers alone, so every peer agrees whether replies carry a preamble
        return any(self.senders_with_claims)

    def reply_preamble(self) -> Optional[bytes]:
        if not self._reducers_account():
            return None
        if self._reply_preamble is None:
            me = self._my_sender_index
            pieces = []
            for i in range(len(self.sender_peer_ids)):
                if i == me:
                    data = self.own_tree.range_proof(*self.share_of(self._my_index)) if self.own_tree else b""
                else:
                    data = self.share_preambles.get(i, b"")
                pieces.append(struct.pack("<I", len(data)) + data)
            self._reply_preamble = struct.pack("<I", len(pieces)) + b"".join(pieces)
        return self._reply_preamble

    def reply_note(self, part_index: int) -> bytes:
        account = self.reducer.accounts.get(part_index)
        return account.to_bytes() if account is not None else b""

    def expects_reply_preamble(self, peer_index: int) -> bool:
        return self._reducers_account() and peer_index != self._my_index

    def accept_reply_preamble(self, peer_index: int, data: bytes) -> Optional[str]:
        if not self._checks_accounts():
            return None  # read and set aside
        try:
            pieces = _split_preamble(data, len(self.sender_peer_ids))
        except ValueError as exc:
            return f"sent a malformed claims preamble ({exc})"
        first, end = self.share_of(peer_index)
        claims: list = []
        digests: list = []
        for i, piece in enumerate(pieces):
            commitment = self._commitment_of(i)
            if commitment is None or not piece:
                claims.append(None)
                digests.append(None)
                continue
            try:
                shown, shown_digests = commitment.share_claims(piece, first=first, end=end, num_parts=self._num_parts,
                                                               with_digests=True)
            except ClaimsProofError as exc:
                return f"forwarded claims of sender #{i} that do not match its committed root ({exc})"
            claims.append(shown)
            digests.append(shown_digests)
        self.forwarded_claims[peer_index] = claims
        self.forwarded_digests[peer_index] = digests
        return None

    def accept_reply_note(self, peer_index: int, part_index: int, note: bytes) -> None:
        if self._checks_accounts():
            self.reply_notes[(peer_index, part_index)] = note

    def _account_problem(self, peer_index: int, part_index: int, part: torch.Tensor) -> Optional[str]:
        claims = self.forwarded_claims.get(peer_index)
        if claims is None:
            return "sent averaged parts without the claims that account for them"
        try:
            account = Account.from_bytes(self.reply_notes.pop((peer_index, part_index), b""),
                                         len(self.sender_peer_ids))
        except AccountError as exc:
            return f"sent a malformed account: {exc}"
        first, _ = self.share_of(peer_index)
        param_index, start, length = self.layout.parts[first + part_index]
        if part.numel() != length:
            return f"returned a part of {part.numel()} values, expected {length}"
        rule = self.reducer_rules.get(peer_index)
        if rule is None:
            return "reduced a share without a rule from its gather"
        weights, robust = rule
        part_claims = [c[part_index] if c is not None else None for c in claims]
        problem = account_problem(part, account, part_claims, self._committed, weights, robust=robust,
                                  param_index=param_index, start=start, nonce=self.claims_nonce,
                                  rtol=self.account_rtol)
        if problem:
            return problem
        self.applied_accounts[first + part_index] = (peer_index, account.coefficients)
        me = self._my_sender_index
        if me is not None and str(self.ordered_peer_ids[peer_index]) not in self.accused_reducers:
            mine = own_part_problem(part, account, weights, robust=robust, me=me,
                                    my_part=lambda: self.as_received(self.sent_part(peer_index, part_index)),
                                    rtol=self.account_rtol)
            if mine:
                self.accused_reducers[str(self.ordered_peer_ids[peer_index])] = f"reducer #{peer_index} {mine}"
        return None

    def outcome(self) -> dict:
        return dict(super().outcome(), accused_reducers=dict(self.accused_reducers),
                    unconfirmed_reducers=dict(self.unconfirmed_reducers), evidence=self.evidence(),
                    recovered_size=int(self.recovered_size))

    # -- the result check (result_check.py; the averager runs it after the butterfly) ---------
    def applied_by_others(self) -> dict[int, tuple[int, tuple]]:
        """Global part -> (reducer peer index, its coefficients) of every part another reducer
        returned that we applied after its account checked out (empty without accounts)."""
        return dict(self.applied_accounts) if self._checks_accounts() else {}

    def own_share(self) -> range:
        """The global indices of the parts we reduce ourselves."""
        return range(*self.share_of(self._my_index))

    @property
    def my_sender_index(self) -> Optional[int]:
        return self._my_sender_index

    def claimed_norm(self, part: int, sender_index: int) -> float:
        """The norm of sender ``sender_index``'s public claim for global part ``part``, as its reducer
        forwarded it (0 when there is none)."""
        peer_index, _ = self.applied_accounts.get(part, (None, None))
        claims = self.forwarded_claims.get(peer_index) if peer_index is not None else None
        if claims is None or sender_index >= len(claims) or claims[sender_index] is None:
            return 0.0
        first, _ = self.share_of(peer_index)
        return float(torch.as_tensor(claims[sender_index][part - first], dtype=torch.float64).norm())

    def digests_of(self, part: int) -> tuple:
        """Each sender's committed digest of global part ``part`` (another reducer's), as forwarded."""
        peer_index, _ = self.applied_accounts[part]
        return tuple(self.sender_proof(peer_index, i, part)[0] for i in range(len(self.sender_peer_ids)))

    def refuse_unconfirmed(self, peer_index: int, tensors, reason: str) -> None:
        """The result check refused a part of reducer ``peer_index``: every part of it we applied
        becomes zeros (what every receiver of the same bytes does, as for a reducer refused
        during the round), and it is recorded FAIL with ``reason``; it is left out of the evidence
        of applied parts (the result check's own evidence holds what failed)."""
        for g in [g for g, (p, _) in self.applied_accounts.items() if p == peer_index]:
            param_index, start, length = self.layout.parts[g]
            tensors[param_index].view(-1)[start:start + length].zero_()
            self.count_zeroed(length)
            self.zeroed.add((peer_index, g - self.share_of(peer_index)[0]))
            del self.applied_accounts[g]
        self.unconfirmed_reducers[str(self.ordered_peer_ids[peer_index])] = f"reducer #{peer_index} {reason}"

    # -- re-reducing a refused reducer's share (the averager's _re_reduce) -----------------------
    def refused_parts(self) -> dict[int, list[int]]:
        """Refused reducer's peer index -> the global parts of its share that are zeros here
        because it was refused (during the butterfly, or by the result check), ascending."""
        if not self._checks_accounts():
            return {}
        out: dict[int, list[int]] = {}
        for k, part_index in sorted(self.zeroed):
            if k != self._my_index:
                out.setdefault(k, []).append(self.share_of(k)[0] + part_index)
        return out

    def sender_proof(self, reducer_index: int, sender_index: int, part: int):
        """``(digest, claim)`` sender ``sender_index`` committed for global part ``part`` of the
        reducer ``reducer_index``'s share, as that reducer forwarded them (ours from our own
        tree); ``(None, None)`` when we do not hold them."""
        first, _ = self.share_of(reducer_index)
        if sender_index == self._my_sender_index and self.own_tree is not None:
            return bytes(self.own_tree.digests[part]), self.own_tree.claims[part]
        digests = self.forwarded_digests.get(reducer_index)
        claims = self.forwarded_claims.get(reducer_index)
        if not digests or not claims or sender_index >= len(digests) or digests[sender_index] is None \
                or claims[sender_index] is None:
            return None, None
        return bytes(digests[sender_index][part - first]), claims[sender_index][part - first]

    def write_recovered(self, peer_index: int, part: int, tensors, values: torch.Tensor) -> None:
        """Part ``part`` of refused reducer ``peer_index``'s share, re-reduced: it replaces the
        zeros (it is averaged after all)."""
        param_index, start, length = self.layout.parts[part]
        tensors[param_index].view(-1)[start:start + length].copy_(values.reshape(-1))
        self.zeroed.discard((peer_index, part - self.share_of(peer_index)[0]))
        self.count_recovered(length)
        self.recovered_size += length

    def evidence(self) -> Optional[dict]:
        """What the secret-seed round audit reads (audit.RoundEvidence, in plain values): for every
        part we applied that a reducer accounted for, other reducers' and our own, the reducer,
        its coefficients and each sender's committed part digest. None without accounts."""
        if not self._checks_accounts():
            return None
        senders = self.sender_ids
        parts: dict[int, tuple] = {}

        def digest_of(per_sender, i: int, offset: int):
            d = per_sender[i] if per_sender is not None and i < len(per_sender) else None
            return None if d is None else bytes(d[offset])

        for g, (peer_index, coefficients) in self.applied_accounts.items():
            parts[g] = (str(self.ordered_peer_ids[peer_index]), tuple(float(c) for c in coefficients),
                        self.digests_of(g))
        me, mine = self._my_index, self._my_sender_index
        first, _ = self.share_of(me)
        own = [self.share_digests.get(i) for i in range(len(senders))]
        if mine is not None and self.own_tree is not None:
            own[mine] = self.own_tree.digests[first:first + self.reducer.num_parts]
        for part_index, account in self.reducer.accounts.items():
            parts[first + part_index] = (str(self.peer_id), tuple(float(c) for c in account.coefficients),
                                         tuple(digest_of(own, i, part_index) for i in range(len(senders))))
        check = self.result_check.to_plain() if self.result_check is not None else None
        return dict(senders=list(senders), parts=parts, result_check=check)

    def inspect_part(self, sender_index: int, part_index: int, part: torch.Tensor, wire: bytes):
        """Worker thread: ``(part_check, matches its claim and committed digest)`` of a received part."""
        return part_check(part), self.part_as_claimed(sender_index, part_index, part, wire)

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

    # -- claims at the head of each stream --------------------------------------------------
    def preamble_for(self, peer_index: int) -> Optional[bytes]:
        if self.own_tree is None:
            return None
        return self.own_tree.range_proof(*self.share_of(peer_index))

    def expects_preamble(self, sender_index: int) -> bool:
        return sender_index < len(self.senders_with_claims) and self.senders_with_claims[sender_index]

    def accept_preamble(self, sender_index: int, data: bytes) -> Optional[str]:
        commitment = self._commitment_of(sender_index)
        if commitment is None or self._num_parts is None:
            self.share_preambles[sender_index] = data  # not checked by this peer: forwarded as is
            return None
        first = self._first_part
        try:
            self.share_claims[sender_index], self.share_digests[sender_index] = commitment.share_claims(
                data, first=first, end=first + self.reducer.num_parts, num_parts=self._num_parts, with_digests=True)
        except ClaimsProofError as exc:
            self.unproven.add(sender_index)
            self.reducer.on_sender_failed(sender_index)
            return f"its claims for our share do not match its committed root ({exc})"
        self.share_preambles[sender_index] = data  # forwarded to every receiver (reply_preamble)
        return None

    def _commitment_of(self, sender_index: int):
        if self.sender_commitments is None:
            return None
        return self.sender_commitments[sender_index]

    def part_as_claimed(self, sender_index: int, part_index: int, tensor_part: torch.Tensor,
                        wire: Optional[bytes] = None) -> bool:
        """True unless the sender committed claims and this part contradicts its claim or (given
        its ``wire`` bytes) its committed digest, or it sent a part without first proving its
        claims for our share."""
        if self._commitment_of(sender_index) is None or self.layout is None:
            return True
        claims = self.share_claims.get(sender_index)
        if claims is None:
            return False
        from dtrain.swarm.averaging.contribution import part_matches_claim

        param_index, start, length = self.layout.parts[self._first_part + part_index]
        if tensor_part.numel() != length:
            return False
        if wire is not None and part_digest(wire) != bytes(self.share_digests[sender_index][part_index]):
            return False  # other bytes than committed: the secret-seed audit could not hold it to them
        return part_matches_claim(tensor_part, claims[part_index], param_index, start, self.claims_nonce)


def _split_preamble(data: bytes, num_senders: int) -> list[bytes]:
    """A reply preamble's per-sender pieces: u32 count, then per sender u32 length and bytes."""
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
