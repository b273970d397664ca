"""``dtrain validate``: run a validator until interrupted."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from dtrain.cli.common import cli_errors, load, refuse_unreachable
from dtrain.cli.node_options import NodeOptions, node_command


@cli_errors
@node_command
def validate(
    node: NodeOptions,
    round_interval: Annotated[Optional[float], typer.Option(
        "--round-interval", help="Rounds start at multiples of this many seconds of UNIX time, so "
        "validators run rounds together.")] = None,
    max_rounds: Annotated[Optional[int], typer.Option(
        "--max-rounds", min=1, help="Stop cleanly after this many validation rounds (default: run until Ctrl-C).")] = None,
) -> None:
    """Verify miners' training, run all-reduce rounds, score, and set weights. Ctrl-C exits 0."""
    cfg = load(node.config, {**node.overrides(), "validator.round_interval_s": round_interval})
    # Validators join all-reduce rounds too: peers must be able to dial them.
    refuse_unreachable(cfg, "validator")
    from dtrain.cli.neuron_runner import run_neuron

    def build(telemetry, stop):
        from dtrain.neurons.validator import Validator

        return Validator(cfg, telemetry, stop, max_rounds=max_rounds)

    raise typer.Exit(run_neuron(cfg, "validator", node.no_dashboard, build))
