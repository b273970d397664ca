"""Engine of ``dtrain benchmark-bandwidth`` (the CLI shell lives in dtrain.cli).

``run_local`` averages float32 among N real loopback peers and checks the exact mean;
``run_real`` joins the swarm, pings the known peers and runs one round on a benchmark prefix
(never a training one). Both return a JSON-able dict and take ``progress(stage, fraction)``.
The figures (``algbw``, ``busbw`` as NCCL reports it, the link bound): docs/swarm.md,
"``benchmark-bandwidth`` engine".
"""

from __future__ import annotations

import functools
import threading
import time
from typing import Callable, Optional, Sequence

import torch

ProgressFn = Optional[Callable[[str, float], None]]
MIB = 2**20


def _notify(progress: ProgressFn, stage: str, fraction: float) -> None:
    if progress is not None:
        try:
            progress(stage, float(min(max(fraction, 0.0), 1.0)))
        except Exception:  # a broken progress bar must not break the measurement
            pass


def link_bound_s(size_bytes: float, peers: int, link_bytes_per_s: float) -> float:
    """Lower bound on butterfly all-reduce time over links of the given bandwidth."""
    if peers < 2 or link_bytes_per_s <= 0:
        return 0.0
    return 2.0 * size_bytes * (peers - 1) / peers / link_bytes_per_s


def _bus_factor(peers: int) -> float:
    return 2.0 * (peers - 1) / peers if peers > 1 else 0.0


def run_local(
    peers: int = 4,
    size_mb: float = 32.0,
    *,
    compression: str = "none",
    seed: int = 0,
    timeout_s: float = 180.0,
    part_size_bytes: int = 2**19,
    progress: ProgressFn = None,
) -> dict:
    """Average ``size_mb`` MiB of float32 across ``peers`` loopback peers; compare with the exact mean."""
    from dtrain.swarm.loopback import local_nodes

    if peers < 2:
        raise ValueError("need at least 2 peers")
    numel = max(int(size_mb * MIB / 4), 1)
    swarms: list = []
    _notify(progress, "starting peers", 0.0)
    with local_nodes(peers, on_started=lambda i: _notify(progress, "starting peers", (i + 1) / peers * 0.3)) as nodes:
        try:
            return _average_locally(nodes, swarms, numel, seed, compression, timeout_s, part_size_bytes, progress)
        finally:
            for s in swarms:
                s.shutdown()


def _average_locally(nodes, swarms: list, numel: int, seed: int, compression: str, timeout_s: float,
                     part_size_bytes: int, progress: ProgressFn) -> dict:
    """One timed round among already-started loopback ``nodes``; averagers go into ``swarms``."""
    from dtrain.swarm.averaging import GradientSwarm

    peers = len(nodes)
    data = [torch.randn(numel, generator=torch.Generator().manual_seed(seed + i)) for i in range(peers)]
    exact = torch.stack([d.double() for d in data]).mean(0)
    cfg = _local_config(peers, compression, timeout_s, part_size_bytes)
    fp = f"bandwidth-local-{numel}"
    for i, node in enumerate(nodes):
        swarms.append(GradientSwarm(node.dht, [data[i]], fp, cfg))
        _notify(progress, "starting averagers", 0.3 + (i + 1) / peers * 0.3)
    outputs = [d.clone() for d in data]
    _notify(progress, "all-reduce", 0.6)
    records, wall = _round_together(swarms, outputs, timeout_s)
    _notify(progress, "checking", 0.95)
    result = _local_result(records, outputs, data, exact, numel=numel, compression=compression, wall=wall)
    _notify(progress, "done", 1.0)
    return result


def _local_config(peers: int, compression: str, timeout_s: float, part_size_bytes: int):
    """Averaging settings of the loopback benchmark: all ``peers`` in one group, the plain mean."""
    from dtrain.swarm.averaging import AveragingConfig

    return AveragingConfig(
        prefix="dtrain_bw_local",
        min_group_size=peers,
        target_group_size=peers,
        min_matchmaking_time_s=3.0,
        request_timeout_s=1.0,
        matchmaking_timeout_s=timeout_s,
        allreduce_timeout_s=timeout_s,
        sender_timeout_s=timeout_s / 2,
        compression=compression,
        part_size_bytes=part_size_bytes,
        allow_state_sharing=False,
        aggregation="mean",  # the result is compared with the exact mean
    )


