"""A standalone swarm peer for fault tests (``python -m tests.peer_process``), and PeerProcess to run it.

The peer joins the DHT, fills one tensor with ``--value``, runs one round and prints:
``PEER <peer id>`` once the averager is up, ``RUNNING`` when the butterfly starts, ``DONE <json>``.
PeerProcess runs it in its own process group, so SIGKILL takes its averager and p2pd down too:
what a crashed host looks like to the others.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional, Sequence

REPO = Path(__file__).resolve().parent.parent


class PeerProcess:
    """A swarm peer in its own process group (``python -m tests.peer_process``), killable as a whole."""

    def __init__(self, args: Sequence[str], env: Optional[dict] = None):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.peer_process", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
            cwd=str(REPO),  # `tests` is a package of the repository, not of an installed dtrain
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--initial-peer", action="append", default=[])
    ap.add_argument("--prefix", required=True)
    ap.add_argument("--numel", type=int, default=100_000)
    ap.add_argument("--value", type=float, default=0.0)
    ap.add_argument("--weight", type=float, default=1.0)
    ap.add_argument("--cap", type=float, default=1.0)
    ap.add_argument("--fingerprint", default="fp")
    ap.add_argument("--group-size", type=int, default=2)
    ap.add_argument("--part-size-bytes", type=int, default=2**16)
    ap.add_argument("--sender-timeout", type=float, default=5.0)
    ap.add_argument("--send-delay", type=float, default=0.0)
    ap.add_argument("--matchmaking-time", type=float, default=2.0)
    ap.add_argument("--aggregation", default="mean", choices=("mean", "centered_clip"))
    ap.add_argument("--host-maddr", default="/ip4/127.0.0.1/tcp/0")
    args = ap.parse_args(argv)
    # SIGTERM -> normal exit so finally-blocks shut the DHT and p2pd down
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))

    import torch

    from dtrain.swarm.averaging import AveragingConfig
    from dtrain.swarm.node import SwarmNode, SwarmNodeConfig
    from tests.faults import FaultInjection
    from tests.faults import swarm as make_swarm

    node = SwarmNode(
        SwarmNodeConfig(data_dir=tempfile.mkdtemp(prefix="dtrain-peer-"), host_maddrs=[args.host_maddr],
                        initial_peers=args.initial_peer, extra_dht_kwargs=dict(nat_port_map=False))
    ).start()
    swarm = None
    try:
        cfg = AveragingConfig(
            prefix=args.prefix,
            min_group_size=args.group_size,
            target_group_size=args.group_size,
            min_matchmaking_time_s=args.matchmaking_time,
            request_timeout_s=args.matchmaking_time / 2,  # below it, or matchmaking can deadlock
            sender_timeout_s=args.sender_timeout,
            part_size_bytes=args.part_size_bytes,
            matchmaking_timeout_s=60,
            allreduce_timeout_s=120,
            aggregation=args.aggregation,
        )
        tensor = torch.full((args.numel,), args.value)
        fault = FaultInjection(send_delay_s=args.send_delay) if args.send_delay else None
        swarm = make_swarm(node.dht, [tensor], args.fingerprint, cfg, fault=fault)
        print(f"PEER {node.peer_id}", flush=True)

        def watch():  # print RUNNING from a side thread while the round runs
            while True:
                if swarm.stage == "RUNNING_ALLREDUCE":
                    print("RUNNING", flush=True)
                    return
                time.sleep(0.01)

        threading.Thread(target=watch, daemon=True).start()
        rec = swarm.run_round([tensor], weight=args.weight, cap=args.cap)
        print("DONE " + json.dumps(rec.to_dict()), flush=True)
        return 0
    finally:
        if swarm is not None:
            swarm.shutdown()
        node.shutdown()


if __name__ == "__main__":
    raise SystemExit(main())
