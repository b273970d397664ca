"""A standalone swarm peer for fault tests (``python -m dtrain.swarm._peer``); see testing.PeerProcess.

Joins the DHT, fills one tensor with ``--value``, runs one round and prints:
``PEER <peer id>`` once the averager is up, ``RUNNING`` when the butterfly starts, ``DONE <json>``.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time

import torch


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
    ap.add_argument("--host-maddr", default="/ip4/127.0.0.1/tcp/0")
    args = ap.parse_args(argv)
    # SIGTERM -> normal exit so finally-blocks shut the DHT and p2pd down
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))

    from hivemind.averaging.control import AveragingStage

    from dtrain.swarm.averaging import AveragingConfig, FaultInjection, GradientSwarm
    from dtrain.swarm.node import NodeConfig, SwarmNode

    node = SwarmNode(
        NodeConfig(data_dir=tempfile.mkdtemp(prefix="dtrain-peer-"), host_maddrs=[args.host_maddr],
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
        )
        tensor = torch.full((args.numel,), args.value)
        fault = FaultInjection(send_delay_s=args.send_delay) if args.send_delay else None
        swarm = GradientSwarm(node.dht, [tensor], args.fingerprint, cfg, fault=fault)
        print(f"PEER {node.peer_id}", flush=True)
        # poll the averager's stage in a side thread so RUNNING is printed while the round runs
        import threading

        def watch():
            while True:
                if swarm.stage == AveragingStage.RUNNING_ALLREDUCE.name:
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
