"""``dtrain validate``: run a validator until interrupted."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from dtrain.cli.common import (
    ConfigOpt, DataDirOpt, HotkeyOpt, LogFormatOpt, NetuidOpt, NetworkOpt, NoDashboardOpt,
    SandboxDirOpt, WalletOpt, WalletPathOpt, chain_overrides, cli_errors, load,
)


@cli_errors
def validate(
    config: ConfigOpt = None,
    network: NetworkOpt = None,
    netuid: NetuidOpt = None,
    wallet: WalletOpt = None,
    wallet_hotkey: HotkeyOpt = None,
    wallet_path: WalletPathOpt = None,
    sandbox_dir: SandboxDirOpt = None,
    data_dir: DataDirOpt = None,
    round_interval: Annotated[Optional[float], typer.Option(
        "--round-interval", help="Seconds between validation rounds.")] = None,
    max_rounds: Annotated[Optional[int], typer.Option(
        "--max-rounds", min=1, help="Stop cleanly after this many validation rounds (default: run until Ctrl-C).")] = None,
    no_dashboard: NoDashboardOpt = False,
    log_format: LogFormatOpt = None,
) -> None:
    """Verify miners' training, run all-reduce rounds, score, and set weights. Ctrl-C exits 0."""
    cfg = load(config, {
        **chain_overrides(network, netuid, wallet, wallet_hotkey, wallet_path, sandbox_dir),
        "node.data_dir": str(data_dir) if data_dir else None,
        "validator.round_interval_s": round_interval, "node.log_format": log_format,
    })
    from dtrain.cli.neuron_runner import run_neuron

    def build(telemetry, stop):
        from dtrain.neurons.validator import Validator

        return Validator(cfg, telemetry, stop, max_rounds=max_rounds)

    raise typer.Exit(run_neuron(cfg, "validator", no_dashboard, build))
