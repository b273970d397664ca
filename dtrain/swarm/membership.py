"""A round's membership, fixed by its announcer before the round: declarations in, one signed list out.

The validator that announces a round opens a *declaration window*. Each peer that wants to take
part declares, over dtrain's ``declare`` protocol (dtrain.swarm.transport), the round, its epoch,
whether it sends (its weight) and whether it reduces, and its gather (the bytes every member's
checks read: work commitment, caps, norms, codec). libp2p authenticates the declaring peer, so a
peer can only declare itself. When the window closes the announcer puts the members in order
(by peer id), gives every reducer a share of the parts (by its declared bandwidth: the
butterfly's load balancing), signs the whole with its hotkey
(sr25519, bittensor's ``resolve_signer``) and answers every declaration with the same signed
list. Every member averages with exactly that group (dtrain.swarm.butterfly).

A peer that declares after the window, or for another epoch, is told so and sits the round out:
it is not a member, so nobody waits for it and nobody can hold it at fault for the round.

Several validators agree on one group without a master: the announcer of each epoch's round
follows from the chain alone (``announcer_order``), and the other validators declare to it
as members of weight 0, so every validator averages in the one group and receives the result.

Frames of ``declare``: member -> announcer ``DECLARE`` (msgpack map, below); announcer -> member
``MEMBERS`` (the signed membership's bytes) or ``NOT_MEMBER`` (a UTF-8 reason).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Collection, Mapping, Optional, Sequence

from dtrain.swarm.butterfly import Membership, MembershipError
from dtrain.swarm.transport import Transport, TransportError, read_frame, write_frame

logger = logging.getLogger(__name__)

PROTOCOL = "declare"
DECLARE, MEMBERS, NOT_MEMBER = 1, 2, 3
SIGNED_DOMAIN = b"dtrain/membership/v1\n"
# How long a declaration for a round not yet open waits for it before it is refused.
EARLY_DECLARATION_S = 3.0
MAX_GATHER = 4 * 1024 * 1024  # a declaration's gather (a work report grows with the pages trained)


@dataclass(frozen=True)
class Declaration:
    """What one peer declares for a round."""

    round_id: str
    epoch: int
    weight: float  # its averaging weight; 0 for a member that only receives (a validator)
    reduces: bool  # whether it takes a share of the parts
    gather: bytes = b""  # what every member's checks read of it (opaque here)
    bandwidth: Optional[float] = None  # its upload in MB/s, for its share of the parts; None: like the others

    def to_bytes(self) -> bytes:
        import msgpack

        return msgpack.packb({"r": self.round_id, "e": int(self.epoch), "w": float(self.weight),
                              "red": bool(self.reduces), "g": bytes(self.gather),
                              "b": None if self.bandwidth is None else float(self.bandwidth)}, use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: bytes) -> "Declaration":
        import msgpack

        try:
            doc = msgpack.unpackb(data, raw=False)
            bandwidth = doc.get("b")
            declaration = cls(str(doc["r"]), int(doc["e"]), float(doc["w"]), bool(doc["red"]), bytes(doc["g"]),
                              None if bandwidth is None else float(bandwidth))
        except Exception as exc:
            raise MembershipError(f"a declaration must be a map of r, e, w, red and g ({exc!r})"[:200]) from None
        if not (0 <= declaration.weight < float("inf")) or declaration.epoch < 0:
            raise MembershipError("a declaration's weight must be finite and >= 0, its epoch >= 0")
        if declaration.bandwidth is not None and not 0 <= declaration.bandwidth < float("inf"):
            raise MembershipError("a declaration's bandwidth must be finite and >= 0")
        if len(declaration.gather) > MAX_GATHER:
            raise MembershipError(f"a gather of {len(declaration.gather)} bytes (the limit is {MAX_GATHER})")
        return declaration


@dataclass(frozen=True)
class SignedMembership:
    """The announcer's membership of one round, and its signature over all of it."""

    membership: Membership
    epoch: int
    announcer: str  # the announcer's hotkey (ss58)
    gathers: tuple[bytes, ...]  # each member's declared gather, in member order
    signature: bytes = b""

    def payload(self) -> bytes:
        """The signed bytes: the domain, then a canonical msgpack of everything but the signature."""
        import msgpack

        m = self.membership
        return SIGNED_DOMAIN + msgpack.packb(
            {"r": m.round_id, "e": int(self.epoch), "a": self.announcer, "p": list(m.peers), "s": list(m.senders),
             "w": [float(w) for w in m.weights], "sh": list(m.shares), "g": [bytes(g) for g in self.gathers]},
            use_bin_type=True)

    def to_bytes(self) -> bytes:
        import msgpack

        return msgpack.packb({"body": self.payload(), "sig": bytes(self.signature)}, use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: bytes) -> "SignedMembership":
        import msgpack

        try:
            outer = msgpack.unpackb(data, raw=False)
            body, signature = bytes(outer["body"]), bytes(outer["sig"])
            if not body.startswith(SIGNED_DOMAIN):
                raise ValueError("not a dtrain membership")
            doc = msgpack.unpackb(body[len(SIGNED_DOMAIN):], raw=False)
            membership = Membership(str(doc["r"]), tuple(str(p) for p in doc["p"]), tuple(int(i) for i in doc["s"]),
                                    tuple(float(w) for w in doc["w"]), tuple(int(s) for s in doc["sh"]))
            gathers = tuple(bytes(g) for g in doc["g"])
            signed = cls(membership, int(doc["e"]), str(doc["a"]), gathers, signature)
        except MembershipError:
            raise
        except Exception as exc:
            raise MembershipError(f"a malformed membership ({exc!r})"[:200]) from None
        if len(gathers) != len(membership.peers):
            raise MembershipError("a membership needs one gather per member")
        if signed.payload() != body:
            raise MembershipError("a membership whose bytes are not in canonical form")
        return signed

    def verify(self, announcers: Callable[[str], bool]) -> None:
        """MembershipError unless ``announcers(hotkey)`` allows the signer and the signature is its."""
        from bittensor import sp_core

        if not announcers(self.announcer):
            raise MembershipError(f"round {self.membership.round_id} was announced by {self.announcer}, "
                                  "which may not announce rounds (no validator permit)")
        try:
            good = bool(sp_core.verify(self.payload(), self.signature, self.announcer))
        except Exception:
            good = False
        if not good:
            raise MembershipError(f"the membership of round {self.membership.round_id} is not signed by "
                                  f"{self.announcer}")


