"""``dtrain benchmark-bandwidth``: measure what the bandwidth score will see."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from dtrain.cli.common import ConfigOpt, JsonOpt, NotYetAvailable, cli_errors, load


@cli_errors
def benchmark_bandwidth(
    config: ConfigOpt = None,
    local_peers: Annotated[Optional[int], typer.Option(
        "--local-peers", min=2, max=64, help="Run N averaging peers on loopback instead of joining the swarm.")] = None,
    size_mb: Annotated[float, typer.Option("--size-mb", min=0.001, help="Megabytes of float32 to average.")] = 32.0,
    compression: Annotated[Optional[str], typer.Option("--compression", help="none, fp16 or 8bit.")] = None,
    initial_peer: Annotated[Optional[list[str]], typer.Option(
        "--initial-peer", help="Extra hivemind multiaddr to bootstrap from (repeatable).")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Throughput and latency to peers and a real all-reduce round, beside the link's bound."""
    cfg = load(config, {"allreduce.compression": compression,
                        "allreduce.initial_peers": list(initial_peer) if initial_peer else None})
    del cfg, local_peers, size_mb, json_out
    raise NotYetAvailable("benchmark-bandwidth: the swarm engine lands with issue #4.")
