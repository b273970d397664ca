"""The sender's end of a reducer's reply stream: heads and notes to dtrain, parts to hivemind.

A sender hangs up as soon as the last part it expects is in (the reducer waits for that:
ButterflyRunner.rpc_aggregate_part), and a failure of our own writer aborts the stream at once
instead of leaving both ends to their timeouts (docs/swarm.md, "Measured").
"""

from __future__ import annotations

import asyncio
import logging

from hivemind.averaging.partition import AllreduceException
from hivemind.proto import averaging_pb2

logger = logging.getLogger(__name__)


class SendingFailed(AllreduceException):
    """Our own parts could not be produced or written to a reducer; the stream was aborted."""


class ReplyStream:
    """Wraps hivemind's stub to one reducer for one round.

    It counts the bytes of the replies, hands the reducer's head to ``runner.checks.reply`` and
    keeps each part's note for the part's check (``runner.notes``), and ends the read once
    ``expected_parts`` averaged parts are in. Our writer's failure is logged, closes our end
    (so the reducer hears it too) and is raised as :class:`SendingFailed`: that reducer's share
    keeps our local values, as for any failed reducer.
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
        return self._replies(stream, failed)

    async def _replies(self, stream, failed: asyncio.Future):
        runner, peer_index = self._runner, self._peer_index
        reply = runner.checks.reply
        received, head_expected = 0, reply.expects_head(peer_index)
        try:
            while True:
                msg = await _next_unless_failed(stream, failed)
                if msg is None:
                    break
                runner.facts.bytes_received += msg.ByteSize()
                if head_expected:
                    head_expected = False
                    self._read_head(msg)
                    continue
                if msg.code == averaging_pb2.AVERAGED_PART:
                    runner.notes[(peer_index, received)] = bytes(msg.group_id)
                yield msg
                if msg.code == averaging_pb2.AVERAGED_PART:
                    received += 1
                    if received >= self._expected:
                        break
        finally:
            await stream.aclose()  # closes our end of the p2p stream

    def _read_head(self, msg) -> None:
        """The reducer's head is dtrain's to read; hivemind sees only averaged parts."""
        runner, peer_index = self._runner, self._peer_index
        if msg.code != averaging_pb2.PART_FOR_AVERAGING:
            reason = "sent averaged parts without the claims that account for them"
        else:
            reason = runner.checks.reply.read_head(peer_index, bytes(msg.tensor_part.buffer))
        if reason:
            runner.facts.refused_reducers.add(peer_index)
            raise AllreduceException(reason)


async def _next_unless_failed(stream, failed: asyncio.Future):
    """The stream's next message, None at its end; SendingFailed once our writer failed first."""
    reply = asyncio.ensure_future(stream.__anext__())
    await asyncio.wait({reply, failed}, return_when=asyncio.FIRST_COMPLETED)
    if not reply.done():  # our writer failed first: stop reading, close the stream
        reply.cancel()
        await asyncio.gather(reply, return_exceptions=True)
        exc = failed.result()
        raise SendingFailed(f"could not send our parts: {exc!r}"[:300]) from exc
    try:
        return reply.result()
    except StopAsyncIteration:
        return None
