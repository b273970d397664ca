"""Helpers to run several real swarm peers on one machine (tests, sandbox, benchmarks).

Nothing here fakes hivemind: every peer is a real DHT (own p2pd) on loopback.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from typing import Callable, Iterator, Optional, Sequence

from dtrain.swarm.node import NodeConfig, SwarmNode

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
            NodeConfig(data_dir=os.path.join(tmp, "n0"), host_maddrs=LOOPBACK, extra_dht_kwargs=dict(LOCAL_ONLY))
        ).start()
        nodes.append(first)
        if on_started is not None:
            on_started(0)
        boot = first.visible_maddrs()
        for i in range(1, n):
            nodes.append(
                SwarmNode(
                    NodeConfig(data_dir=os.path.join(tmp, f"n{i}"), host_maddrs=LOOPBACK, initial_peers=boot,
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


class PeerProcess:
    """A swarm peer in its own process group (``python -m dtrain.swarm._peer``), killable as a whole.

    SIGKILL goes to the process group so the peer's averager process and p2pd die with it
    (no orphans), which is what a crashed host looks like to the others.
    """

    def __init__(self, args: Sequence[str], env: Optional[dict] = None):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dtrain.swarm._peer", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )

    def wait_for_line(self, prefix: str, timeout_s: float = 60.0) -> str:
        """Read stdout until a line starting with ``prefix`` (raises TimeoutError / EOFError)."""
        result: list = []

        def reader() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                if line.startswith(prefix):
                    result.append(line.strip())
                    return

        t = threading.Thread(target=reader, daemon=True)
        t.start()
        t.join(timeout_s)
        if not result:
            if self.proc.poll() is not None:
                raise EOFError(f"peer exited with {self.proc.returncode} before printing {prefix!r}")
            raise TimeoutError(f"peer did not print {prefix!r} within {timeout_s}s")
        return result[0]

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            self.proc.wait(10)
        # the group may outlive the leader for a moment (p2pd); make sure it is gone
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def terminate(self, timeout_s: float = 15.0) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        self.kill()
