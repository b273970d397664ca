"""hivemind's DHT and averager processes survive a request whose sender went away.

A request written into one of those processes' command pipes carries an MPFuture, which
carries its sender's reply pipe. Unpickling it fetches that descriptor from the sender through
multiprocessing's resource sharer. When the sender exits during that hand-over (an averager
shut down right after a DHT store), the reader gets EOFError. hivemind's loop did not survive
it: the DHT process died, and every later request to it, each averager start on that node
included, waited forever (dtrain/swarm/command_pipe.py).

The requests here are what such a sender leaves behind: a real descriptor hand-over, to a
real socket whose owner hangs up after accepting, as an exiting process does.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from multiprocessing import connection, resource_sharer

import pytest
import torch

from dtrain.swarm.averaging.averager import SwarmAverager, matchmaking_key
from dtrain.swarm.command_pipe import CommandPipe
from dtrain.swarm.hivemind_internals import AveragerProcess, DHTProcess

pytestmark = pytest.mark.slow

LOOP = ["/ip4/127.0.0.1/tcp/0"]


@contextlib.contextmanager
def hanging_up_sender(tmp_path):
    """A resource-sharer address whose owner accepts each connection and closes it at once."""
    path = str(tmp_path / "sharer.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(8)
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return
            conn.close()  # mid-handshake, like a process that exits

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield path
    finally:
        stop.set()
        server.close()
        os.unlink(path)


class ReplyPipeOfAGoneSender:
    """Pickles exactly as a Connection handed over by the resource sharer (an MPFuture's reply pipe)."""

    def __init__(self, address: str):
        self.address = address

    def __reduce__(self):
        handle = resource_sharer.DupFd.__new__(resource_sharer.DupFd)
        handle._id = (self.address, 1)
        return connection.rebuild_connection, (handle, True, True)


async def _answer(_dht, _node):
    return 42


def test_unpickling_such_a_request_raises_eoferror(tmp_path):
    # The premise: what hivemind's loop did not catch.
    import pickle

    with hanging_up_sender(tmp_path) as address:
        with pytest.raises(EOFError):
            pickle.loads(pickle.dumps(ReplyPipeOfAGoneSender(address)))


def test_the_pipe_drops_only_that_request(tmp_path):
    reader, writer = connection.Pipe(duplex=False)
    pipe = CommandPipe(reader)
    with hanging_up_sender(tmp_path) as address:
        writer.send(("_store", [], dict(future=ReplyPipeOfAGoneSender(address))))
        writer.send(("_get", [], dict(key="k")))
        method, args, _ = pipe.recv()
        assert method == "_dtrain_dropped_request" and args[0].startswith("EOFError")
        assert pipe.recv() == ("_get", [], dict(key="k"))  # framing intact
    writer.close()
    with pytest.raises(EOFError):  # a closed pipe is still the end of the loop
        pipe.recv()


def test_a_dht_survives_a_request_whose_sender_hung_up(tmp_path):
    dht = DHTProcess(start=True, host_maddrs=LOOP)
    try:
        with hanging_up_sender(tmp_path) as address:
            dht._outer_pipe.send(("_run_coroutine", [], dict(coro=_answer, future=ReplyPipeOfAGoneSender(address))))
            assert dht.run_coroutine(_answer, return_future=True).result(timeout=30) == 42
        assert dht.is_alive()
    finally:
        dht.shutdown()


def test_an_averager_survives_a_request_whose_sender_hung_up(tmp_path):
    dht = DHTProcess(start=True, host_maddrs=LOOP)
    averager = AveragerProcess([torch.zeros(4)], dht, handler=SwarmAverager(), matchmaking_key=matchmaking_key("pipe"),
                               start=True, prefix="pipe", target_group_size=2)
    try:
        with hanging_up_sender(tmp_path) as address:
            averager._outer_pipe.send(("_get_group_bits", [], dict(future=ReplyPipeOfAGoneSender(address))))
            assert isinstance(averager.get_group_bits(wait=False).result(timeout=30), str)
        assert averager.is_alive()
    finally:
        averager.shutdown()
        dht.shutdown()
