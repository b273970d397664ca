"""``dtrain status``: the subnet as seen from here."""

from __future__ import annotations

from typing import Annotated, Any, Callable

import typer

from dtrain.cli.common import ConfigOpt, JsonOpt, NetuidOpt, NetworkOpt, SandboxDirOpt, chain_overrides, cli_errors, load


def poll_once(cfg: Any, last: dict, collect: Callable[[Any], dict]) -> dict:
    """One --watch refresh; never raises. On any error the last good doc stays on screen,
    marked with the error, and the next interval tries again: a dead poll thread would
    freeze the dashboard on stale data with no sign of why."""
    try:
        doc = collect(cfg)
    except Exception as exc:  # noqa: BLE001 - anything at all: see above
        doc = dict(last)
        doc["poll_error"] = f"{type(exc).__name__}: {exc}"
    return doc


def poll_loop(cfg: Any, latest: dict, stop: Any, interval: float, collect: Callable[[Any], dict]) -> None:
    """The --watch poll thread: refresh ``latest["doc"]`` every ``interval`` until ``stop``."""
    while not stop.wait(interval):
        latest["doc"] = poll_once(cfg, latest["doc"], collect)


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
    from dtrain.status import collect_status

    if json_out:
        from dtrain.cli.common import print_json

        print_json(collect_status(cfg))
        return
    from rich.console import Console

    from dtrain.ui.status_view import render_status

    console = Console()
    if not watch:
        console.print(render_status(collect_status(cfg)))
        return
    import threading

    from dtrain.ui.dashboard import LiveDashboard

    # Collect in the background: a slow chain must not freeze the screen.
    latest = {"doc": collect_status(cfg)}
    stop = threading.Event()

    threading.Thread(target=poll_loop, args=(cfg, latest, stop, interval, collect_status),
                     daemon=True, name="status-poll").start()
    try:
        with LiveDashboard(lambda: latest["doc"], console=console, refresh_hz=2.0, render=render_status):
            while True:
                stop.wait(3600)
    except KeyboardInterrupt:
        pass
    finally:
        stop.set()
