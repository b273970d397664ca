"""Work commitments and accountable reducers on dtrain's own butterfly (butterfly.RoundChecks).

A member that sends commits, before it declares, to every part of its contribution: the part's
*claim* (its range sketch as a receiver decodes it) and the digest of its wire bytes, in a claims
tree whose root and total travel in its gather with its work report (:func:`commit`). The
announcer signs every member's gather into the membership, so every reducer holds the same root
for a sender: a sender cannot show two reducers two commitments.

:class:`CommittedChecks` are one member's checks of such a round:

- from the signed gathers, every member alike: a sender whose commitment does not bind its
  weight to its work report (``binding_verdict``: the claims add up to the report, the weight is
  within the committed samples, the nonce is the epoch's) is left out by every reducer;
- as a reducer: a sender's stream opens with the range proof of its claims for our share; each
  part must have the committed digest and the committed claim, else the sender is left out;
- in a reducer's reply: every sender's proof for its share, forwarded, and with each result its
  *account* (the coefficients it combined the senders with, accounts.Account);
- as a receiver: the forwarded claims must prove out against the signed roots, and each result
  must be the combination its account states under the round's rule (``account_problem``), else
  the reducer is refused and the rest of its share is zeros on every receiver. An account that
  leaves out or down-weights our own part is only recorded (``accused``): refusing it would leave
  us holding other values than every other receiver (docs/protocol.md, "Accountable reducers").

Parts are the layout's (contribution.PartLayout.of_values): claims are keyed by (tensor, first
element), so they add up to the work report's sketch of the whole contribution.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from dtrain.sketch import WORK_SKETCH_K, range_sketch
from dtrain.swarm.averaging.accounts import Account, AccountError, account_problem, own_part_problem
from dtrain.swarm.averaging.audit import ReducedPart, RoundEvidence
from dtrain.swarm.averaging.claims_tree import ClaimsProofError, ClaimsTree, part_digest
from dtrain.swarm.averaging.contribution import (
    Commitment,
    CommitmentError,
    PartLayout,
    binding_rtol,
    binding_verdict,
    part_matches_claim,
)
from dtrain.swarm.butterfly import Membership, RoundChecks
from dtrain.swarm.codecs import PartCodec


@dataclass(frozen=True)
class OwnCommitment:
    """What a sender committed to: its claims tree (for the proofs it opens its streams with)
    and the commitment its gather carries."""

    tree: ClaimsTree
    commitment: Commitment

    def gather(self) -> bytes:
        import msgpack

        return msgpack.packb(self.commitment.to_gather(), use_bin_type=True)


def commit(parts: Sequence[torch.Tensor], layout: PartLayout, codec: PartCodec, nonce: str, report,
           k: int = WORK_SKETCH_K) -> OwnCommitment:
    """Commit to sending ``parts`` (one flat tensor per part of ``layout``) under ``codec``:
    each part's claim is the sketch of what a receiver decodes, its digest that of its bytes."""
    if len(parts) != len(layout):
        raise ValueError(f"{len(parts)} parts for a layout of {len(layout)}")
    claims = np.zeros((len(layout), k), dtype="<f4")
    digests = np.zeros((len(layout), 32), dtype=np.uint8)
    for g, (part, (i, start, _)) in enumerate(zip(parts, layout.parts)):
        wire = codec.encode(part)
        decoded = codec.decode(wire, part.numel())
        claims[g] = range_sketch(decoded, i, start, nonce, k=k).numpy()
        digests[g] = np.frombuffer(part_digest(wire), dtype=np.uint8)
    tree = ClaimsTree(claims, digests)
    return OwnCommitment(tree, Commitment(nonce=nonce, report=report, root=tree.root.digest, total=tree.root.total))


def read_commitment(gather: bytes, report_type, k: int = WORK_SKETCH_K) -> Optional[Commitment]:
    """The commitment a member's gather carries (None for an empty gather: a receiver's);
    CommitmentError (a ValueError) names what is wrong with one that cannot be read."""
    import msgpack

    if not gather:
        return None
    try:
        data = msgpack.unpackb(gather, raw=False)
    except Exception as exc:
        raise CommitmentError(f"a gather that is not msgpack ({type(exc).__name__})") from None
    return Commitment.parse(data, report_type, k=k)


def _pack(pieces: Sequence[bytes]) -> bytes:
    return struct.pack("<I", len(pieces)) + b"".join(struct.pack("<I", len(p)) + p for p in pieces)


