"""``dtrain sandbox``: a whole subnet on this machine, with no network."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from dtrain.cli.common import JsonOpt, NoDashboardOpt, NotYetAvailable, cli_errors

ADVERSARIES = ("lazy", "wrong-model", "copycat", "freeloader", "inflated-weight", "poisoner")


def _complete_adversary(incomplete: str) -> list[str]:
    return [a for a in ADVERSARIES if a.startswith(incomplete)]


@cli_errors
def sandbox(
    miners: Annotated[int, typer.Option("--miners", min=1, max=32, help="Honest miners to start.")] = 3,
    rounds: Annotated[int, typer.Option("--rounds", min=1, help="All-reduce rounds to run before stopping.")] = 2,
    adversary: Annotated[Optional[list[str]], typer.Option(
        "--adversary", help=f"Add a cheating miner (repeatable): {', '.join(ADVERSARIES)}.",
        autocompletion=_complete_adversary)] = None,
    directory: Annotated[Optional[Path], typer.Option(
        "--dir", file_okay=False, help="Keep the sandbox state here (default: a temporary directory).")] = None,
    json_out: JsonOpt = False,
    no_dashboard: NoDashboardOpt = False,
) -> None:
    """Start an embedded chain, a validator and miners on loopback; run rounds; print a summary."""
    for kind in adversary or []:
        if kind not in ADVERSARIES:
            raise typer.BadParameter(f"expected one of {', '.join(ADVERSARIES)}, found {kind!r}",
                                     param_hint="--adversary")
    del miners, rounds, directory, json_out, no_dashboard
    raise NotYetAvailable("sandbox: the embedded subnet lands with issue #6, on top of the training core (#3), "
                          "swarm (#4) and neurons (#5).")
