"""hivemind's AllReduceRunner with dtrain's reducer, byte counts and hooks (dtrain/swarm/averaging/runner.py)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Optional

import torch
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.partition import AllreduceException
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.asyncio import amap_in_executor

logger = logging.getLogger(__name__)


class SendingFailed(AllreduceException):
    """Our own parts could not be produced or written to a reducer; the stream was aborted."""


class ButterflyRunner(AllReduceRunner):
    """hivemind's AllReduceRunner with dtrain's reducer, byte counts and hooks.

    Differences from hivemind's: every reducer returns the averaged part itself, not a delta
    (local + delta differs from the average by rounding, differently on every peer, and the
    protocol needs bit-identical results); a failed reducer's share therefore falls back to our
    raw local part, or to zeros for a reducer *refused* for what it returned (a failed check of
    the received bytes, which every receiver of those bytes runs alike, so all of them hold the
    same values; ``zeroed`` names those parts, which dtrain's averager re-reduces afterwards). Reducers may head their replies with a preamble of their own and attach a
    note to each averaged part (:meth:`reply_preamble`, :meth:`reply_note`; read by
    :meth:`accept_reply_preamble`, :meth:`accept_reply_note`). Subclasses implement :meth:`new_reducer` and :meth:`serve_stream`, and may
    implement :meth:`check_averaged_part`, :meth:`inspect_part`, :meth:`messages_to_reducer`,
    :meth:`serialized_average`, :meth:`on_reducer_failed` and the stream's *preamble*
    (:meth:`preamble_for`, :meth:`expects_preamble`, :meth:`accept_preamble`): bytes a sender
    puts ahead of its first part, in a message of its own, which the reducer reads before any
    part (dtrain's claims for the reducer's share).
    """

    # After its last averaged part, keep a sender's stream open this long for the sender to hang
    # up (CountingStub); None closes at once, as hivemind does.
    reply_linger_s: Optional[float] = None

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.bytes_sent = 0
        self.bytes_received = 0
        self.failed_reducers: dict[str, str] = {}  # reducer peer id -> why its share stayed local
        self.sending_failures: dict[str, str] = {}  # reducer peer id -> why we could not send it our parts
        # reducers refused for what they returned (a failed check): their share becomes zeros
        self.refused_reducers: set[int] = set()
        self.refused_size = 0
        self.zeroed: set[tuple[int, int]] = set()  # (reducer peer index, part index in its share) now zeros
        old = self.tensor_part_reducer  # hivemind's: retired quietly, replaced by ours (same shapes)
        old.finished.set()
        old.current_part_future.cancel()
        self.tensor_part_reducer = self.new_reducer(tuple(p.shape for p in self.parts_for_local_averaging),
                                                    len(self.sender_peer_ids))
        container = self.tensor_part_container
        register, register_failed = container.register_processed_part, container.register_failed_reducer
        falling_back = []  # set while a failed reducer's share is filled in (local values or zeros)

        def register_checked(peer_index: int, part_index: int, part: torch.Tensor):
            # raising here makes hivemind fill in the rest of that reducer's share (below)
            if not falling_back:
                problem = self.check_averaged_part(peer_index, part_index, part)
                if problem:
                    self.refused_reducers.add(peer_index)
                    raise AllreduceException(problem)
            return register(peer_index, part_index, part)

        def register_failed_reducer(peer_index: int):
            # hivemind registers our local parts through register_processed_part: they are no
            # reducer's result, and a check of them (an account, say) must not stop the fallback
            falling_back.append(peer_index)
            try:
                if peer_index in self.refused_reducers:
                    # refused for what it sent (a check of the received bytes, which every
                    # receiver of the same bytes runs alike): the rest of its share is zeros,
                    # so all of them hold the same values and none needs another's state
                    for part_index in range(container._outputs_registered_by_peer[peer_index],
                                            container.num_parts_by_peer[peer_index]):
                        local = container._input_parts_by_peer[peer_index][part_index][0]
                        register(peer_index, part_index, torch.zeros_like(local))
                        container.failed_size += local.numel()
                        self.refused_size += local.numel()
                        self.zeroed.add((peer_index, part_index))
                else:
                    register_failed(peer_index)  # hivemind's: our own local values
            finally:
                falling_back.pop()

        container.register_processed_part = register_checked
        container.register_failed_reducer = register_failed_reducer
        container.return_deltas = False

    # -- hooks -----------------------------------------------------------------------------
    def new_reducer(self, part_shapes: tuple, num_senders: int):
        """The reducer of this peer's share (the interface of hivemind's TensorPartReducer)."""
        raise NotImplementedError

    def serve_stream(self, sender_index: int, parts: AsyncIterator) -> AsyncIterator:
        """Reduce a sender's parts as they arrive: ``parts`` yields ``(part, compression id,
        inspect_part's verdict)``; yield ``(averaged part, compression id)`` for each part reduced,
        and stop to refuse the sender (it is then banned)."""
        raise NotImplementedError

    def inspect_part(self, sender_index: int, part_index: int, part: torch.Tensor, wire: bytes) -> Any:
        """Worker thread, as a received part is decoded (``wire``: its bytes as they came, before
        decoding): checks that should not run on the loop."""
        return None

    def check_averaged_part(self, peer_index: int, part_index: int, part: torch.Tensor) -> Optional[str]:
        """Why an averaged part (ours or a reducer's) must not be applied; None to apply it."""
        return None

    def messages_to_reducer(self, peer_index: int, messages: AsyncIterator) -> AsyncIterator:
        """The wire messages of our parts to a reducer (tests inject faults here)."""
        return messages

    def preamble_for(self, peer_index: int) -> Optional[bytes]:
        """Bytes to send the reducer ``peer_index`` ahead of our first part (None: no preamble)."""
        return None

    def expects_preamble(self, sender_index: int) -> bool:
        """Whether this sender's stream starts with a preamble (every peer must agree on it)."""
        return False

    def accept_preamble(self, sender_index: int, data: bytes) -> Optional[str]:
        """Read a sender's preamble; a reason refuses the sender (it is then banned)."""
        return None

    def reply_preamble(self) -> Optional[bytes]:
        """Reducer side: bytes to send every sender ahead of our first averaged part (None: none)."""
        return None

    def reply_note(self, part_index: int) -> bytes:
        """Reducer side: bytes that travel with averaged part ``part_index`` (its account)."""
        return b""

    def expects_reply_preamble(self, peer_index: int) -> bool:
        """Whether the reducer ``peer_index`` heads its replies with a preamble (every peer must agree)."""
        return False

    def accept_reply_preamble(self, peer_index: int, data: bytes) -> Optional[str]:
        """Read a reducer's reply preamble; a reason refuses that reducer (the rest of its share is zeros)."""
        return None

    def accept_reply_note(self, peer_index: int, part_index: int, note: bytes) -> None:
        """Keep the note of a reducer's averaged part until check_averaged_part reads it."""

    def serialized_average(self, part_index: int, averaged: torch.Tensor, compression_type) -> Any:
        """An awaitable of the averaged part's wire form."""
        return asyncio.get_event_loop().run_in_executor(None, serialize_torch_tensor, averaged, compression_type)

    def on_reducer_failed(self, peer_id: str, reason: str) -> None:
        self.failed_reducers.setdefault(peer_id, reason)

    # -- facts -----------------------------------------------------------------------------
    def count_zeroed(self, size: int) -> None:
        """``size`` more values of the vector are zeros for a refused reducer (not averaged)."""
        self.tensor_part_container.failed_size += size
        self.refused_size += size

    def count_recovered(self, size: int) -> None:
        """``size`` values counted by :meth:`count_zeroed` were averaged after all."""
        self.tensor_part_container.failed_size -= size
        self.refused_size -= size

    @property
    def reducer(self):
        """This peer's reducer (what new_reducer built)."""
        return self.tensor_part_reducer

    @property
    def wire_compression(self):
        return self.tensor_part_container.compression

    def share_of(self, peer_index: int) -> tuple[int, int]:
        """The global part indices ``[first, end)`` that the reducer ``peer_index`` reduces."""
        counts = self.tensor_part_container.num_parts_by_peer
        first = sum(counts[:peer_index])
        return first, first + counts[peer_index]

    def sent_part(self, peer_index: int, part_index: int) -> torch.Tensor:
        """Our part ``part_index`` for the reducer ``peer_index``, as we had it before the wire codec."""
        return self.tensor_part_container._input_parts_by_peer[peer_index][part_index][0]

    @property
    def first_part(self) -> int:
        """Global index of the first part this peer reduces (parts go to reducers in order)."""
        me = self.ordered_peer_ids.index(self.peer_id)
        return sum(self.tensor_part_container.num_parts_by_peer[:me])

    @property
    def sender_ids(self) -> list[str]:
        return [str(p) for p in self.sender_peer_ids]

    def outcome(self) -> dict:
        """What happened in this round, in plain values (for the round report)."""
        container = self.tensor_part_container
        return dict(banned={str(p) for p in self.banned_senders}, failed_reducers=dict(self.failed_reducers),
                    sending_failures=dict(self.sending_failures),
                    never_started={str(p) for p in self.sender_peer_ids
                                   if p not in self.active_senders and p != self.peer_id},
                    bytes_sent=int(self.bytes_sent), bytes_received=int(self.bytes_received),
                    total_size=int(container.total_size), failed_size=int(container.failed_size),
                    refused_size=int(self.refused_size),
                    refused_reducers=sorted(str(self.ordered_peer_ids[i]) for i in self.refused_reducers))

    def as_received(self, part: torch.Tensor) -> torch.Tensor:
        """Hook: what a remote sender decodes of ``part`` (the lossy compression round trip). Our
        own share keeps exactly that, so every peer holds the same bits. dtrain's rule is
        dtrain.swarm.wire.as_received, which the claims are computed with too."""
        raise NotImplementedError

    # -- client side -----------------------------------------------------------------------
    async def reduce_own_share(self) -> None:
        """Our own share: reduce locally, and keep exactly what remote senders will receive.

        Our own part goes in as a remote reducer would decode it, like every other sender's:
        the combination is then exactly the one our account states over the senders' claims
        (which are of decoded parts), not that plus our codec error, which the receivers'
        account check and the round audit would otherwise have to absorb."""
        peer_index = self.ordered_peer_ids.index(self.peer_id)
        sender_index = self.sender_peer_ids.index(self.peer_id)
        loop = asyncio.get_event_loop()
        lossless = self.wire_compression.compression_type == runtime_pb2.NONE  # as_received is the part itself
        for part_index, tensor_part in enumerate(self.parts_for_local_averaging):
            if not lossless:
                tensor_part = await loop.run_in_executor(None, self.as_received, tensor_part)
            averaged = await self.tensor_part_reducer.accumulate_part(sender_index, part_index, tensor_part)
            received = averaged if lossless else await loop.run_in_executor(None, self.as_received, averaged)
            self.tensor_part_container.register_processed_part(peer_index, part_index, received)

    async def _communicate_with_peer(self, peer_id):
        if peer_id == self.peer_id:
            await self.reduce_own_share()
            return
        try:
            await super()._communicate_with_peer(peer_id)
        except SendingFailed as e:
            # our fault, not the reducer's: its share keeps our local values all the same
            self.sending_failures[str(peer_id)] = str(e)[:200]
            raise
        except BaseException as e:
            self.on_reducer_failed(str(peer_id), repr(e)[:200] or type(e).__name__)
            raise

    async def _generate_input_for_peer(self, peer_index: int):
        preamble = self.preamble_for(peer_index)
        if preamble is not None:
            # its own message ahead of the parts, with what a first message must carry (the code
            # and group id hivemind's reducer checks before it reads anything else)
            msg = averaging_pb2.AveragingData(
                code=averaging_pb2.PART_FOR_AVERAGING, group_id=self.group_id, weight=self.weight,
                tensor_part=runtime_pb2.Tensor(buffer=preamble, size=[len(preamble)], dtype="uint8"))
            self.bytes_sent += msg.ByteSize()
            yield msg
        async for msg in self.messages_to_reducer(peer_index, super()._generate_input_for_peer(peer_index)):
            self.bytes_sent += msg.ByteSize()
            yield msg

    def _get_peer_stub(self, peer):
        peer_index = self.ordered_peer_ids.index(peer)
        expected = self.tensor_part_container.num_parts_by_peer[peer_index]
        return CountingStub(super()._get_peer_stub(peer), self, expected, peer_index)

    # -- server side -----------------------------------------------------------------------
    async def _accumulate_parts_streaming(self, stream, sender_index: int):
        """Decode (and inspect) a sender's parts in a worker thread, prefetched while the previous
        part waits for the other senders; serve_stream reduces them; reply with each average."""
        served = 0

        async def numbered():
            index = 0
            async for msg in stream:
                yield index, msg
                index += 1

        def decode(item):
            part_index, msg = item
            part = deserialize_torch_tensor(msg.tensor_part)
            verdict = self.inspect_part(sender_index, part_index, part, msg.tensor_part.buffer)
            return part, msg.tensor_part.compression, verdict

        try:
            if self.expects_preamble(sender_index):
                try:
                    head = await stream.__anext__()
                except StopAsyncIteration:
                    return  # hung up before anything: banned below, like any stream that ends short
                reason = self.accept_preamble(sender_index, bytes(head.tensor_part.buffer))
                if reason:
                    logger.warning("swarm: refusing sender %s: %s", self.sender_peer_ids[sender_index], reason)
                    return
            parts = amap_in_executor(decode, numbered(), max_prefetch=self.tensor_part_container.prefetch)
            replies = self.serve_stream(sender_index, parts)
            try:
                async for averaged, part_compression in replies:
                    if served == 0:
                        # by now every sender still in the round has sent its first part, and with
                        # it its own preamble: what ours carries is complete
                        head = self.reply_preamble()
                        if head is not None:
                            yield averaging_pb2.AveragingData(
                                code=averaging_pb2.PART_FOR_AVERAGING,
                                tensor_part=runtime_pb2.Tensor(buffer=head, size=[len(head)], dtype="uint8"))
                    served += 1
                    serialized = await self.serialized_average(served - 1, averaged, part_compression)
                    # hivemind reads neither group_id nor peer_id of a reply: the part's note rides in group_id
                    yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=serialized,
                                                      group_id=self.reply_note(served - 1))
                    if served >= self.tensor_part_reducer.num_parts:
                        # Nothing is read past the sender's last part. It hangs up once it holds
                        # our last reply (CountingStub), which on a loaded host can be before its
                        # writer sent the stream's end marker; waiting for that marker here, the
                        # hang-up cancelled this handler, and hivemind's rpc_aggregate_part bans a
                        # sender on any exception: an honest peer recorded "banned as sender" for
                        # a race. Ended here, our stream lingers (rpc_aggregate_part below) and
                        # the hang-up only ends the linger.
                        break
            finally:
                await replies.aclose()
                await parts.aclose()  # stops its reader task now, not when it is collected
        finally:
            if served != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])

    async def rpc_aggregate_part(self, stream, context):
        async def counted():
            async for msg in stream:
                self.bytes_received += msg.ByteSize()
                yield msg

        delivered, last = 0, None
        async for reply in super().rpc_aggregate_part(counted(), context):
            self.bytes_sent += reply.ByteSize()
            if reply.code == averaging_pb2.AVERAGED_PART:
                delivered += 1
                if delivered == self.tensor_part_reducer.num_parts:
                    # Held until hivemind's handler has returned (at once: nothing is read past
                    # the last part, _accumulate_parts_streaming). It bans a sender on any
                    # BaseException, the GeneratorExit of its generator closed at a yield
                    # included; the sender hangs up as soon as it holds this part, and that
                    # closed the generator if it came before the handler was resumed once more.
                    last = reply
                    continue
            yield reply
        if last is not None:
            yield last
        if delivered < self.tensor_part_reducer.num_parts or self.reply_linger_s is None:
            return  # refused or banned: it expects more and would otherwise wait its reducer timeout for our end
        # Do not end the stream: the sender hangs up once it holds its last averaged part
        # (CountingStub), which cancels this wait. Returning here would close our side while
        # p2pd may still hold that last part, and the sender, now and then, lost it ("sent 31
        # parts, but we expected 32") and kept its local values for this whole share.
        await asyncio.sleep(self.reply_linger_s)