def sign(membership: Membership, epoch: int, gathers: Sequence[bytes], wallet) -> SignedMembership:
    """The membership signed with ``wallet``'s hotkey (anything ``bittensor.resolve_signer`` takes)."""
    from bittensor import resolve_signer

    signer = resolve_signer(wallet, role="hotkey")
    unsigned = SignedMembership(membership, int(epoch), signer.ss58_address, tuple(bytes(g) for g in gathers))
    return SignedMembership(membership, unsigned.epoch, unsigned.announcer, unsigned.gathers,
                            bytes(signer.sign(unsigned.payload())))


def announcer_order(run_id: str, epoch: int, validators: Sequence[str]) -> list[str]:
    """The validators (hotkeys) in the order they announce epoch ``epoch``'s round: the first
    announces it, and the next is asked only when the first opens no window. Every peer computes
    the same order from the chain's validators alone, so several validators agree on one group
    without talking to each other, and the duty rotates from epoch to epoch."""
    import hashlib

    def rank(hotkey: str) -> bytes:
        return hashlib.sha256(f"dtrain/announcer/v1:{run_id}:{int(epoch)}:{hotkey}".encode()).digest()

    return sorted(set(validators), key=lambda hotkey: (rank(hotkey), hotkey))


def reducer_shares(declarations: Sequence[Declaration], num_parts: int,
                   benched: Collection[int] = ()) -> tuple[int, ...]:
    """``num_parts`` over the members that reduce, in proportion to what the butterfly's load
    balancing gives their declared bandwidths (dtrain.swarm.load_balance); every member reduces
    when none offered to. A ``benched`` member (by index) reduces no share, unless that would
    leave no reducer: someone must reduce, so a bench of every reducer benches none."""
    from dtrain.swarm.load_balance import part_shares

    reduces = [d.reduces for d in declarations]
    if not any(reduces):
        reduces = [True] * len(declarations)
    kept = [r and i not in benched for i, r in enumerate(reduces)]
    if any(kept):
        reduces = kept
    reducers = [i for i, r in enumerate(reduces) if r]
    split = part_shares(num_parts, [declarations[i].bandwidth for i in reducers])
    shares = [0] * len(declarations)
    for i, count in zip(reducers, split):
        shares[i] = count
    return tuple(shares)


@dataclass
class _Window:
    epoch: int
    num_parts: int
    closes_at: float  # time.monotonic()
    declarations: dict[str, Declaration] = field(default_factory=dict)
    sealed: bool = False  # set, with no await between, just before the members are read
    closed: Optional[asyncio.Future] = None  # the signed membership, once the window closed


