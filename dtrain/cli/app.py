"""The ``dtrain`` Typer application: global options and the subcommand table.

Each subcommand lives in its own module and imports the heavy core (torch,
hivemind, bittensor, ...) inside its function body, so ``--help`` and shell
completion stay fast.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from dtrain import __version__
from dtrain.cli import benchmark, init_cmd, mine, push, sandbox, status, validate

app = typer.Typer(
    name="dtrain",
    help="Miner and validator tool for Bittensor subnet 38 (Distributed Training).",
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"dtrain {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[Optional[bool], typer.Option(
        "--version", callback=_version, is_eager=True, help="Show the version and exit.")] = None,
) -> None:
    """Train one language model together over the internet, and verify who did the work."""


app.command("init")(init_cmd.init)
app.command("mine")(mine.mine)
app.command("validate")(validate.validate)
app.command("status")(status.status)
app.command("push")(push.push)
app.command("benchmark-bandwidth")(benchmark.benchmark_bandwidth)
app.command("sandbox")(sandbox.sandbox)


def main() -> None:
    quiet_libraries()
    app(prog_name="dtrain")


def quiet_libraries() -> None:
    """hivemind logs every identity and connection at INFO; operators see our dashboards instead."""
    import os

    os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")
