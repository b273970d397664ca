"""``dtrain mine``: run a miner until interrupted."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from dtrain.cli.common import (
    ExternalAddressOpt, InitialPeerOpt, PresetOpt, address_overrides, cli_errors, load, refuse_unreachable,
)
from dtrain.cli.node_options import NodeOptions, node_command


@cli_errors
@node_command
def mine(
    node: NodeOptions,
    preset: PresetOpt = None,
    port: Annotated[Optional[int], typer.Option("--port", help="Miner API port.")] = None,
    external_address: ExternalAddressOpt = None,
    repo: Annotated[Optional[str], typer.Option("--repo", help="Model store: hf://owner/repo or a directory.")] = None,
    initial_peer: InitialPeerOpt = None,
    max_rounds: Annotated[Optional[int], typer.Option(
        "--max-rounds", min=1, help="Stop cleanly after this many all-reduce rounds (default: run until Ctrl-C).")] = None,
) -> None:
    """Train, share gradients with the swarm, and answer validators. Ctrl-C saves and exits 0."""
    cfg = load(node.config, {
        **node.overrides(),
        "model.preset": preset, "api.port": port, "hub.repo": repo,
        "api.external_address": address_overrides(external_address)["api.external_address"],
        "allreduce.initial_peers": list(initial_peer) if initial_peer else None,
    })
    # Before the chain is contacted and anything is committed: an unreachable miner earns nothing.
    refuse_unreachable(cfg, "miner")
    from dtrain.cli.neuron_runner import run_neuron

    def build(telemetry, stop):
        from dtrain.neurons.miner import Miner

        return Miner(cfg, telemetry, stop, max_rounds=max_rounds)

    raise typer.Exit(run_neuron(cfg, "miner", node.no_dashboard, build))
