"""A sender hangs up on a reducer as soon as it holds every averaged part it expects.

The reducer keeps its end of the stream open after its last reply, and the sender closes
once that reply is in (dtrain/swarm/hivemind_internals/reply_stream.py, ReplyStream, and
runner.py, ButterflyRunner.rpc_aggregate_part). Closing first on the reducer's side let p2pd drop the
last reply now and then, and the sender then kept its local values for that whole share.
"""

from __future__ import annotations

import asyncio
import types

import torch
from hivemind.compression import serialize_torch_tensor
from hivemind.proto import averaging_pb2

from dtrain.swarm.hivemind_internals import ButterflyFacts, ReplyStream


def _reply(i: int) -> averaging_pb2.AveragingData:
    return averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART,
                                       tensor_part=serialize_torch_tensor(torch.full((8,), float(i))))


def _reducer(parts: int, then_wait: bool, closed: list):
    async def replies():
        try:
            for i in range(parts):
                yield _reply(i)
            if then_wait:
                await asyncio.sleep(3600)  # the reducer waits for the sender to hang up
        finally:
            closed.append(True)

    class Stub:  # what hivemind's stub returns: the reply stream
        async def rpc_aggregate_part(self, inputs):
            return replies()

    return Stub()


def _runner():
    """What ReplyStream reads of its runner: its facts (byte counts), the notes it keeps, and a
    reply side that expects no head (no commitments)."""
    reply = types.SimpleNamespace(expects_head=lambda reducer_index: False)
    return types.SimpleNamespace(facts=ButterflyFacts(), notes={}, checks=types.SimpleNamespace(reply=reply))


def _collect(stub, expected: int, runner) -> list:
    async def go():
        stream = await ReplyStream(stub, runner, expected).rpc_aggregate_part(None)
        return [m async for m in stream]

    return asyncio.run(asyncio.wait_for(go(), timeout=30))


def test_the_sender_closes_after_its_last_expected_part():
    closed, runner = [], _runner()
    got = _collect(_reducer(5, then_wait=True, closed=closed), 5, runner)
    assert [m.tensor_part == _reply(i).tensor_part for i, m in enumerate(got)] == [True] * 5
    assert closed == [True]  # our end of the stream is closed, not left to the reducer
    assert runner.facts.bytes_received == sum(m.ByteSize() for m in got)
    assert len(runner.notes) == 5  # each part's note is kept for its check


def test_a_short_reply_stream_still_ends_short():
    # A reducer that stops early is not waited for: hivemind's part count then fails it.
    closed, runner = [], _runner()
    got = _collect(_reducer(3, then_wait=False, closed=closed), 5, runner)
    assert len(got) == 3 and closed == [True]


def test_error_replies_are_passed_on_and_not_counted_as_parts():
    async def replies():
        yield averaging_pb2.AveragingData(code=averaging_pb2.INTERNAL_ERROR)

    class Stub:
        async def rpc_aggregate_part(self, inputs):
            return replies()

    got = _collect(Stub(), 1, _runner())
    assert [m.code for m in got] == [averaging_pb2.INTERNAL_ERROR]
