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
from dtrain.swarm.memory_pages import note_private_tensors, release_inherited_tensors
from dtrain.swarm.command_pipe import DROPPED_REQUEST, CommandPipe

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def heap_frozen_for_fork():
    """Around the fork of a hivemind process: the child inherits the parent's heap frozen, so the
    child's collector never walks (and copies) the neuron's objects, and still runs often
    (docs/swarm.md, "The DHT and averager processes"). The parent unfreezes at once. The
    neuron's large tensors are noted for the child to drop (dtrain.swarm.memory_pages.py)."""
    with _FORK_LOCK:  # two starts at once: one's unfreeze must not come before the other's fork
        note_private_tensors()
        gc.freeze()
        try:
            yield
        finally:
            gc.unfreeze()


_FORK_LOCK = threading.Lock()


def collect_garbage_of_last_round() -> None:
    """In a forked hivemind process, between rounds: free what the last round left in reference
    cycles (hivemind's stream-handler frames and the parts they hold), so at most one round's
    garbage is ever held (docs/swarm.md, "The DHT and averager processes")."""
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
        release_inherited_tensors()
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
    """Make a peer's "no longer looking for a group" DHT store fire and forget: a leader must not
    wait a DHT round trip before its butterfly while its followers already fill the links
    (docs/swarm.md, "Measured"). Nothing depends on the store's reply, and a late one is
    overridden by the next round's declaration (a later expiration)."""
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
