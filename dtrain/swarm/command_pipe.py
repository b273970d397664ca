"""The command pipe of hivemind's DHT and averager processes, made safe to read.

Two rules hivemind's own reading breaks (docs/swarm.md, "The DHT and averager processes"): a
request whose sender went away (its reply pipe can no longer be unpickled) is dropped, never the
end of the process's loop; and a message is read whole, in blocking mode once data is there,
since a large one (a step with a work commitment) arrives in several writes.
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
