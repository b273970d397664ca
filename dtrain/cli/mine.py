"""``dtrain mine``: run a miner until interrupted."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from dtrain.cli.common import PresetOpt, cli_errors, load
from dtrain.cli.node_options import NodeOptions, node_command


@cli_errors
@node_command
def mine(
    node: NodeOptions,
    preset: PresetOpt = None,
    port: Annotated[Optional[int], typer.Option("--port", help="Miner API port.")] = None,
    external_address: Annotated[Optional[str], typer.Option(
        "--external-address", help="host:port validators use to reach the API (committed on chain).")] = None,
    repo: Annotated[Optional[str], typer.Option("--repo", help="Model store: hf://owner/repo or a directory.")] = None,
    initial_peer: Annotated[Optional[list[str]], typer.Option(
        "--initial-peer", help="Extra hivemind multiaddr to bootstrap from (repeatable).")] = None,
    max_rounds: Annotated[Optional[int], typer.Option(
        "--max-rounds", min=1, help="Stop cleanly after this many all-reduce rounds (default: run until Ctrl-C).")] = None,
    adversary: Annotated[Optional[str], typer.Option(
        "--adversary", hidden=True, help="Misbehave on purpose (sandbox and tests only).")] = None,
) -> None:
    """Train, share gradients with the swarm, and answer validators. Ctrl-C saves and exits 0."""
    cfg = load(node.config, {
        **node.overrides(),
        "model.preset": preset, "api.port": port, "api.external_address": external_address, "hub.repo": repo,
        "allreduce.initial_peers": list(initial_peer) if initial_peer else None,
    })
    from dtrain.cli.neuron_runner import run_neuron

    def build(telemetry, stop):
        from dtrain.neurons.adversary import miner_class

        return miner_class(adversary)(cfg, telemetry, stop, max_rounds=max_rounds)

    raise typer.Exit(run_neuron(cfg, "miner", node.no_dashboard, build))