def _round_together(swarms: list, outputs: list, timeout_s: float) -> tuple[list, float]:
    """Run one round on every swarm at once (a thread each) into ``outputs``: (records, wall seconds).
    A record stays None where its thread did not finish in time."""
    records: list = [None] * len(swarms)

    def one(i: int) -> None:
        records[i] = swarms[i].run_round([outputs[i]], weight=1.0, cap=1.0)

    t0 = time.monotonic()
    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(swarms))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 30)
    return records, time.monotonic() - t0


def _average_errors(outputs: list, data: list, exact) -> tuple[float, float]:
    """(largest error against the exact mean, the same over the elements that were averaged).

    Where a reducer's part was lost, its senders keep their local values (docs/swarm.md); the
    error over the elements that did change says whether every average that arrived is exact.
    """
    max_err = max_err_averaged = 0.0
    for out, sent in zip(outputs, data):
        error = (out.double() - exact).abs()
        max_err = max(max_err, float(error.max()))
        averaged = error[out != sent]
        if averaged.numel():
            max_err_averaged = max(max_err_averaged, float(averaged.max()))
    return max_err, max_err_averaged


def _local_result(records: list, outputs: list, data: list, exact, *, numel: int, compression: str,
                  wall: float) -> dict:
    """The loopback benchmark's report: timings, bandwidth figures and errors against the exact mean."""
    from dtrain.swarm.records import Outcome

    peers = len(records)
    errors = [r.error for r in records if r is None or r.error] if all(records) else ["a peer did not finish"]
    seconds = max((r.allreduce_s for r in records if r is not None), default=0.0)
    max_err, max_err_averaged = _average_errors(outputs, data, exact)
    failures = [f"peer {i} ({r.local_peer_id[-8:]}): {p.outcome.value} {p.peer_id[-8:]}: {p.reason}"
                for i, r in enumerate(records) if r is not None
                for p in r.peers if p.outcome != Outcome.SUCCESS]
    if not errors and max_err > 1e-5 and compression == "none":
        errors = [f"the average was not exact (max error {max_err:.3g})"] + failures
    size_bytes = numel * 4
    return dict(
        mode="local",
        peers=peers,
        size_mb=size_bytes / MIB,
        size_bytes=size_bytes,
        compression=compression,
        seconds=seconds,
        wall_seconds_incl_matchmaking=wall,
        algbw_mb_s=(size_bytes / MIB) / seconds if seconds > 0 else 0.0,
        busbw_mb_s=(size_bytes / MIB) * _bus_factor(peers) / seconds if seconds > 0 else 0.0,
        max_abs_error=max_err,
        max_abs_error_averaged=max_err_averaged,
        failures=failures,
        fraction_averaged=min((r.fraction_averaged for r in records if r is not None), default=0.0),
        bytes_sent=[r.bytes_sent for r in records if r is not None],
        bytes_received=[r.bytes_received for r in records if r is not None],
        ok=not errors and max_err <= (1e-5 if compression == "none" else float("inf")),
        errors=errors,
    )


async def _ping_known(timeout: float, _dht, node) -> dict:
    import asyncio

    peer_ids = list(node.protocol.routing_table.peer_id_to_uid.keys())

    async def one(peer):
        t0 = time.monotonic()
        try:
            ok = (await asyncio.wait_for(node.protocol.call_ping(peer), timeout)) is not None
        except Exception:
            ok = False
        return str(peer), ((time.monotonic() - t0) * 1000.0 if ok else None)

    return dict(await asyncio.gather(*(one(p) for p in peer_ids)))


