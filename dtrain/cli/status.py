"""``dtrain status``: the subnet as seen from here."""

from __future__ import annotations

from typing import Annotated

import typer

from dtrain.cli.common import (
    ConfigOpt, JsonOpt, NetuidOpt, NetworkOpt, NotYetAvailable, SandboxDirOpt, chain_overrides, cli_errors, load,
)


@cli_errors
def status(
    config: ConfigOpt = None,
    network: NetworkOpt = None,
    netuid: NetuidOpt = None,
    sandbox_dir: SandboxDirOpt = None,
    watch: Annotated[bool, typer.Option("--watch", "-w", help="Refresh the dashboard until Ctrl-C.")] = False,
    interval: Annotated[float, typer.Option("--interval", min=0.2, help="Seconds between refreshes with --watch.")] = 2.0,
    json_out: JsonOpt = False,
) -> None:
    """Miners, global epoch and progress, and the last all-reduce rounds."""
    cfg = load(config, chain_overrides(network, netuid, None, None, None, sandbox_dir))
    del cfg, watch, interval, json_out
    raise NotYetAvailable("status: reading the chain lands with issue #5 and the dashboard with issue #6.")