class Announcer:
    """The announcer's side: opens a round's declaration window, takes declarations while it is
    open, then signs and hands out one membership. ``allowed(peer id)`` says who may declare
    (a committed miner or a validator of the subnet)."""

    def __init__(self, transport: Transport, wallet, allowed: Callable[[str], bool] = lambda peer: True):
        self.transport, self.wallet, self.allowed = transport, wallet, allowed
        self._windows: dict[str, _Window] = {}
        transport.handle(PROTOCOL, self._serve)

    async def announce(self, round_id: str, epoch: int, num_parts: int, window_s: float,
                       own: Optional[Declaration] = None,
                       caps: Optional[Mapping[str, float]] = None,
                       benched: Collection[str] = ()) -> SignedMembership:
        """Open the window for ``window_s``, then return the signed membership (``own``: the
        announcer's own declaration, a member like any other). ``caps``: the largest weight the
        membership gives each peer (an unlisted one gets 0: it only receives); None: as declared.
        ``benched``: peers that reduce no share (refused as reducers lately; they still send)."""
        loop = asyncio.get_running_loop()
        benched = set(benched)
        window = _Window(int(epoch), int(num_parts), time.monotonic() + window_s, closed=loop.create_future())
        if own is not None:
            window.declarations[self.transport.peer_id] = own
        self._windows[round_id] = window
        await asyncio.sleep(window_s)
        # sealed before the members are read: a timer may wake a little before closes_at, and a
        # declaration taken after the read would wait for a list that leaves it out
        window.sealed = True
        members = sorted(window.declarations)
        declared = [window.declarations[p] for p in members]
        if not members:
            raise MembershipError(f"nobody declared for round {round_id}")
        weights = [d.weight if caps is None else min(d.weight, max(0.0, float(caps.get(p, 0.0))))
                   for p, d in zip(members, declared)]
        senders = tuple(i for i, w in enumerate(weights) if w > 0)
        membership = Membership(round_id, tuple(members), senders, tuple(weights[i] for i in senders),
                                reducer_shares(declared, window.num_parts,
                                               {i for i, p in enumerate(members) if p in benched}))
        signed = await loop.run_in_executor(None, sign, membership, epoch, [d.gather for d in declared], self.wallet)
        window.closed.set_result(signed)
        loop.call_later(60.0, self._windows.pop, round_id, None)
        return signed

    async def _serve(self, peer: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        frame = await asyncio.wait_for(read_frame(reader), 30.0)
        try:
            if frame.kind != DECLARE:
                raise MembershipError("the stream must open with DECLARE")
            declaration = Declaration.from_bytes(frame.payload)
        except MembershipError as exc:
            await write_frame(writer, NOT_MEMBER, str(exc).encode())
            return
        await self._opened(declaration.round_id, EARLY_DECLARATION_S)
        reason = self._refusal(peer, declaration)
        if reason:
            await write_frame(writer, NOT_MEMBER, reason.encode())
            return
        window = self._windows[declaration.round_id]
        window.declarations[peer] = declaration
        signed = await asyncio.shield(window.closed)
        await write_frame(writer, MEMBERS, signed.to_bytes())

    async def _opened(self, round_id: str, wait_s: float) -> None:
        """Wait up to ``wait_s`` for round ``round_id``'s window to open: a member that learnt of
        the round as it was announced may declare an instant before our loop opened it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while round_id not in self._windows and loop.time() < deadline:
            await asyncio.sleep(0.05)

    def _refusal(self, peer: str, declaration: Declaration) -> str:
        window = self._windows.get(declaration.round_id)
        if window is None:
            return f"no round {declaration.round_id} is open here"
        if declaration.epoch != window.epoch:
            return f"round {declaration.round_id} is for epoch {window.epoch}, not {declaration.epoch}"
        if window.sealed or time.monotonic() >= window.closes_at:
            return f"the declaration window of round {declaration.round_id} has closed: this peer sits it out"
        if not self.allowed(peer):
            return f"{peer} may not take part in this subnet's rounds"
        return ""


async def declare(transport: Transport, announcer_peer: str, declaration: Declaration,
                  timeout_s: float) -> tuple[Optional[SignedMembership], str]:
    """Declare for a round at its announcer: ``(signed membership, "")`` once the window closed,
    or ``(None, why not)`` when the announcer refused us or could not be reached in time."""
    async def exchange():
        reader, writer = await transport.open(announcer_peer, PROTOCOL)
        try:
            await write_frame(writer, DECLARE, declaration.to_bytes())
            return await read_frame(reader)
        finally:
            writer.close()

    try:
        frame = await asyncio.wait_for(exchange(), timeout_s)
    except asyncio.TimeoutError:
        return None, f"the announcer did not close round {declaration.round_id}'s window within {timeout_s:g} s"
    except TransportError as exc:
        return None, str(exc)
    if frame.kind == NOT_MEMBER:
        return None, frame.payload.decode(errors="replace")[:300]
    if frame.kind != MEMBERS:
        return None, "the announcer answered something else than a membership"
    try:
        return SignedMembership.from_bytes(frame.payload), ""
    except MembershipError as exc:
        return None, str(exc)