def run_real(
    initial_peers: Sequence[str],
    *,
    data_dir: str,
    size_mb: float = 8.0,
    host_maddrs: Sequence[str] = ("/ip4/0.0.0.0/tcp/0",),
    announce_maddrs: Sequence[str] = (),
    prefix: str = "dtrain_bw",
    min_group_size: int = 2,
    target_group_size: int = 8,
    link_mbit: Optional[float] = None,
    connect_timeout_s: float = 60.0,
    round_timeout_s: float = 120.0,
    matchmaking_s: float = 10.0,
    progress: ProgressFn = None,
) -> dict:
    """Measure latency to reachable peers and one real all-reduce round among benchmarking peers.

    Peers meet on ``<prefix>_<size>`` (never a training prefix) with weight 1 each.
    ``link_mbit`` (the operator's declared link speed) gives the theoretical bound.
    """
    from dtrain.swarm.averaging import GradientSwarm
    from dtrain.swarm.node import SwarmNode, SwarmNodeConfig

    numel = max(int(size_mb * MIB / 4), 1)
    node = SwarmNode(
        SwarmNodeConfig(
            data_dir=data_dir,
            initial_peers=list(initial_peers),
            host_maddrs=list(host_maddrs),
            announce_maddrs=list(announce_maddrs),
        )
    )
    swarm = None
    try:
        _notify(progress, "joining DHT", 0.0)
        node.start()
        known = node.ensure_connected(timeout_s=connect_timeout_s)
        _notify(progress, "measuring latency", 0.2)
        latencies = node.dht.run_coroutine(functools.partial(_ping_known, 5.0))
        _notify(progress, "all-reduce", 0.4)
        cfg = _real_config(f"{prefix}_{numel}", min_group_size, target_group_size, matchmaking_s, round_timeout_s)
        data = torch.randn(numel)
        swarm = GradientSwarm(node.dht, [data], f"bandwidth-{numel}", cfg)
        record = swarm.run_round([data], weight=1.0, cap=1.0)
        result = _real_result(node.peer_id, known, latencies, record, numel=numel, link_mbit=link_mbit)
        _notify(progress, "done", 1.0)
        return result
    finally:
        if swarm is not None:
            swarm.shutdown()
        node.shutdown()


def _real_config(prefix: str, min_group_size: int, target_group_size: int, matchmaking_s: float,
                 round_timeout_s: float):
    """Averaging settings of the swarm benchmark, on its own ``prefix`` (never a training one)."""
    from dtrain.swarm.averaging import AveragingConfig

    return AveragingConfig(
        prefix=prefix,
        min_group_size=min_group_size,
        target_group_size=target_group_size,
        min_matchmaking_time_s=matchmaking_s,
        request_timeout_s=min(3.0, matchmaking_s / 2),
        matchmaking_timeout_s=round_timeout_s,
        allreduce_timeout_s=round_timeout_s,
        sender_timeout_s=30.0,
        allow_state_sharing=False,
        aggregation="mean",  # a measurement of the links: no robust aggregation's CPU in the figure
    )


def _real_result(peer_id: str, known: int, latencies: dict, record, *, numel: int,
                 link_mbit: Optional[float]) -> dict:
    """The swarm benchmark's report: latencies, the round's figures and the link bound beside them."""
    reachable = {p: ms for p, ms in latencies.items() if ms is not None}
    n = len(record.group)
    size_bytes = numel * 4
    seconds = record.allreduce_s
    measured_bytes = record.bytes_sent + record.bytes_received
    link_bps = link_mbit * 1e6 / 8 if link_mbit else None
    bound = link_bound_s(size_bytes, n, link_bps) if link_bps else None
    return dict(
        mode="real",
        peer_id=peer_id,
        known_peers=known,
        latency_ms=reachable,
        latency_ms_median=(sorted(reachable.values())[len(reachable) // 2] if reachable else None),
        unreachable=[p for p, ms in latencies.items() if ms is None],
        peers=n,
        size_mb=size_bytes / MIB,
        seconds=seconds,
        algbw_mb_s=(size_bytes / MIB) / seconds if seconds > 0 else 0.0,
        busbw_mb_s=(size_bytes / MIB) * _bus_factor(n) / seconds if seconds > 0 and n > 1 else 0.0,
        throughput_mb_s=(measured_bytes / MIB) / seconds if seconds > 0 else 0.0,
        bytes_sent=record.bytes_sent,
        bytes_received=record.bytes_received,
        link_mbit=link_mbit,
        bound_s=bound,
        efficiency=(bound / seconds if bound and seconds > 0 else None),
        round=record.to_dict(),
        ok=not record.error,
        errors=[record.error] if record.error else [],
    )
