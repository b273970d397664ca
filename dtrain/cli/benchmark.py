"""``dtrain benchmark-bandwidth``: measure what the bandwidth score will see."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from dtrain.cli.common import (
    AnnounceMaddrOpt, CommandError, ConfigOpt, ExternalAddressOpt, HostMaddrOpt, InitialPeerOpt, JsonOpt, NetuidOpt,
    NetworkOpt, SandboxDirOpt, address_overrides, chain_overrides, cli_errors, load, print_json, require_swarm_library,
)


LocalPeersOpt = Annotated[Optional[int], typer.Option(
    "--local-peers", min=2, max=64, help="Run N averaging peers on loopback instead of joining the swarm.")]
SizeMbOpt = Annotated[float, typer.Option("--size-mb", min=0.001, max=4096, help="MiB of float32 to average.")]
CompressionOpt = Annotated[Optional[str], typer.Option("--compression", help="none, fp16 or 8bit.")]
LinkMbitOpt = Annotated[Optional[float], typer.Option(
    "--link-mbit", min=0.001, help="Your link speed in Mbit/s, for the theoretical bound (real mode).")]
CheckReachabilityOpt = Annotated[bool, typer.Option(
    "--check-reachability",
    help="Instead of measuring: test, as far as this machine can, whether validators and peers reach this "
         "node's API and p2p ports (run it while the miner or validator runs).")]


@cli_errors
def benchmark_bandwidth(
    config: ConfigOpt = None,
    network: NetworkOpt = None,
    netuid: NetuidOpt = None,
    sandbox_dir: SandboxDirOpt = None,
    local_peers: LocalPeersOpt = None,
    size_mb: SizeMbOpt = 32.0,
    compression: CompressionOpt = None,
    initial_peer: InitialPeerOpt = None,
    link_mbit: LinkMbitOpt = None,
    external_address: ExternalAddressOpt = None,
    announce_maddr: AnnounceMaddrOpt = None,
    host_maddr: HostMaddrOpt = None,
    check_reachability: CheckReachabilityOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Throughput and latency to peers and a real all-reduce round, beside the link's bound."""
    cfg = load(config, {**chain_overrides(network, netuid, None, None, None, sandbox_dir),
                        "allreduce.compression": compression,
                        "allreduce.initial_peers": list(initial_peer) if initial_peer else None,
                        **address_overrides(external_address, announce_maddr, host_maddr)})
    if check_reachability:
        _check_reachability(cfg, json_out)
        return
    require_swarm_library()
    result = _measure(cfg, local_peers=local_peers, size_mb=size_mb, link_mbit=link_mbit, json_out=json_out)
    if json_out:
        print_json(result)
    else:
        from rich.console import Console

        from dtrain.ui.progress import benchmark_table

        Console().print(benchmark_table([result]))
    if result.get("ok") is False:
        raise CommandError("; ".join(result.get("errors") or ["the measurement failed"]))


def _measure(cfg, *, local_peers: Optional[int], size_mb: float, link_mbit: Optional[float], json_out: bool) -> dict:
    """One measurement: ``local_peers`` peers on loopback, or a real round with the swarm; a
    progress bar on stderr unless ``--json``."""
    from dtrain.swarm import bandwidth

    progress_cm = None
    if not json_out:
        from dtrain.ui.progress import benchmark_progress

        progress_cm = benchmark_progress()
    try:
        if progress_cm is not None:
            progress_cm.__enter__()
        if local_peers is not None:
            return bandwidth.run_local(local_peers, size_mb, compression=cfg.allreduce.compression,
                                       progress=progress_cm)
        return bandwidth.run_real(_initial_peers(cfg), data_dir=_bench_dir(cfg), size_mb=size_mb,
                                  host_maddrs=cfg.allreduce.host_maddrs,
                                  announce_maddrs=cfg.allreduce.announce_maddrs, link_mbit=link_mbit,
                                  progress=progress_cm)
    except ConnectionError as exc:
        raise CommandError(f"no peer reachable: {exc}. Check allreduce.initial_peers or that miners have "
                           "committed their addresses on chain.") from None
    finally:
        if progress_cm is not None:
            progress_cm.__exit__(None, None, None)


def _check_reachability(cfg, json_out: bool) -> None:
    """A separate mode, not a section of the measurement: it needs no peers and no round, takes
    seconds, and is what an operator runs right after setting up a port forward."""
    from dtrain.cli.common import check_addresses
    from dtrain.swarm.reachcheck import check_reachability

    check_addresses(cfg)
    report = check_reachability(
        network=cfg.chain.network, role=cfg.node.role, announce_maddrs=cfg.allreduce.announce_maddrs,
        host_maddrs=cfg.allreduce.host_maddrs, external_address=cfg.api.external_address, api_host=cfg.api.host,
        api_port=cfg.api.port, peer_id=_local_peer_id(cfg))
    if json_out:
        print_json(report)
    else:
        _print_reachability(report)
    if not report["ok"]:
        raise CommandError(f"reachability: {len(report['problems'])} problem(s); see above")


def _local_peer_id(cfg) -> str | None:
    """This machine's node of the configured role, from its status file (validators have no
    status API to ask); the newest one if several hotkeys ran here."""
    import json

    from dtrain.config import expand

    best = None
    for path in expand(cfg.node.data_dir).glob(f"{cfg.node.role}-*/status.json"):
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict) and isinstance(doc.get("peer_id"), str) and doc["peer_id"]:
            stamp = doc.get("started_at") if isinstance(doc.get("started_at"), (int, float)) else 0
            if best is None or stamp > best[0]:
                best = (stamp, doc["peer_id"])
    return best[1] if best else None


def _mark(value) -> str:
    return {True: "yes", False: "NO", None: "not tested"}[value]


def _print_reachability(report: dict) -> None:
    echo = typer.echo
    net = report["network"]
    echo(f"Reachability of this {report['role']} on {net}"
         + ("" if report["requires_public"] else " (runs on this machine: loopback is fine)"))
    api = report["api"]
    if api is not None:
        echo(f"\nMiner API, committed as {api['address']} ({api['class']}; from {api['source']})")
        if api.get("error"):
            echo(f"  {api['error']}")
        else:
            echo(f"  something listens on local port {api['local_port']}: {_mark(api['listening'])}")
            echo(f"  TCP connection to {api['address']}: {_mark(api['tcp_connect'])}"
                 + (f" ({api['tcp_error']})" if api["tcp_error"] else ""))
            echo(f"  GET /v1/status answered: {_mark(api['status_ok'])}"
                 + (f" ({api['status_error']})" if api["status_error"] else ""))
    p2p = report["p2p"]
    echo(f"\nP2P addresses (from {p2p['source']})" + (f", peer id {p2p['peer_id']}" if p2p["peer_id"] else ""))
    for e in p2p["addresses"]:
        echo(f"  {e['maddr']} ({e['class']})")
        echo(f"    TCP connection: {_mark(e['tcp_connect'])}" + (f" ({e['tcp_error']})" if e["tcp_error"] else ""))
        echo(f"    hivemind peer dialed it: {_mark(e['dialed'])}" + (f" ({e['dial_error']})" if e["dial_error"] else ""))
    for line in report["warnings"]:
        echo(f"\nwarning: {line}")
    for line in report["problems"]:
        echo(f"\nproblem: {line}")
    echo("\nWhat this cannot tell:")
    for line in report["limits"]:
        echo(f"  - {line}")
    echo("\nverdict: " + ("every test passed" if report["ok"] else "NOT reachable as configured, see problems"))


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
