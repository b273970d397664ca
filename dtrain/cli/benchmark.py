"""``dtrain benchmark-bandwidth``: measure what the bandwidth score will see."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from dtrain.cli.common import CommandError, ConfigOpt, JsonOpt, NetuidOpt, NetworkOpt, SandboxDirOpt, \
    chain_overrides, cli_errors, load, print_json


@cli_errors
def benchmark_bandwidth(
    config: ConfigOpt = None,
    network: NetworkOpt = None,
    netuid: NetuidOpt = None,
    sandbox_dir: SandboxDirOpt = None,
    local_peers: Annotated[Optional[int], typer.Option(
        "--local-peers", min=2, max=64, help="Run N averaging peers on loopback instead of joining the swarm.")] = None,
    size_mb: Annotated[float, typer.Option("--size-mb", min=0.001, max=4096, help="MiB of float32 to average.")] = 32.0,
    compression: Annotated[Optional[str], typer.Option("--compression", help="none, fp16 or 8bit.")] = None,
    initial_peer: Annotated[Optional[list[str]], typer.Option(
        "--initial-peer", help="Extra hivemind multiaddr to bootstrap from (repeatable).")] = None,
    link_mbit: Annotated[Optional[float], typer.Option(
        "--link-mbit", min=0.001, help="Your link speed in Mbit/s, for the theoretical bound (real mode).")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Throughput and latency to peers and a real all-reduce round, beside the link's bound."""
    cfg = load(config, {**chain_overrides(network, netuid, None, None, None, sandbox_dir),
                        "allreduce.compression": compression,
                        "allreduce.initial_peers": list(initial_peer) if initial_peer else None})
    from dtrain.swarm import bandwidth

    progress_cm = None
    if not json_out:
        from dtrain.ui.progress import benchmark_progress

        progress_cm = benchmark_progress()
    try:
        if progress_cm is not None:
            progress_cm.__enter__()
        callback = progress_cm if progress_cm is not None else None
        if local_peers is not None:
            result = bandwidth.run_local(local_peers, size_mb, compression=cfg.allreduce.compression,
                                         progress=callback)
        else:
            result = bandwidth.run_real(_initial_peers(cfg), data_dir=_bench_dir(cfg), size_mb=size_mb,
                                        host_maddrs=cfg.allreduce.host_maddrs,
                                        announce_maddrs=cfg.allreduce.announce_maddrs, link_mbit=link_mbit,
                                        progress=callback)
    except ConnectionError as exc:
        raise CommandError(f"no peer reachable: {exc}. Check allreduce.initial_peers or that miners have "
                           "committed their addresses on chain.") from None
    finally:
        if progress_cm is not None:
            progress_cm.__exit__(None, None, None)
    if json_out:
        print_json(result)
    else:
        from rich.console import Console

        from dtrain.ui.progress import benchmark_table

        Console().print(benchmark_table([result]))
    if result.get("ok") is False:
        raise CommandError("; ".join(result.get("errors") or ["the measurement failed"]))


def _bench_dir(cfg) -> str:
    from dtrain.config import expand

    path = expand(cfg.node.data_dir) / "benchmark"
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


def _initial_peers(cfg) -> list[str]:
    """Configured peers plus every committed miner's addresses: no hard-coded bootstrap."""
    peers = list(cfg.allreduce.initial_peers)
    try:
        from dtrain.neurons.discovery import peer_maddrs
        from dtrain.neurons.runtime import open_chain_for

        chain = open_chain_for(cfg)
        try:
            peers += peer_maddrs(chain.commitments().values())
        finally:
            chain.close()
    except Exception as exc:  # the chain is one source among two; say so and go on
        from dtrain.cli.common import err

        err(f"benchmark-bandwidth: could not read peers from the chain ({exc}); using configured peers only")
    if not peers:
        raise CommandError("no peers to measure against: set allreduce.initial_peers or --initial-peer, "
                           "or use --local-peers N for a loopback measurement")
    return list(dict.fromkeys(peers))
