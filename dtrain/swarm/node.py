"""Peer identity and discovery: one hivemind DHT per process, with a persistent key.

The peer id survives restarts (the key lives in ``<data_dir>/p2p_identity.key``); bootstrap
comes only from the caller's ``initial_peers``; a node that reaches nobody starts isolated and
``ensure_connected`` retries with backoff; every call into the DHT process is bounded
(:meth:`SwarmNode.call`), because hivemind's own ``run_coroutine`` waits for ever on a dead
process. docs/swarm.md ("Identity and discovery") has the details.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

logger = logging.getLogger(__name__)

IDENTITY_FILENAME = "p2p_identity.key"

# How long one call into the DHT process may take before the node counts as not answering.
# A routing-table read answers in milliseconds, on a loaded 2-core host in well under a second.
DHT_CALL_TIMEOUT_S = 10.0
# How often a bounded wait looks at whether the DHT process is still alive: a dead one is
# noticed within this, not after the whole timeout.
_ALIVE_POLL_S = 0.5


class NoPeersReachable(ConnectionError):
    """None of the initial peers answered within the caller's deadline."""


class SwarmUnavailable(RuntimeError):
    """The DHT process died, or did not answer a call within its time."""


@dataclass
class SwarmNodeConfig:
    """How a node joins the swarm (``dtrain.config.NodeConfig`` is the neuron's [node] table, another thing)."""

    data_dir: str  # where the identity key is kept (created if missing)
    initial_peers: Sequence[str] = ()  # full multiaddrs incl. /p2p/<peer id>
    host_maddrs: Sequence[str] = ("/ip4/0.0.0.0/tcp/0",)
    announce_maddrs: Sequence[str] = ()
    client_mode: bool = False  # True behind NAT without port forwarding (cannot reduce parts for others)
    bootstrap_timeout_s: float = 10.0  # per attempt
    retry_initial_s: float = 1.0
    retry_max_s: float = 60.0
    extra_dht_kwargs: dict = field(default_factory=dict)

    @property
    def identity_path(self) -> str:
        return os.path.join(self.data_dir, IDENTITY_FILENAME)


def _peer_id_of(maddr: str) -> Optional[str]:
    parts = maddr.rstrip("/").split("/")
    for i, part in enumerate(parts[:-1]):
        if part in ("p2p", "ipfs"):
            return parts[i + 1]
    return None


async def _count_peers(_dht, node) -> int:
    return len(node.protocol.routing_table.uid_to_peer_id)


async def _visible_maddrs(_dht, node) -> list[str]:
    return [str(m) for m in await node.get_visible_maddrs()]


async def _own_peer_id(_dht, node) -> str:
    return str(node.peer_id)


async def _ping_all(maddrs: Sequence[str], timeout: float, _dht, node) -> int:
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    from dtrain.swarm.hivemind_internals import dial

    async def one(maddr: str) -> bool:
        peer_id = _peer_id_of(maddr)
        peer = PeerID.from_base58(peer_id)
        # p2pd's connect takes the peer id and its *transport* addresses: a multiaddr that
        # still ends in /p2p/<id> is refused ("length greater than remaining number of bytes").
        transport = Multiaddr(maddr).decapsulate(Multiaddr(f"/p2p/{peer_id}"))
        try:
            # p2pd forgets addresses it failed to dial at startup; re-dial explicitly.
            await dial(node, peer_id, transport, timeout)
            return (await asyncio.wait_for(node.protocol.call_ping(peer), timeout)) is not None
        except Exception as exc:  # unreachable: counted as a miss, retried later
            logger.debug("swarm: dial %s failed: %r", maddr, exc)
            return False

    results = await asyncio.gather(*(one(m) for m in maddrs))
    answered = sum(bool(r) for r in results)
    if answered:
        # like DHTNode's own bootstrap: look ourselves up to fill the routing table beyond the pinged peers
        try:
            await asyncio.wait_for(node.find_nearest_nodes([node.node_id]), timeout)
        except Exception as exc:
            logger.debug("swarm: self-lookup after bootstrap failed: %r", exc)
    return answered


async def _ping_peer_ids(peer_ids: Sequence[str], timeout: float, _dht, node) -> dict:
    from hivemind.p2p import PeerID

    async def one(pid: str) -> bool:
        try:
            return (await asyncio.wait_for(node.protocol.call_ping(PeerID.from_base58(pid)), timeout)) is not None
        except Exception:
            return False

    results = await asyncio.gather(*(one(p) for p in peer_ids))
    return dict(zip(peer_ids, results))


