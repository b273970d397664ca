"""``dtrain mine``: run a miner until interrupted."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from dtrain.cli.common import (
    ConfigOpt, DataDirOpt, HotkeyOpt, LogFormatOpt, NetuidOpt, NetworkOpt, NoDashboardOpt,
    PresetOpt, SandboxDirOpt, WalletOpt, WalletPathOpt, chain_overrides, cli_errors, load,
)


@cli_errors
def mine(
    config: ConfigOpt = None,
    network: NetworkOpt = None,
    netuid: NetuidOpt = None,
    wallet: WalletOpt = None,
    wallet_hotkey: HotkeyOpt = None,
    wallet_path: WalletPathOpt = None,
    sandbox_dir: SandboxDirOpt = None,
    data_dir: DataDirOpt = None,
    preset: PresetOpt = None,
    device: Annotated[Optional[str], typer.Option("--device", help="auto, cpu, cuda or cuda:N.")] = None,
    port: Annotated[Optional[int], typer.Option("--port", help="Miner API port.")] = None,
    external_address: Annotated[Optional[str], typer.Option(
        "--external-address", help="host:port validators use to reach the API (committed on chain).")] = None,
    repo: Annotated[Optional[str], typer.Option("--repo", help="Model store: hf://owner/repo or a directory.")] = None,
    initial_peer: Annotated[Optional[list[str]], typer.Option(
        "--initial-peer", help="Extra hivemind multiaddr to bootstrap from (repeatable).")] = None,
    max_rounds: Annotated[Optional[int], typer.Option(
        "--max-rounds", min=1, help="Stop cleanly after this many all-reduce rounds (default: run until Ctrl-C).")] = None,
    no_dashboard: NoDashboardOpt = False,
    log_format: LogFormatOpt = None,
    adversary: Annotated[Optional[str], typer.Option(
        "--adversary", hidden=True, help="Misbehave on purpose (sandbox and tests only).")] = None,
) -> None:
    """Train, share gradients with the swarm, and answer validators. Ctrl-C saves and exits 0."""
    cfg = load(config, {
        **chain_overrides(network, netuid, wallet, wallet_hotkey, wallet_path, sandbox_dir),
        "node.data_dir": str(data_dir) if data_dir else None, "model.preset": preset, "miner.device": device,
        "api.port": port, "api.external_address": external_address, "hub.repo": repo,
        "allreduce.initial_peers": list(initial_peer) if initial_peer else None, "node.log_format": log_format,
    })
    from dtrain.cli.neuron_runner import run_neuron

    def build(telemetry, stop):
        from dtrain.neurons.miner import Miner

        return Miner(cfg, telemetry, stop, adversary=adversary, max_rounds=max_rounds)

    raise typer.Exit(run_neuron(cfg, "miner", no_dashboard, build))