def _unpack(data: bytes, count: int) -> list[bytes]:
    """ValueError unless ``data`` is exactly ``count`` length-prefixed pieces."""
    if len(data) < 4 or struct.unpack_from("<I", data)[0] != count:
        raise ValueError(f"expected {count} forwarded proofs")
    pieces, at = [], 4
    for _ in range(count):
        if at + 4 > len(data):
            raise ValueError("the forwarded proofs end early")
        n = struct.unpack_from("<I", data, at)[0]
        if at + 4 + n > len(data):
            raise ValueError("a forwarded proof runs past the end")
        pieces.append(bytes(data[at + 4:at + 4 + n]))
        at += 4 + n
    if at != len(data):
        raise ValueError("bytes after the forwarded proofs")
    return pieces


class CommittedChecks(RoundChecks):
    """One member's checks of a committed round (module docstring). ``own``: what we committed
    (None when we do not send: a validator); ``parts``: the parts we send, read only while a
    reducer's account of our own part is judged; ``robust``: the round's rule is CenteredClip;
    ``questions`` (questions.KeptRounds): with it, the result check runs after the butterfly,
    asking the senders within ``question_timeout_s`` (``sent``: what we sent, for our own answers)."""

    def __init__(self, layout: PartLayout, codec: PartCodec, nonce: str, report_type, *,
                 own: Optional[OwnCommitment] = None, parts: Sequence[torch.Tensor] = (), robust: bool = False,
                 questions=None, sent=None, question_timeout_s: float = 10.0, k: int = WORK_SKETCH_K):
        self.layout, self.codec, self.nonce, self.report_type = layout, codec, nonce, report_type
        self.own, self.parts, self.robust, self.k = own, list(parts), robust, k
        self.questions, self.sent, self.question_timeout_s = questions, sent, question_timeout_s
        self.rtol = binding_rtol(codec.name)
        self.refused: dict[int, str] = {}  # sender index -> why every reducer leaves it out
        self.accused: dict[int, str] = {}  # reducer -> how its account wronged our own part
        # what the validators' round audit reads (averaging.audit): every result we applied from
        # another reducer, with its account and the digests its senders committed
        self.evidence: Optional[RoundEvidence] = None

    def begin(self, membership: Membership, gathers: Sequence[bytes], me: int) -> None:
        if len(self.layout) != membership.num_parts:
            raise ValueError(f"our layout has {len(self.layout)} parts, the membership {membership.num_parts}")
        self.membership, self.me = membership, me
        self.my_sender = membership.sender_index(me)
        self.commitments: dict[int, Commitment] = {}
        for s, member in enumerate(membership.senders):
            weight = membership.weights[s]
            try:
                found = read_commitment(gathers[member], self.report_type, self.k)
            except ValueError as exc:
                self.refused[s] = f"its commitment cannot be read: {exc}"
                continue
            why = binding_verdict(found, weight=weight, nonce=self.nonce, compression=self.codec.name) if weight > 0 \
                else ""
            if why:
                self.refused[s] = why
            elif found is not None:
                self.commitments[s] = found
        # the weight the rule gives each sender: what every receiver checks accounts against
        self.weights = [0.0 if s in self.refused else float(w) for s, w in enumerate(membership.weights)]
        self._share: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # sender -> (claims, digests) of our share
        self._heads: dict[int, bytes] = {}  # sender -> the proof it opened with
        # global part -> the member that reduces it, and each member's first part (asked per part and sender)
        self._reducer_of = [k for k, n in enumerate(membership.shares) for _ in range(n)]
        self._first_of = [membership.share_of(k)[0] for k in range(len(membership.peers))]
        self._forwarded: dict[int, list] = {}  # reducer -> per sender, (claims, digests) for that share, or None
        self.evidence = RoundEvidence(senders=[membership.peers[m] for m in membership.senders], layout=self.layout,
                                      compression=self.codec.name, codec=self.codec)

    # -- as a sender
    def head_for(self, reducer: int) -> bytes:
        if self.own is None:
            return b""
        return self.own.tree.range_proof(*self.membership.share_of(reducer))

    # -- as a reducer
    def accept_head(self, sender: int, head: bytes) -> str:
        if sender in self.refused:
            return self.refused[sender]
        found = self.commitments.get(sender)
        if found is None:
            return ""  # a weight-0 sender without a commitment: the rule gives it nothing to prove
        first, end = self.membership.share_of(self.me)
        try:
            self._share[sender] = found.share_claims(head, first=first, end=end, num_parts=len(self.layout),
                                                     with_digests=True)
        except ClaimsProofError as exc:
            return f"its claims for our share do not prove out against its commitment: {exc}"
        self._heads[sender] = head
        return ""

    def inspect(self, sender: int, j: int, part: torch.Tensor, wire: bytes) -> str:
        committed = self._share.get(sender)
        if committed is None:
            return ""
        claims, digests = committed
        g = self.membership.share_of(self.me)[0] + j
        if part_digest(wire) != bytes(digests[j]):
            return f"sent part {g} in other bytes than it committed"
        i, start, _ = self.layout.parts[g]
        if not part_matches_claim(part, claims[j], i, start, self.nonce):
            return f"part {g} does not match its committed claim"
        return ""

    def reply_head(self) -> bytes:
        first, end = self.membership.share_of(self.me)
        pieces = []
        for s in range(len(self.membership.senders)):
            if s == self.my_sender and self.own is not None:
                pieces.append(self.own.tree.range_proof(first, end))
            else:
                pieces.append(self._heads.get(s, b""))
        return _pack(pieces)

    def note(self, j: int, account) -> bytes:
        return account.to_bytes() if account is not None else b""

    # -- as a receiver
    def read_reply_head(self, reducer: int, head: bytes) -> str:
        first, end = self.membership.share_of(reducer)
        try:
            pieces = _unpack(head, len(self.membership.senders))
        except ValueError as exc:
            return f"forwarded claims that cannot be read: {exc}"
        claims: list = []
        for s, piece in enumerate(pieces):
            found = self.commitments.get(s)
            if found is None or not piece:
                claims.append(None)
                continue
            try:
                claims.append(found.share_claims(piece, first=first, end=end, num_parts=len(self.layout),
                                                 with_digests=True))
            except ClaimsProofError as exc:
                return f"forwarded claims of sender #{s} that its commitment does not prove: {exc}"
        self._forwarded[reducer] = claims
        return ""

    def claimed_norm(self, g: int, sender: int) -> float:
        """The norm of ``sender``'s public claim for global part ``g``, as its reducer forwarded
        it (0 when none was shown): what bounds a silent sender's term in the result check."""
        k = self._reducer_of[g]
        shown = self._forwarded.get(k)
        if not shown or shown[sender] is None:
            return 0.0
        return float(np.linalg.norm(shown[sender][0][g - self._first_of[k]].astype(np.float64)))

    def reducer_of(self, g: int) -> int:
        """The member that reduces global part ``g``."""
        return self._reducer_of[g]

    def forwarded(self, reducer: int) -> Optional[list]:
        """Per sender, the (claims, digests) of ``reducer``'s share that it forwarded and we verified
        against the senders' roots (None for a sender it showed none of); None when it forwarded none."""
        return self._forwarded.get(reducer)

    async def after_butterfly(self, parts, outcome) -> None:
        if self.questions is None or not self.commitments:
            return
        from dtrain.swarm.result_checking import check_results, re_reduce

        await check_results(self, parts, outcome, self.questions, self.sent, self.question_timeout_s)
        await re_reduce(self, parts, outcome, self.questions, self.sent, self.question_timeout_s)

    def check(self, reducer: int, j: int, part: torch.Tensor, note: bytes) -> str:
        if not self.commitments:
            return ""  # nobody committed: there is nothing to hold the reducer's result to
        forwarded = self._forwarded.get(reducer)
        if forwarded is None:
            return "returned results without the senders' claims"
        try:
            account = Account.from_bytes(note, len(self.membership.senders))
        except AccountError as exc:
            return f"its account of part {j}: {exc}"
        g = self.membership.share_of(reducer)[0] + j
        i, start, _ = self.layout.parts[g]
        claims = [c[0][j] if c is not None else None for c in forwarded]
        committed = [s in self.commitments for s in range(len(self.membership.senders))]
        problem = account_problem(part, account, claims, committed, self.weights, robust=self.robust,
                                  param_index=i, start=start, nonce=self.nonce, rtol=self.rtol)
        if problem:
            return problem
        self.evidence.parts[g] = ReducedPart(self.membership.peers[reducer], tuple(float(x) for x in account.coefficients),
                                             tuple(bytes(c[1][j]) if c is not None else None for c in forwarded))
        if self.my_sender is not None and self.parts and reducer not in self.accused:
            wronged = own_part_problem(part, account, self.weights, robust=self.robust, me=self.my_sender,
                                       my_part=lambda: self.codec.round_trip(self.parts[g]), rtol=self.rtol)
            if wronged:
                self.accused[reducer] = wronged
        return ""