def reachable(dht, peer_ids: Sequence[str], timeout_s: float = 3.0) -> dict[str, bool]:
    """Which of ``peer_ids`` answer a DHT ping from ``dht`` within ``timeout_s`` (all False when the
    DHT process cannot ask: a dead one never answers, so the wait is bounded)."""
    try:
        future = dht.run_coroutine(functools.partial(_ping_peer_ids, list(peer_ids), timeout_s), return_future=True)
        return future.result(timeout=timeout_s + 5.0)
    except Exception:
        return {p: False for p in peer_ids}


class SwarmNode:
    """A running hivemind DHT with a persistent identity. Use as a context manager or call shutdown()."""

    def __init__(self, config: SwarmNodeConfig):
        self.config = config
        self.dht = None
        self._lock = threading.Lock()
        self._peer_id: Optional[str] = None
        self._daemon_pid: Optional[int] = None
        self.last_maddrs: list[str] = []  # where it listened when it started (kept after it died)

    # -- lifecycle -------------------------------------------------------
    def start(self) -> "SwarmNode":
        from dtrain.swarm.hivemind_internals import DHTProcess
        from dtrain.swarm.startup import START_TIMEOUT_S

        os.makedirs(self.config.data_dir, exist_ok=True)
        for maddr in self.config.initial_peers:
            if _peer_id_of(maddr) is None:
                raise ValueError(f"initial peer {maddr!r} has no /p2p/<peer id> component")
        kwargs = dict(
            initial_peers=list(self.config.initial_peers),
            host_maddrs=list(self.config.host_maddrs),
            identity_path=self.config.identity_path,
            client_mode=self.config.client_mode,
            # never crash at startup because the swarm is down; ensure_connected() retries instead
            ensure_bootstrap_success=False,
            bootstrap_timeout=self.config.bootstrap_timeout_s,
            start=True,
            start_timeout_s=START_TIMEOUT_S + self.config.bootstrap_timeout_s,  # p2pd start + bootstrap
        )
        if self.config.announce_maddrs:
            kwargs["announce_maddrs"] = list(self.config.announce_maddrs)
        kwargs.update(self.config.extra_dht_kwargs)
        try:
            self.dht = DHTProcess(**kwargs)
        except Exception as exc:
            # p2pd itself refuses to start when no bootstrap peer accepts a connection
            # ("failed to connect to bootstrap peers"). Start isolated instead and let
            # ensure_connected() dial the initial peers again with backoff.
            if not kwargs["initial_peers"] or "bootstrap" not in str(exc):
                raise
            logger.warning(
                "swarm: could not connect to any of %d initial peers (%s); starting isolated, will retry",
                len(kwargs["initial_peers"]),
                exc,
            )
            kwargs["initial_peers"] = []
            self.dht = DHTProcess(**kwargs)
        from dtrain.swarm.hivemind_internals import daemon_pid

        # Read once while the process answers: both are needed after it died (status pages
        # name the peer id; a restart must stop the orphaned p2pd).
        self._peer_id = self.call(_own_peer_id)
        self._daemon_pid = self.call(daemon_pid)
        self.last_maddrs = self.visible_maddrs()
        if self.config.initial_peers and self.num_known_peers() == 0:
            logger.warning(
                "swarm: none of %d initial peers answered; running alone and retrying in the background of "
                "ensure_connected()",
                len(self.config.initial_peers),
            )
        return self

    def shutdown(self) -> None:
        with self._lock:
            if self.dht is not None:
                try:
                    died = not self.dht.is_alive()
                    self.dht.shutdown()
                    if died:
                        # hivemind stops p2pd from inside the DHT process; a killed process
                        # left it running (it outlives its clients for a while).
                        stop_orphaned_daemon(self._daemon_pid)
                finally:
                    self.dht = None

    def __enter__(self) -> "SwarmNode":
        return self.start() if self.dht is None else self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # -- facts -----------------------------------------------------------
    @property
    def peer_id(self) -> str:
        """This node's peer id (kept after shutdown: it is the identity key's, and a restarted
        node has the same one)."""
        if self._peer_id is None:
            self._require()
        return str(self._peer_id)

    def visible_maddrs(self) -> list[str]:
        return list(self.call(_visible_maddrs))

    def num_known_peers(self) -> int:
        """Peers in the DHT routing table (0 = isolated)."""
        return int(self.call(_count_peers))

    # -- bounded calls and health ------------------------------------------
    def call(self, fn, timeout_s: float = DHT_CALL_TIMEOUT_S):
        """``dht.run_coroutine(fn)``, but raise :class:`SwarmUnavailable` when the DHT process
        is dead, dies while we wait, or has not answered within ``timeout_s``.

        ``fn`` is pickled into the DHT process: a module-level function (or a partial of one).
        """
        dht = self._require()
        if not dht.is_alive():
            raise SwarmUnavailable(_exited(dht))
        future = dht.run_coroutine(fn, return_future=True)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return future.result(timeout=max(0.0, min(_ALIVE_POLL_S, deadline - time.monotonic())))
            except TimeoutError:
                if future.done():
                    raise  # the coroutine's own outcome was a timeout
            if not dht.is_alive():
                future.cancel()
                raise SwarmUnavailable(_exited(dht))
            if time.monotonic() >= deadline:
                future.cancel()  # the DHT process drops it if it ever gets to it
                raise SwarmUnavailable(f"the DHT process did not answer within {timeout_s:g} s")

    def alive(self) -> bool:
        """Whether the DHT process runs (it may still not answer: see :meth:`problem`)."""
        dht = self.dht
        return dht is not None and dht.is_alive()

    def problem(self, timeout_s: float = DHT_CALL_TIMEOUT_S) -> Optional[str]:
        """Why this node cannot serve the swarm (its DHT process died or does not answer), or None."""
        if self.dht is None:
            return "the swarm node is not running"
        try:
            self.call(_count_peers, timeout_s)
        except SwarmUnavailable as exc:
            return str(exc)
        return None

    # -- bootstrap retry ---------------------------------------------------
    def try_bootstrap_once(self) -> int:
        """Dial and ping every initial peer once; returns how many answered."""
        maddrs = list(self.config.initial_peers)
        if not maddrs:
            return 0
        timeout = self.config.bootstrap_timeout_s

        # each dial and ping has its own timeout; the margin covers the self-lookup after them
        return int(self.call(functools.partial(_ping_all, maddrs, timeout), 3 * timeout + DHT_CALL_TIMEOUT_S))

    def ensure_connected(
        self,
        timeout_s: Optional[float] = None,
        stop: Optional[threading.Event] = None,
        on_retry: Optional[Callable[[int, float], None]] = None,
    ) -> int:
        """Block until at least one peer is known, retrying with exponential backoff.

        Returns the number of known peers. With no initial peers (first node of a swarm)
        returns immediately. Raises NoPeersReachable after ``timeout_s`` (None = forever,
        until ``stop`` is set, in which case the current count is returned).
        """
        if not self.config.initial_peers:
            return self.num_known_peers()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        delay = self.config.retry_initial_s
        attempt = 0
        while True:
            known = self.num_known_peers()
            if known > 0:
                return known
            attempt += 1
            answered = self.try_bootstrap_once()
            if answered > 0:
                return max(self.num_known_peers(), answered)
            logger.warning(
                "swarm: no initial peer reachable (attempt %d, %d peers tried); retrying in %.1fs",
                attempt,
                len(self.config.initial_peers),
                delay,
            )
            if on_retry is not None:
                on_retry(attempt, delay)
            if deadline is not None and time.monotonic() + delay > deadline:
                raise NoPeersReachable(
                    f"none of {len(self.config.initial_peers)} initial peers reachable after {attempt} attempts"
                )
            if stop is not None:
                if stop.wait(delay):
                    return self.num_known_peers()
            else:
                time.sleep(delay)
            delay = min(delay * 2, self.config.retry_max_s)

    def _require(self):
        if self.dht is None:
            raise RuntimeError("SwarmNode is not started")
        return self.dht


def _exited(process) -> str:
    code = process.exitcode
    how = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 and -code in \
        signal.valid_signals() else f"exit code {code}"
    return f"the DHT process is not running ({how})"


KILLED_EXIT_WAIT_S = 15.0  # how long a SIGKILLed p2pd may take to be gone


def stop_orphaned_daemon(pid: Optional[int], grace_s: float = 3.0) -> bool:
    """Stop the p2pd daemon ``pid`` if it still runs (SIGTERM, then SIGKILL); True if one was stopped.

    Only a process whose command line names p2pd is signalled: after a crash its pid may
    have been given to something else.
    """
    if not pid:
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            if b"p2pd" not in fh.read():
                return False
    except OSError:
        return False  # gone already (or no /proc: nothing we can check, so nothing we kill)
    logger.warning("swarm: stopping p2pd (pid %d) left behind by the dead DHT process", pid)
    # a killed process still takes a moment to go on a loaded machine: wait longer after SIGKILL
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, max(grace_s, KILLED_EXIT_WAIT_S))):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return True
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if not os.path.exists(f"/proc/{pid}") or _is_zombie(pid):
                return True
            time.sleep(0.05)
    return True


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):
        return True
