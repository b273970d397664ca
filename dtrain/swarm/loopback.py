"""Several real swarm peers on one machine (``benchmark-bandwidth --local-peers``, benchmarks, tests).

Nothing here fakes hivemind: every peer is a real DHT (own p2pd) on loopback. Fault injection
and killable peer processes are test helpers, in tests/ (faults.py, peer_process.py).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
from typing import Callable, Iterator, Optional, Sequence

from dtrain.swarm.node import SwarmNode, SwarmNodeConfig

LOOPBACK = ("/ip4/127.0.0.1/tcp/0",)
# Local peers need no NAT traversal; UPnP/NAT-PMP discovery would probe the host's LAN gateway.
LOCAL_ONLY = dict(nat_port_map=False)


@contextlib.contextmanager
def local_nodes(n: int, root: Optional[str] = None,
                on_started: Optional[Callable[[int], None]] = None) -> Iterator[list[SwarmNode]]:
    """Start ``n`` DHT nodes on loopback, the first being the bootstrap of the rest; always shut down.

    ``on_started(i)`` is called after node ``i`` is up (progress displays).
    """
    tmp = root or tempfile.mkdtemp(prefix="dtrain-swarm-")
    nodes: list[SwarmNode] = []
    try:
        first = SwarmNode(
            SwarmNodeConfig(data_dir=os.path.join(tmp, "n0"), host_maddrs=LOOPBACK, extra_dht_kwargs=dict(LOCAL_ONLY))
        ).start()
        nodes.append(first)
        if on_started is not None:
            on_started(0)
        boot = first.visible_maddrs()
        for i in range(1, n):
            nodes.append(
                SwarmNode(
                    SwarmNodeConfig(data_dir=os.path.join(tmp, f"n{i}"), host_maddrs=LOOPBACK, initial_peers=boot,
                               extra_dht_kwargs=dict(LOCAL_ONLY))
                ).start()
            )
            if on_started is not None:
                on_started(i)
        yield nodes
    finally:
        for node in nodes:
            with contextlib.suppress(Exception):
                node.shutdown()
        if root is None:
            shutil.rmtree(tmp, ignore_errors=True)


def run_concurrently(fns: Sequence[Callable[[], object]], timeout_s: float = 120.0) -> list:
    """Run callables in threads (as separate peers would run), return their results in order.

    Re-raises the first exception. Threads are daemons so a hang cannot block interpreter exit.
    """
    results: list = [None] * len(fns)
    errors: list = [None] * len(fns)

    def call(i: int) -> None:
        try:
            results[i] = fns[i]()
        except BaseException as e:  # surfaced to the caller below
            errors[i] = e

    threads = [threading.Thread(target=call, args=(i,), daemon=True) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    if any(t.is_alive() for t in threads):
        raise TimeoutError("a peer did not finish in time")
    for e in errors:
        if e is not None:
            raise e
    return results
