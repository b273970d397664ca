"""dtrain's butterfly all-reduce over a group fixed before the round, on its own P2P protocol.

A round's :class:`Membership` says who is in it, in what order, who sends (and with what weight)
and how many of the vector's parts each member reduces. Member ``k`` reduces the parts
``share_of(k)``: every sender streams it those parts, it combines them (the weighted mean, or
CenteredClip: dtrain.swarm.averaging.reducer.CheckedReducer), encodes each result once and
streams the same bytes back to every member, itself included, so every receiver holds the same
bits. Nobody waits for a group to form: the membership is the group.

The protocol ``butterfly`` (dtrain.swarm.transport), one stream per (member, reducer):

- member -> reducer: ``OPEN`` (msgpack ``{"r": round id, "m": member index, "h": head bytes}``),
  then, from a sender, one ``PART`` per part of the reducer's share, in order: u32 part index
  within the share, then the part's wire bytes (dtrain.swarm.codecs.PartCodec);
- reducer -> member: ``REPLY_HEAD`` (its bytes) when the round's checks give one, then one
  ``AVERAGE`` per part, in order: u32 part index, u32 note length, the note (the part's account),
  then the result's wire bytes, or no bytes when the part has no result (every sender of it
  failed: the member keeps its own values); or ``REFUSED`` (a UTF-8 reason) for a stream it does
  not serve.

What the heads and notes say, and what refuses a sender or a reducer, is the round's business
(:class:`RoundChecks`; the base class checks nothing): the butterfly only carries them and acts
on the verdicts. A sender refused by a check is left out of the reducer's share; a reducer
refused by a check leaves *zeros* for the rest of its share on the receiver, not the receiver's
own values, so every receiver of the same bytes holds the same vector.

Failures are each member's own: a sender that does not deliver a part within
``sender_timeout_s`` is left out of the rest of the reducer's share (``banned``), and a reducer
that does not answer within ``reducer_timeout_s`` leaves its share's remaining parts at the
member's local values (``failed_reducers``). Neither blocks the rest of the round.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from dtrain.swarm.codecs import PartCodec
from dtrain.swarm.transport import Frame, Transport, TransportError, read_frame, write_frame

logger = logging.getLogger(__name__)

PROTOCOL = "butterfly"
OPEN, PART, AVERAGE, REFUSED, REPLY_HEAD = 1, 2, 3, 4, 5
# How many of a sender's parts a reducer reads and decodes ahead of the part it reduces: the
# sender's link keeps moving while the reducer waits for the slowest sender of the current part.
PREFETCH = 4
# How long a reducer keeps a finished round, for members whose streams are still draining.
LINGER_S = 30.0
MAX_MEMBERS = 4096


class MembershipError(ValueError):
    """A membership that breaks its own rules (it is refused whole)."""


@dataclass(frozen=True)
class Membership:
    """The group of one round, fixed before it starts."""

    round_id: str
    peers: tuple[str, ...]  # every member, in the butterfly's order
    senders: tuple[int, ...]  # the members that send, as member indices, in sender order
    weights: tuple[float, ...]  # each sender's averaging weight, in sender order
    shares: tuple[int, ...]  # how many consecutive parts each member reduces

    def __post_init__(self):
        n = len(self.peers)
        if not 0 < n <= MAX_MEMBERS or len(set(self.peers)) != n:
            raise MembershipError(f"a group needs 1-{MAX_MEMBERS} distinct members, got {n}")
        if len(self.shares) != n or any(s < 0 for s in self.shares):
            raise MembershipError("every member needs a share of zero or more parts")
        if len(set(self.senders)) != len(self.senders) or any(not 0 <= i < n for i in self.senders):
            raise MembershipError("senders must be distinct members")
        if len(self.weights) != len(self.senders) or any(not (w >= 0 and w < float("inf")) for w in self.weights):
            raise MembershipError("every sender needs one finite weight >= 0")

    @property
    def num_parts(self) -> int:
        return sum(self.shares)

    def share_of(self, member: int) -> tuple[int, int]:
        first = sum(self.shares[:member])
        return first, first + self.shares[member]

    def index(self, peer: str) -> int:
        try:
            return self.peers.index(peer)
        except ValueError:
            raise MembershipError(f"{peer} is not a member of round {self.round_id}") from None

    def sender_index(self, member: int) -> Optional[int]:
        return self.senders.index(member) if member in self.senders else None


class RoundChecks:
    """What one round checks of what it sends, reduces and receives. Each method returns a reason
    ("" for none); the base class checks nothing and says nothing (the plain weighted butterfly)."""

    def begin(self, membership: Membership, gathers: Sequence[bytes], me: int) -> None:
        """The round's group and every member's declared gather (signed with it), before any
        stream: what the checks below judge senders and reducers by."""

    # -- as a sender
    def head_for(self, reducer: int) -> bytes:
        """Bytes our stream to ``reducer`` opens with (our claims for its share)."""
        return b""

    # -- as a reducer
    def accept_head(self, sender: int, head: bytes) -> str:
        """A reason refuses the sender before any of its parts is read."""
        return ""

    def inspect(self, sender: int, j: int, part: torch.Tensor, wire: bytes) -> str:
        """Worker thread, as part ``j`` of our share arrives decoded: a reason leaves the sender out."""
        return ""

    def reply_head(self) -> bytes:
        """Bytes ahead of our first result, to every member (the senders' claims, forwarded)."""
        return b""

    def note(self, j: int, account) -> bytes:
        """Bytes with our result of part ``j``; ``account`` is how our reducer combined it
        (dtrain.swarm.averaging.accounts.Account, None when no sender's part went in)."""
        return b""

    def published(self, j: int, averaged: torch.Tensor) -> torch.Tensor:
        """What we publish as our result of part ``j``, to every member and ourselves: the
        combination itself (the sandbox's cheating reducers return something else)."""
        return averaged

    # -- as a receiver
    def read_reply_head(self, reducer: int, head: bytes) -> str:
        """A reason refuses the reducer (the rest of its share becomes zeros)."""
        return ""

    def check(self, reducer: int, j: int, part: torch.Tensor, note: bytes) -> str:
        """Before a reducer's result of part ``j`` of its share is applied: a reason refuses the reducer."""
        return ""

    # -- after the butterfly
    async def after_butterfly(self, parts: Sequence[torch.Tensor], outcome: "ButterflyOutcome") -> None:
        """On the round's loop, once every share is in: checks of the whole result (a reducer
        they refuse has its parts zeroed in ``parts`` and is named in ``outcome``)."""


NO_CHECKS = RoundChecks()


@dataclass
class ButterflyOutcome:
    """What one member's butterfly did, from its own view."""

    banned: dict[int, str] = field(default_factory=dict)  # sender index -> why our reducer left it out
    failed_reducers: dict[int, str] = field(default_factory=dict)  # member -> why its share kept our values
    unaveraged_parts: set = field(default_factory=set)  # global parts that hold our local values
    refused_reducers: dict[int, str] = field(default_factory=dict)  # member -> why a check refused its results
    # the refused reducers whose own bytes (its results, accounts, forwarded claims) fail a check
    # every receiver of them makes alike; not the result check's, which rests on senders' answers too
    refused_for_bytes: set = field(default_factory=set)
    zeroed_parts: set = field(default_factory=set)  # global parts of refused reducers, zeros here
    recovered_parts: set = field(default_factory=set)  # of those, the ones re-reduced from the senders' bytes
    bytes_sent: int = 0
    bytes_received: int = 0
    duration_s: float = 0.0


class _Share:
    """Our share of one round, as its reducer: the senders' parts in, the results out."""

    def __init__(self, membership: Membership, me: int, sizes: Sequence[int], codec: PartCodec, robust: bool,
                 sender_timeout_s: float, checks: RoundChecks, outcome: ButterflyOutcome):
        from dtrain.swarm.averaging.reducer import CheckedReducer

        self.membership, self.me, self.codec, self.checks, self.outcome = membership, me, codec, checks, outcome
        self.first, self.end = membership.share_of(me)
        self.sizes = list(sizes[self.first:self.end])
        self.sender_timeout_s = sender_timeout_s
        self.reducer = CheckedReducer(tuple(torch.Size([n]) for n in self.sizes), len(membership.senders),
                                      membership.weights, robust=robust)
        loop = asyncio.get_running_loop()
        # per part of the share: (decoded result or None, its wire bytes or b"", its note)
        self.results: list[asyncio.Future] = [loop.create_future() for _ in self.sizes]
        self.connected: set[int] = set()  # senders whose parts come in (or ours, for our own)
        self.streams: set[int] = set()  # members with a stream open to us
        self.done = asyncio.Event()
        if not self.sizes:
            self.done.set()
        elif not membership.senders:
            self.finish_unreduced()

    def fail_sender(self, sender: int, why: str) -> None:
        if self.done.is_set():
            return  # every part of the share has its result: nothing is left to leave it out of
        if sender not in self.outcome.banned:
            self.outcome.banned[sender] = why
            logger.warning("butterfly %s: leaving sender #%d out of our share: %s", self.membership.round_id, sender, why)
        self.reducer.on_sender_failed(sender)
        if len(self.outcome.banned) >= len(self.membership.senders):
            self.finish_unreduced()  # nobody is left to reduce: no part of ours gets a result

    async def add(self, sender: int, j: int, part: torch.Tensor) -> None:
        """Reduce a sender's part ``j`` (waits until the reducer reached it); the result is published once."""
        averaged = await self.reducer.accumulate_part(sender, j, part)
        await self._publish(j, averaged)

    async def _publish(self, j: int, averaged: torch.Tensor) -> None:
        future = self.results[j]
        if future.done():
            return
        if not bool(torch.isfinite(averaged).all()):  # no sender delivered this part: no result
            future.set_result((None, b"", b""))
        else:
            loop = asyncio.get_running_loop()
            published = self.checks.published(j, averaged)
            wire = await loop.run_in_executor(None, self.codec.encode, published)
            if future.done():
                return
            received = published if self.codec.name == "none" else self.codec.decode(wire, published.numel())
            future.set_result((received, wire, self.checks.note(j, self.reducer.accounts.get(j))))
        if all(f.done() for f in self.results):
            self.done.set()

    def finish_unreduced(self) -> None:
        """At the end: parts no sender completed have no result (every member keeps its own)."""
        for future in self.results:
            if not future.done():
                future.set_result((None, b"", b""))
        self.done.set()


class ButterflyService:
    """The butterfly protocol of one node: serves its shares of running rounds, and runs its own
    side of a round with :meth:`run`."""

    def __init__(self, transport: Transport, *, start_timeout_s: float = 30.0):
        self.transport = transport
        self.start_timeout_s = float(start_timeout_s)
        self._shares: dict[str, _Share] = {}
        self._arrivals: dict[str, asyncio.Event] = {}  # round id -> set once its share is registered
        transport.handle(PROTOCOL, self._serve)

    # -- the reducer's side ------------------------------------------------------------------
    async def _share_for(self, round_id: str, timeout_s: float) -> Optional[_Share]:
        """The share of ``round_id``, waiting for it to be registered (members start at slightly
        different moments; one that opens its streams first must not be refused)."""
        share = self._shares.get(round_id)
        if share is not None:
            return share
        arrived = self._arrivals.setdefault(round_id, asyncio.Event())
        try:
            await asyncio.wait_for(arrived.wait(), timeout_s)
        except asyncio.TimeoutError:
            if not arrived.is_set() and self._arrivals.get(round_id) is arrived:
                del self._arrivals[round_id]  # a round that never came (or a made-up id) leaves nothing
            return None
        return self._shares.get(round_id)

    async def _serve(self, peer: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        import msgpack

        opening = await asyncio.wait_for(read_frame(reader), self.start_timeout_s)
        try:
            head = msgpack.unpackb(opening.payload, raw=False) if opening.kind == OPEN else None
            round_id, member, sender_head = str(head["r"]), int(head["m"]), bytes(head.get("h", b""))
        except Exception:
            await write_frame(writer, REFUSED, b"the stream must open with OPEN {r, m, h}")
            return
        share = await self._share_for(round_id, self.start_timeout_s)
        if share is None:
            await write_frame(writer, REFUSED, f"no round {round_id} here".encode())
            return
        membership = share.membership
        if not 0 <= member < len(membership.peers) or membership.peers[member] != peer:
            await write_frame(writer, REFUSED, f"{peer} is not member #{member} of round {round_id}".encode())
            return
        if member in share.streams:  # a second stream would count the same sender's parts twice
            await write_frame(writer, REFUSED, f"member #{member} already has a stream in round {round_id}".encode())
            return
        share.streams.add(member)
        sender = membership.sender_index(member)
        replies = asyncio.create_task(self._reply(share, writer))
        try:
            if sender is not None:
                share.connected.add(sender)
                try:
                    reason = share.checks.accept_head(sender, sender_head)
                    if reason:
                        share.fail_sender(sender, reason)
                    else:
                        await self._take_parts(share, sender, reader)
                except BaseException:
                    # whatever went wrong, the share must not wait for this sender's parts
                    share.fail_sender(sender, "its stream ended in an error")
                    raise
            await replies
        finally:
            replies.cancel()

    async def _take_parts(self, share: _Share, sender: int, reader: asyncio.StreamReader) -> None:
        """Read, decode and inspect (ahead, in a worker thread) and reduce a sender's parts, in order."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue(maxsize=PREFETCH)

        def decode(j: int, wire: bytes, size: int):
            part = share.codec.decode(wire, size)
            return part, share.checks.inspect(sender, j, part, wire)

        async def read_parts() -> None:
            try:
                for j, size in enumerate(share.sizes):
                    frame = await asyncio.wait_for(read_frame(reader), share.sender_timeout_s)
                    share.outcome.bytes_received += len(frame.payload) + 9
                    if frame.kind != PART or len(frame.payload) < 4 or struct.unpack_from("<I", frame.payload)[0] != j:
                        raise TransportError(f"expected part {j} of the share")
                    await queue.put(loop.run_in_executor(None, decode, j, frame.payload[4:], size))
            except asyncio.TimeoutError:
                await queue.put(f"sent no part within {share.sender_timeout_s:g} s")
            except (TransportError, ConnectionError) as exc:
                await queue.put(f"its stream failed: {exc}")

        reading = asyncio.create_task(read_parts())
        try:
            for j in range(len(share.sizes)):
                item = await queue.get()
                if isinstance(item, str):
                    share.fail_sender(sender, item)
                    return
                try:
                    part, reason = await item
                except ValueError as exc:
                    share.fail_sender(sender, f"sent a malformed part: {exc}")
                    return
                except Exception as exc:  # a check that broke: the sender is left out, never waited for
                    logger.exception("butterfly: checking part %d of sender #%d failed", j, sender)
                    share.fail_sender(sender, f"its part {j} could not be checked ({type(exc).__name__})")
                    return
                if reason:
                    share.fail_sender(sender, reason)
                    return
                try:
                    await share.add(sender, j, part)
                except Exception as exc:  # banned by a check of the reducer, or the share finished
                    share.fail_sender(sender, str(exc) or type(exc).__name__)
                    return
        finally:
            reading.cancel()

    async def _reply(self, share: _Share, writer: asyncio.StreamWriter) -> None:
        for j, future in enumerate(share.results):
            _, wire, note = await future
            if j == 0:
                # every sender still in the round has sent its head by now (they come before parts)
                head = share.checks.reply_head()
                if head:
                    await write_frame(writer, REPLY_HEAD, head)
                    share.outcome.bytes_sent += len(head) + 9
            await write_frame(writer, AVERAGE, struct.pack("<II", j, len(note)) + note + wire)
            share.outcome.bytes_sent += len(wire) + len(note) + 17

    # -- one member's round ------------------------------------------------------------------
    async def run(self, membership: Membership, parts: Sequence[torch.Tensor], codec: PartCodec, *,
                  sender_timeout_s: float, reducer_timeout_s: float, robust: bool = False,
                  checks: RoundChecks = NO_CHECKS) -> ButterflyOutcome:
        """Average ``parts`` (flat float32, one per global part, written in place) with the group.

        The parts of a share whose reducer fails keep their local values; a member that does not
        send (weight 0, or not a sender) still receives every result. A reducer may wait
        ``sender_timeout_s`` for a late sender before it answers, through no fault of its own: it
        is late only past that plus ``reducer_timeout_s``. ``robust``: our share is combined with
        CenteredClip instead of the weighted mean. ``checks``: the round's checks (RoundChecks)."""
        started = time.monotonic()
        me = membership.index(self.transport.peer_id)
        if len(parts) != membership.num_parts:
            raise MembershipError(f"{len(parts)} parts, the membership has {membership.num_parts}")
        sizes = [int(p.numel()) for p in parts]
        outcome = ButterflyOutcome()
        share = _Share(membership, me, sizes, codec, robust, sender_timeout_s, checks, outcome)
        self._shares[membership.round_id] = share
        arrived = self._arrivals.pop(membership.round_id, None)
        if arrived is not None:
            arrived.set()
        try:
            reply_wait_s = sender_timeout_s + reducer_timeout_s
            tasks = [asyncio.create_task(self._with_reducer(membership, me, k, parts, codec, reply_wait_s, checks,
                                                            outcome))
                     for k in range(len(membership.peers)) if k != me and membership.shares[k] > 0]
            tasks.append(asyncio.create_task(self._own_share(share, me, parts, sender_timeout_s)))
            await asyncio.gather(*tasks)
        finally:
            asyncio.get_running_loop().call_later(LINGER_S, self._shares.pop, membership.round_id, None)
        outcome.duration_s = time.monotonic() - started
        return outcome

    async def _own_share(self, share: _Share, me: int, parts: Sequence[torch.Tensor], sender_timeout_s: float) -> None:
        """Our own parts of our share go in as a remote reducer would decode them; senders that
        never open a stream are left out once the wait for them runs out."""
        loop = asyncio.get_running_loop()
        sender = share.membership.sender_index(me)
        own_task = None
        if sender is not None and share.sizes:
            share.connected.add(sender)
            # our own stream's head, judged as any reducer judges it: a check that leaves us out
            # elsewhere leaves us out of our own share too
            refused = share.checks.accept_head(sender, share.checks.head_for(me))
            if refused:
                share.fail_sender(sender, refused)
            else:

                async def own() -> None:
                    for j in range(len(share.sizes)):
                        part = parts[share.first + j]
                        received = part if share.codec.name == "none" else await loop.run_in_executor(
                            None, share.codec.round_trip, part)
                        await share.add(sender, j, received)

                own_task = asyncio.create_task(own())

        async def absentees() -> None:
            await asyncio.sleep(sender_timeout_s)
            for s in range(len(share.membership.senders)):
                if s not in share.connected:
                    share.fail_sender(s, f"opened no stream within {sender_timeout_s:g} s")

        watch = asyncio.create_task(absentees())
        try:
            if own_task is not None:
                try:
                    await own_task
                except Exception as exc:  # our own part failed a check of our reducer
                    share.fail_sender(sender, str(exc) or type(exc).__name__)
            await share.done.wait()
        finally:
            watch.cancel()
        for j, future in enumerate(share.results):
            received, _, _ = future.result()
            if received is None:
                share.outcome.unaveraged_parts.add(share.first + j)
            else:
                parts[share.first + j].copy_(received)

    async def _with_reducer(self, membership: Membership, me: int, k: int, parts: Sequence[torch.Tensor],
                            codec: PartCodec, timeout_s: float, checks: RoundChecks, outcome: ButterflyOutcome) -> None:
        """Send reducer ``k`` our parts of its share (if we send), and apply what it returns."""
        import msgpack

        first, end = membership.share_of(k)
        loop = asyncio.get_running_loop()
        received: set[int] = set()
        writer = None
        try:
            reader, writer = await asyncio.wait_for(self.transport.open(membership.peers[k], PROTOCOL), timeout_s)
            head = checks.head_for(k) if membership.sender_index(me) is not None else b""
            await write_frame(writer, OPEN, msgpack.packb({"r": membership.round_id, "m": me, "h": head},
                                                          use_bin_type=True))

            async def send() -> None:
                if membership.sender_index(me) is None:
                    return
                for g in range(first, end):
                    wire = await loop.run_in_executor(None, codec.encode, parts[g])
                    await write_frame(writer, PART, struct.pack("<I", g - first) + wire)
                    outcome.bytes_sent += len(wire) + 13

            sending = asyncio.create_task(send())
            try:
                g = first
                while g < end:
                    frame = await asyncio.wait_for(read_frame(reader), timeout_s)
                    outcome.bytes_received += len(frame.payload) + 9
                    if frame.kind == REPLY_HEAD and g == first:
                        reason = checks.read_reply_head(k, frame.payload)
                        if reason:
                            raise _Refused(reason)
                        continue
                    if self._apply(frame, k, g - first, parts[g], codec, checks):
                        received.add(g)
                    g += 1
            finally:
                if not sending.done():
                    sending.cancel()
                else:
                    sending.result()
        except _Refused as exc:
            outcome.refused_reducers[k] = str(exc)
            outcome.refused_for_bytes.add(k)
        except asyncio.TimeoutError:
            outcome.failed_reducers[k] = f"returned no part within {timeout_s:g} s"
        except (TransportError, ConnectionError, ValueError) as exc:
            outcome.failed_reducers[k] = str(exc)[:300] or type(exc).__name__
        finally:
            if writer is not None:
                writer.close()
        missing = [g for g in range(first, end) if g not in received]
        if k in outcome.refused_reducers:
            # the same on every receiver of its bytes: zeros, never our own values
            for g in missing:
                parts[g].zero_()
            outcome.zeroed_parts.update(missing)
            logger.warning("butterfly %s: refused reducer #%d (%s); the rest of its share is zeros",
                           membership.round_id, k, outcome.refused_reducers[k])
        else:
            outcome.unaveraged_parts.update(missing)
            if k in outcome.failed_reducers:
                logger.warning("butterfly %s: reducer #%d failed (%s); its remaining parts keep our values",
                               membership.round_id, k, outcome.failed_reducers[k])

    @staticmethod
    def _apply(frame: Frame, k: int, j: int, part: torch.Tensor, codec: PartCodec, checks: RoundChecks) -> bool:
        """Apply reducer ``k``'s result of part ``j`` of its share: False when the part has no
        result (ours stays), ``_Refused`` when a check refuses it."""
        if frame.kind == REFUSED:
            raise TransportError(f"refused the stream: {frame.payload.decode(errors='replace')[:200]}")
        payload = frame.payload
        if frame.kind != AVERAGE or len(payload) < 8 or struct.unpack_from("<I", payload)[0] != j:
            raise _Refused(f"sent something else than the result of part {j} of its share")
        note_length = struct.unpack_from("<I", payload, 4)[0]
        if 8 + note_length > len(payload):
            raise _Refused(f"sent a note longer than its result of part {j}")
        note, wire = payload[8:8 + note_length], payload[8 + note_length:]
        if not wire:
            return False
        try:
            values = codec.decode(wire, part.numel())
        except ValueError as exc:
            raise _Refused(f"returned a malformed part {j}: {exc}") from None
        if not bool(torch.isfinite(values).all()):
            raise _Refused(f"returned non-finite values in part {j} of its share")
        reason = checks.check(k, j, values, note)
        if reason:
            raise _Refused(reason)
        part.copy_(values)
        return True


class _Refused(Exception):
    """A reducer's reply that a check refused (the rest of its share becomes zeros)."""
