"""hivemind's AllReduceRunner driven by dtrain's checks (the ``ButterflyChecks`` protocol below).

The runner moves bytes; what the bytes must be is dtrain's (dtrain/swarm/averaging/butterfly.py).
It differs from hivemind's in four ways: a reducer returns the average itself, not a delta, so
every receiver holds the same bits; a reducer refused for what it returned leaves zeros, not
our local values, for the rest of its share (every receiver of its bytes refuses it alike);
heads travel ahead of a sender's parts and of a reducer's replies, and a note with each reply;
and a reducer keeps a sender's stream open until the sender hangs up (docs/swarm.md, "Measured").
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Optional, Protocol

import torch
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.partition import AllreduceException
from hivemind.compression import deserialize_torch_tensor
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.asyncio import amap_in_executor

from dtrain.swarm.hivemind_internals.reply_stream import ReplyStream, SendingFailed

logger = logging.getLogger(__name__)

# How long a reducer keeps a sender's stream open after its last averaged part, waiting for
# the sender to hang up (it does so at once; this only bounds a sender that does not).
REPLY_LINGER_S = 30.0


class SendingSide(Protocol):
    """What we send each reducer: our head, then our parts (hivemind's messages)."""

    def stream(self, reducer_index: int, parts: AsyncIterator) -> AsyncIterator:
        """Yield our head (``bytes``) for that reducer if we have one, then each part's message."""


class ShareSide(Protocol):
    """Our share, as its reducer: the senders' heads and parts, checked and reduced."""

    reducer: Any  # the share's reducer (the interface of hivemind's TensorPartReducer)

    def expects_head(self, sender_index: int) -> bool:
        """Whether this sender's stream starts with a head (every peer agrees, from the gathers)."""

    def accept_head(self, sender_index: int, data: bytes) -> Optional[str]:
        """Read a sender's head; a reason refuses the sender (it is then banned)."""

    def inspect(self, sender_index: int, part_index: int, part: torch.Tensor, wire: bytes) -> Any:
        """Worker thread, as a received part is decoded: checks that should not run on the loop."""

    def serve(self, sender_index: int, parts: AsyncIterator) -> AsyncIterator:
        """``parts`` yields ``(part, compression id, inspect's verdict)``; yield ``(averaged part,
        compression id)`` per part reduced, and stop to refuse the sender (it is then banned)."""

    def as_received(self, part: torch.Tensor) -> torch.Tensor:
        """What a remote reducer decodes of our part (the codec's round trip)."""


class ReplySide(Protocol):
    """The reducer's reply: what we return as a reducer, and what we check of a reducer's reply."""

    def head(self) -> Optional[bytes]:
        """Reducer side: bytes ahead of our first averaged part, to every sender (None: none)."""

    def part(self, part_index: int, averaged: torch.Tensor, compression: Any) -> Awaitable:
        """Reducer side: ``(tensor message, note bytes)`` of averaged part ``part_index``."""

    def expects_head(self, reducer_index: int) -> bool:
        """Receiver side: whether that reducer heads its replies (every peer agrees)."""

    def read_head(self, reducer_index: int, data: bytes) -> Optional[str]:
        """Receiver side: read a reducer's head; a reason refuses that reducer."""

    def check(self, reducer_index: int, part_index: int, part: torch.Tensor, note: bytes) -> Optional[str]:
        """Receiver side: why a reducer's averaged part (or our own) must not be applied; None applies it."""


class ButterflyChecks(Protocol):
    """The checks of one round, as the runner calls them (dtrain.swarm.averaging.butterfly)."""

    sending: SendingSide
    share: ShareSide
    reply: ReplySide


@dataclass
class ButterflyFacts:
    """What happened in one peer's butterfly, in plain values (peer ids, indices, counts)."""

    banned: set = field(default_factory=set)  # senders banned for any reason
    failed_reducers: dict = field(default_factory=dict)  # reducer -> why its share stayed local
    sending_failures: dict = field(default_factory=dict)  # reducer -> why we could not send it our parts
    never_started: set = field(default_factory=set)  # senders that never opened a stream to us
    bytes_sent: int = 0
    bytes_received: int = 0
    total_size: int = 0
    failed_size: int = 0  # values that hold no average (local values, or zeros of a refused reducer)
    refused_size: int = 0  # of those, zeros of a refused reducer
    refused_reducers: set = field(default_factory=set)  # reducer peer indices refused for what they returned
    zeroed: set = field(default_factory=set)  # (reducer peer index, part index in its share) now zeros


class ButterflyRunner(AllReduceRunner):
    """One peer's butterfly in one group, with ``checks`` deciding what is sent, reduced and applied."""

    def __init__(self, *, checks: ButterflyChecks, parts_by_peer: tuple, **kwargs):
        super().__init__(**kwargs)
        self.checks = checks
        container = self.tensor_part_container
        if tuple(container.num_parts_by_peer) != tuple(parts_by_peer):
            raise AllreduceException(f"hivemind split the parts {tuple(container.num_parts_by_peer)}, dtrain "
                                     f"{tuple(parts_by_peer)}")
        self.facts = ButterflyFacts(total_size=int(container.total_size))
        self.notes: dict[tuple[int, int], bytes] = {}  # (reducer index, part index) -> its reply's note
        old = self.tensor_part_reducer  # hivemind's: retired quietly, replaced by dtrain's (same shapes)
        old.finished.set()
        old.current_part_future.cancel()
        self.tensor_part_reducer = checks.share.reducer
        container.return_deltas = False
        self._checked_registration(container)

    def _checked_registration(self, container) -> None:
        """Every averaged part passes ``checks.reply.check`` before it is applied. A refused
        reducer's remaining parts become zeros (the same on every receiver of its bytes); any
        other failed reducer's keep our local values (hivemind's fallback)."""
        register, register_failed = container.register_processed_part, container.register_failed_reducer
        falling_back = []  # set while a failed reducer's share is filled in: no reducer's result
        facts = self.facts

        def register_checked(peer_index: int, part_index: int, part: torch.Tensor):
            if not falling_back:
                problem = self.checks.reply.check(peer_index, part_index, part,
                                                  self.notes.pop((peer_index, part_index), b""))
                if problem:
                    facts.refused_reducers.add(peer_index)
                    raise AllreduceException(problem)  # hivemind then fills in the rest (below)
            return register(peer_index, part_index, part)

        def register_failed_reducer(peer_index: int):
            falling_back.append(peer_index)
            try:
                if peer_index not in facts.refused_reducers:
                    register_failed(peer_index)
                    return
                for part_index in range(container._outputs_registered_by_peer[peer_index],
                                        container.num_parts_by_peer[peer_index]):
                    local = container._input_parts_by_peer[peer_index][part_index][0]
                    register(peer_index, part_index, torch.zeros_like(local))
                    container.failed_size += local.numel()
                    facts.refused_size += local.numel()
                    facts.zeroed.add((peer_index, part_index))
            finally:
                falling_back.pop()

        container.register_processed_part = register_checked
        container.register_failed_reducer = register_failed_reducer

    def outcome(self) -> ButterflyFacts:
        """The facts of the round so far (call once it ran)."""
        facts, container = self.facts, self.tensor_part_container
        facts.banned = {str(p) for p in self.banned_senders}
        facts.never_started = {str(p) for p in self.sender_peer_ids
                               if p not in self.active_senders and p != self.peer_id}
        facts.failed_size = int(container.failed_size)
        return facts

    # -- client side: our parts, and the reducers' replies ---------------------------------
    async def reduce_own_share(self) -> None:
        """Our own share: each of our parts goes in as a remote reducer would decode it, and we
        keep exactly what remote senders receive, so the result is the one our account states."""
        peer_index = self.ordered_peer_ids.index(self.peer_id)
        sender_index = self.sender_peer_ids.index(self.peer_id)
        loop = asyncio.get_event_loop()
        lossless = self.tensor_part_container.compression.compression_type == runtime_pb2.NONE
        as_received = self.checks.share.as_received
        for part_index, tensor_part in enumerate(self.parts_for_local_averaging):
            if not lossless:
                tensor_part = await loop.run_in_executor(None, as_received, tensor_part)
            averaged = await self.tensor_part_reducer.accumulate_part(sender_index, part_index, tensor_part)
            received = averaged if lossless else await loop.run_in_executor(None, as_received, averaged)
            self.tensor_part_container.register_processed_part(peer_index, part_index, received)

    async def _communicate_with_peer(self, peer_id):
        if peer_id == self.peer_id:
            await self.reduce_own_share()
            return
        try:
            await super()._communicate_with_peer(peer_id)
        except SendingFailed as e:
            # our fault, not the reducer's: its share keeps our local values all the same
            self.facts.sending_failures[str(peer_id)] = str(e)[:200]
            raise
        except BaseException as e:
            self.facts.failed_reducers.setdefault(str(peer_id), repr(e)[:200] or type(e).__name__)
            raise

    async def _generate_input_for_peer(self, peer_index: int):
        async for item in self.checks.sending.stream(peer_index, super()._generate_input_for_peer(peer_index)):
            if isinstance(item, bytes):
                # a head: its own message, with what a first message must carry (the code and group
                # id hivemind's reducer checks before it reads anything else)
                item = averaging_pb2.AveragingData(
                    code=averaging_pb2.PART_FOR_AVERAGING, group_id=self.group_id, weight=self.weight,
                    tensor_part=runtime_pb2.Tensor(buffer=item, size=[len(item)], dtype="uint8"))
            self.facts.bytes_sent += item.ByteSize()
            yield item

    def _get_peer_stub(self, peer):
        peer_index = self.ordered_peer_ids.index(peer)
        expected = self.tensor_part_container.num_parts_by_peer[peer_index]
        return ReplyStream(super()._get_peer_stub(peer), self, expected, peer_index)

    # -- server side: our share ------------------------------------------------------------
    async def _accumulate_parts_streaming(self, stream, sender_index: int):
        """Read a sender's head, decode and inspect its parts in a worker thread (prefetched while
        the previous part waits for the other senders), reduce them, reply with each average."""
        share, reply = self.checks.share, self.checks.reply
        served = 0
        try:
            if share.expects_head(sender_index):
                try:
                    head = await stream.__anext__()
                except StopAsyncIteration:
                    return  # hung up before anything: banned below, like any stream that ends short
                reason = share.accept_head(sender_index, bytes(head.tensor_part.buffer))
                if reason:
                    logger.warning("swarm: refusing sender %s: %s", self.sender_peer_ids[sender_index], reason)
                    return
            parts = amap_in_executor(self._decoder(sender_index), _numbered(stream),
                                     max_prefetch=self.tensor_part_container.prefetch)
            replies = share.serve(sender_index, parts)
            try:
                async for averaged, part_compression in replies:
                    if served == 0:
                        # every sender still in the round has sent its first part, and with it its head
                        head = reply.head()
                        if head is not None:
                            yield averaging_pb2.AveragingData(
                                code=averaging_pb2.PART_FOR_AVERAGING,
                                tensor_part=runtime_pb2.Tensor(buffer=head, size=[len(head)], dtype="uint8"))
                    served += 1  # its part is reduced: a hang-up while the reply is serialised is no short stream
                    tensor, note = await reply.part(served - 1, averaged, part_compression)
                    # hivemind reads neither group_id nor peer_id of a reply: the part's note rides in group_id
                    yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=tensor,
                                                      group_id=note)
                    if served >= self.tensor_part_reducer.num_parts:
                        break  # read nothing past the sender's last part: its hang-up must not reach us here
            finally:
                await replies.aclose()
                await parts.aclose()  # stops its reader task now, not when it is collected
        finally:
            if served != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])

    def _decoder(self, sender_index: int):
        inspect = self.checks.share.inspect

        def decode(item):
            part_index, msg = item
            part = deserialize_torch_tensor(msg.tensor_part)
            return part, msg.tensor_part.compression, inspect(sender_index, part_index, part, msg.tensor_part.buffer)

        return decode

    async def rpc_aggregate_part(self, stream, context):
        async def counted():
            async for msg in stream:
                self.facts.bytes_received += msg.ByteSize()
                yield msg

        delivered, last = 0, None
        async for reply in super().rpc_aggregate_part(counted(), context):
            self.facts.bytes_sent += reply.ByteSize()
            if reply.code == averaging_pb2.AVERAGED_PART:
                delivered += 1
                if delivered == self.tensor_part_reducer.num_parts:
                    # held until hivemind's handler has returned: it bans a sender on any exception,
                    # the GeneratorExit of a hang-up at a yield included
                    last = reply
                    continue
            yield reply
        if last is not None:
            yield last
        if delivered < self.tensor_part_reducer.num_parts:
            return  # refused or banned: it expects more and would otherwise wait its reducer timeout for our end
        # Keep our end open until the sender hangs up (it does once it holds this part): closing it
        # first can lose the last part in p2pd.
        await asyncio.sleep(REPLY_LINGER_S)


async def _numbered(stream):
    index = 0
    async for msg in stream:
        yield index, msg
        index += 1
