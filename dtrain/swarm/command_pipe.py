"""The command pipe of hivemind's DHT and averager processes, made safe to read.

Each of those processes serves requests that its parent (and, for the DHT, every averager
forked from that parent) writes into one pipe. hivemind's loop reads them with ``recv()`` and
survives only OSError, ConnectionError and RuntimeError. Two things break it:

- **A request whose sender went away.** A request carries an MPFuture, and the future carries
  the sender's reply pipe. Unpickling it fetches that descriptor from the sender's process
  through multiprocessing's resource sharer, a socket handshake. When the sender exits in
  the middle (an averager shut down right after a DHT store, as a neuron does when it
  stops mid-round), the handshake ends with EOFError. That ended the DHT's loop, and the DHT
  process with it; every later request to it, including each new averager's start on that
  node, then waited forever. It is not an error of the process reading the pipe: the
  request is dropped (its sender no longer wants the answer), and the loop goes on.
- **A message read in pieces.** hivemind polls the pipe from its event loop, which makes the
  descriptor non-blocking, and calls ``recv()`` as soon as *some* bytes are readable. A
  message larger than what one write delivers at once (an averager step whose gather carries
  a work commitment: tens of KB) then fails half-read with EAGAIN and the stream loses its
  framing. Reading in blocking mode once data is there always gets the whole message: the
  sender writes it in one go.
"""

from __future__ import annotations

import os
from multiprocessing.reduction import ForkingPickler

# What recv() returns in place of a request that could not be unpickled: a call of this method
# on the process object (defined by the wall's ServesCommandPipe, dtrain/swarm/hivemind_internals/,
# which also swaps hivemind's pipe for a CommandPipe). Both processes dispatch
# ``getattr(self, method)(*args, **kwargs)``.
DROPPED_REQUEST = "_dtrain_dropped_request"


class CommandPipe:
    """Wraps a multiprocessing Connection: whole messages, and bad requests dropped, not fatal."""

    def __init__(self, conn):
        self._conn = conn

    def recv(self):
        fd = self._conn.fileno()
        was_blocking = os.get_blocking(fd)
        os.set_blocking(fd, True)
        try:
            # A closed or broken pipe still raises here, as it did: then the parent is gone.
            payload = self._conn.recv_bytes()
        finally:
            os.set_blocking(fd, was_blocking)
        try:
            return ForkingPickler.loads(payload)
        except Exception as exc:  # the framing is intact: only this one request is lost
            return DROPPED_REQUEST, [f"{type(exc).__name__}: {exc}"], {}

    def __getattr__(self, name):
        return getattr(self._conn, name)