class CountingStub:
    """Wraps a hivemind stub: counts the bytes of the averaged parts we receive back, hangs up
    as soon as the last expected part is in (the reducer waits for that, see
    ButterflyRunner.rpc_aggregate_part), and aborts the stream at once when our writer fails.

    hivemind writes a stream's requests from a separate task and looks at that task only after
    the last reply. A part that fails to encode (or to be written) ended that task quietly:
    the reducer then waited its sender timeout for our next part and we our reducer timeout
    for its reply, and nobody said why. Here a failure of the writer is logged with its
    traceback, ends the read at once (which closes our end of the stream, so the reducer
    hears it too) and is raised as :class:`SendingFailed`: the share of that reducer keeps our
    local values, as for any failed reducer.
    """

    def __init__(self, stub, runner, expected_parts: int, peer_index: int = -1):
        self._stub, self._runner, self._expected = stub, runner, expected_parts
        self._peer_index = peer_index

    async def rpc_aggregate_part(self, inputs):
        failed: asyncio.Future = asyncio.get_event_loop().create_future()

        async def watched_inputs():
            try:
                async for msg in inputs:
                    yield msg
            except Exception as exc:
                logger.warning("swarm: writing our parts to a reducer failed; aborting that stream", exc_info=True)
                if not failed.done():
                    failed.set_result(exc)
                raise

        stream = await self._stub.rpc_aggregate_part(watched_inputs())
        runner, expected, peer_index = self._runner, self._expected, self._peer_index

        async def counted():
            received = 0
            head_expected = runner.expects_reply_preamble(peer_index)
            try:
                while True:
                    reply = asyncio.ensure_future(stream.__anext__())
                    await asyncio.wait({reply, failed}, return_when=asyncio.FIRST_COMPLETED)
                    if not reply.done():  # our writer failed first: stop reading, close the stream
                        reply.cancel()
                        await asyncio.gather(reply, return_exceptions=True)
                        exc = failed.result()
                        raise SendingFailed(f"could not send our parts: {exc!r}"[:300]) from exc
                    try:
                        msg = reply.result()
                    except StopAsyncIteration:
                        break
                    runner.bytes_received += msg.ByteSize()
                    if head_expected:
                        # the reducer's preamble is ours to read; hivemind sees only averaged parts
                        head_expected = False
                        if msg.code != averaging_pb2.PART_FOR_AVERAGING:
                            runner.refused_reducers.add(peer_index)
                            raise AllreduceException("sent averaged parts without the claims that account for them")
                        reason = runner.accept_reply_preamble(peer_index, bytes(msg.tensor_part.buffer))
                        if reason:
                            runner.refused_reducers.add(peer_index)
                            raise AllreduceException(reason)
                        continue
                    if msg.code == averaging_pb2.AVERAGED_PART:
                        runner.accept_reply_note(peer_index, received, bytes(msg.group_id))
                    yield msg
                    if msg.code == averaging_pb2.AVERAGED_PART:
                        received += 1
                        if received >= expected:
                            break
            finally:
                await stream.aclose()  # closes our end of the p2p stream

        return counted()
