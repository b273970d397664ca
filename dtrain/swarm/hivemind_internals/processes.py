"""hivemind's background processes: the DHT, a command pipe that survives a dead sender, and
the two DHT-side tricks dtrain needs (re-dialling a peer, leaving the matchmaking queue promptly)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import threading
from typing import Optional

import hivemind
from hivemind.p2p import PeerID
from hivemind.utils.multiaddr import Multiaddr

from dtrain.swarm import startup
from dtrain.swarm.command_pipe import DROPPED_REQUEST, CommandPipe

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def heap_frozen_for_fork():
    """Around the fork of a hivemind process: the child inherits the parent's heap as frozen.

    hivemind's DHT and averager are forked from the neuron and inherit its whole heap (torch,
    transformers, the model: over 200k objects). A full collection in the child walks and
    writes every one of them: it copies the pages it touches out of the memory shared with the
    neuron and takes hundreds of milliseconds (270-690 ms measured in an averager on a loaded
    2-core host). And because they count toward the oldest generation, the child ran full
    collections only rarely (collect_garbage_of_last_round says what that cost). Frozen, they
    are never scanned in the child. The parent unfreezes at once, so nothing changes for the
    neuron's own collector.
    (Python's documentation of gc.freeze recommends exactly this for fork without exec.)
    """
    with _FORK_LOCK:  # two starts at once: one's unfreeze must not come before the other's fork
        gc.freeze()
        try:
            yield
        finally:
            gc.unfreeze()


_FORK_LOCK = threading.Lock()


def collect_garbage_of_last_round() -> None:
    """In a forked hivemind process, between rounds: free what the last round left in cycles.

    Each round leaves about 170 objects in reference cycles in the averager: the frames of
    hivemind's stream handlers (rpc_aggregate_part, p2p_daemon's _process_stream), held by the
    tracebacks of the exceptions that end a stream (IncompleteReadError, CancelledError,
    StopAsyncIteration), and with them the part tensors those frames still referenced. The
    frames lived through the round, so they were in the oldest generation when they became
    garbage, and Python collects that generation only once the objects added since the last
    full collection reach a quarter of it: with the neuron's 210k inherited objects, about
    every 300 rounds. Until then the averager's memory grew by a few parts a round.
    heap_frozen_for_fork takes the inherited objects out of that count, which lets Python's
    own collector run often again; collecting here as well makes the bound exact (at most one
    round's worth is ever held) and costs under a millisecond, since only the process's own
    objects are scanned.
    """
    gc.collect()


class ServesCommandPipe:
    """For hivemind's DHT and averager processes: call ``_use_command_pipe()`` first in ``run()``
    (why: dtrain/swarm/command_pipe.py)."""

    def _use_command_pipe(self) -> None:
        self._inner_pipe = CommandPipe(self._inner_pipe)

    async def _dtrain_dropped_request(self, reason: str) -> None:  # the DROPPED_REQUEST method
        logger.warning("swarm: dropped a request that could not be read (its sender likely exited): %s", reason)


assert DROPPED_REQUEST == ServesCommandPipe._dtrain_dropped_request.__name__


class DHTProcess(ServesCommandPipe, hivemind.DHT):
    """A hivemind DHT that survives a request whose sender went away, and whose parent notices
    a child that died or hung before it was ready (dtrain/swarm/command_pipe.py, startup.py)."""

    def __init__(self, *args, start_timeout_s: float = startup.START_TIMEOUT_S, **kwargs):
        self._start_timeout_s = start_timeout_s  # read by run_in_background, which __init__ calls
        super().__init__(*args, **kwargs)

    def run(self) -> None:
        startup.enable_stack_dumps()
        self._use_command_pipe()
        super().run()

    def run_in_background(self, await_ready: bool = True, timeout: Optional[float] = None) -> None:
        with heap_frozen_for_fork():
            self.start()
        if await_ready:
            startup.await_ready(self, self.wait_until_ready, "DHT",
                                self._start_timeout_s if timeout is None else timeout)


async def daemon_pid(_dht, node) -> Optional[int]:
    """The pid of the p2pd daemon a DHT process started (run through ``dht.run_coroutine``).

    When the DHT process is killed, its p2pd lives on: hivemind's averager holds a client of
    the same daemon, and p2pd only exits after its clients were idle for a while. A node that
    restarts itself must stop that orphan first, or the new daemon cannot take a fixed port.
    """
    child = getattr(node.p2p, "_child", None)
    return None if child is None else int(child.pid)


async def dial(node, peer_id: str, transport, timeout: float) -> None:
    """Make the p2pd of a DHT node (the ``node`` of ``dht.run_coroutine``) connect to a peer.

    ``transport`` is the address without its /p2p/<id> part: p2pd's connect takes the two apart
    and refuses a multiaddr that still ends in /p2p/<id>. P2P has no public connect(); p2pd
    forgets addresses it failed to dial at startup, so callers re-dial with this.
    """
    address = Multiaddr(transport) if isinstance(transport, str) else transport
    await asyncio.wait_for(node.p2p._client.connect(PeerID.from_base58(peer_id), [address]), timeout)


def undeclare_in_background(key_manager) -> None:
    """Make a peer's "no longer looking for a group" DHT store fire and forget.

    hivemind's leader, once its group is assembled, cancels its own search, and the search's
    cleanup *awaits* that DHT store before the leader may start the all-reduce. The followers
    start at once and fill the links, so the store (a DHT round trip under load) held the
    leader back 0.7-2.8 s at 8 peers on 25 Mbit links while every reducer waited for its
    parts. Nothing depends on the store's reply: it is written with the declaration's own
    expiration (nudged up), so a store that lands after the next round's declaration (a
    later expiration) is overridden by it.
    """
    if getattr(key_manager, "_dtrain_prompt", False):
        return
    declare = key_manager.declare_averager
    pending: set = set()

    async def declare_averager(group_key, peer_id, expiration_time, looking_for_group: bool = True) -> bool:
        if looking_for_group:
            return await declare(group_key, peer_id, expiration_time, looking_for_group)
        task = asyncio.get_event_loop().create_task(declare(group_key, peer_id, expiration_time, False))
        pending.add(task)  # keep a reference until it finishes, or asyncio may collect it
        task.add_done_callback(lambda t: (pending.discard(t), t.cancelled() or t.exception()))
        return True

    key_manager.declare_averager = declare_averager
    key_manager._dtrain_prompt = True
