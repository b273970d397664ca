"""``dtrain sandbox``: a whole subnet on this machine, with no network."""

from __future__ import annotations

import signal
import sys
import threading
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from dtrain.cli.common import CommandError, JsonOpt, NoDashboardOpt, cli_errors, err, print_json

# dtrain.sandbox.adversary.KINDS, written out so that completion never imports the neurons
# (tests/test_cli.py checks the two agree). The last two are honest: "fused-adamw" on another
# optimizer implementation (other hardware), "third-speed" on hardware a third as fast.
ADVERSARIES = ("lazy", "wrong-model", "copycat", "freeloader", "inflated-weight", "poisoner", "sign-flip", "zero",
               "selective", "rescale", "noisy", "replay", "sandbagger", "wrong-pages", "nullspace-sender", "negating-reducer",
               "scaling-reducer", "nullspace-reducer", "fused-adamw", "third-speed")


# dtrain.config's allreduce.mode choices (the config module is light, but keep completion lean).
MODES = ("gradient", "diloco")
# dtrain.training.models.PRESETS, written out for the same reason (tests/test_cli.py checks they agree).
MODELS = ("tiny", "gpt2-124m", "gpt2-250m", "gpt2-500m", "gpt2-1b")


def _complete_adversary(incomplete: str) -> list[str]:
    return [a for a in ADVERSARIES if a.startswith(incomplete)]


def _complete_mode(incomplete: str) -> list[str]:
    return [m for m in MODES if m.startswith(incomplete)]


def _complete_model(incomplete: str) -> list[str]:
    return [m for m in MODELS if m.startswith(incomplete)]


MinersOpt = Annotated[int, typer.Option("--miners", min=1, max=32, help="Honest miners to start.")]
RoundsOpt = Annotated[int, typer.Option("--rounds", min=1, help="All-reduce rounds to run before stopping.")]
ValidatorsOpt = Annotated[int, typer.Option(
    "--validators", min=1, max=8,
    help="Independent validators to start; each runs every round and sets its own weights.")]
AdversaryOpt = Annotated[Optional[list[str]], typer.Option(
    "--adversary", help=f"Add a cheating miner (repeatable): {', '.join(ADVERSARIES[:-2])}; or an honest "
    "one on other hardware: fused-adamw (another optimizer implementation), third-speed (a third as fast).",
    autocompletion=_complete_adversary)]
DirOpt = Annotated[Optional[Path], typer.Option(
    "--dir", file_okay=False, help="Keep the sandbox state here (default: a temporary directory).")]
ModeOpt = Annotated[str, typer.Option(
    "--mode", help="allreduce.mode: gradient (average every step) or diloco (H local steps, then one "
    "averaged pseudo-gradient and an outer Nesterov step).",
    autocompletion=_complete_mode)]
CheckOpt = Annotated[Optional[int], typer.Option(
    "--check", min=1, max=64,
    help="Miners each validator checks per round (validator.miners_per_round; default: all). Every miner "
    "averages every round either way, so a few checked of many shows a subnet-sized swarm.")]
ModelOpt = Annotated[str, typer.Option(
    "--model", help="Model preset every neuron trains: tiny (the default, 0.7M parameters) or a GPT-2 size, "
    "at a sequence length, batch and learning rate a CPU trains in seconds a step; the summary shows its "
    "parameters and each neuron's peak memory.",
    autocompletion=_complete_model)]
BatchAuditOpt = Annotated[float, typer.Option(
    "--batch-audit", min=0.0, max=1.0,
    help="Chance per miner and round that a validator recomputes the miner's whole batch "
    "(validator.batch_audit_probability; production's default is 0.25).")]

ProtocolOpt = Annotated[str, typer.Option(
    "--protocol", help="allreduce.protocol: hivemind (its matchmaking, the default) or dtrain (the validator "
    "announces each round and signs its membership; the members average on dtrain's own butterfly).",
    autocompletion=lambda incomplete: [p for p in PROTOCOLS if p.startswith(incomplete)])]
PROTOCOLS = ("hivemind", "dtrain")


@cli_errors
def sandbox(
    miners: MinersOpt = 3,
    rounds: RoundsOpt = 2,
    validators: ValidatorsOpt = 1,
    adversary: AdversaryOpt = None,
    directory: DirOpt = None,
    mode: ModeOpt = "gradient",
    check: CheckOpt = None,
    model: ModelOpt = "tiny",
    batch_audit: BatchAuditOpt = 1.0,
    protocol: ProtocolOpt = "hivemind",
    json_out: JsonOpt = False,
    no_dashboard: NoDashboardOpt = False,
) -> None:
    """Start an embedded chain, validators and miners on loopback; run rounds; print a summary."""
    if mode not in MODES:
        raise typer.BadParameter(f"expected one of {', '.join(MODES)}, found {mode!r}", param_hint="--mode")
    if model not in MODELS:
        raise typer.BadParameter(f"expected one of {', '.join(MODELS)}, found {model!r}", param_hint="--model")
    if protocol not in PROTOCOLS:
        raise typer.BadParameter(f"expected one of {', '.join(PROTOCOLS)}, found {protocol!r}",
                                 param_hint="--protocol")
    for kind in adversary or []:
        if kind not in ADVERSARIES:
            raise typer.BadParameter(f"expected one of {', '.join(ADVERSARIES)}, found {kind!r}",
                                     param_hint="--adversary")
    from dtrain.sandbox.orchestrator import Sandbox, SandboxOptions

    live = not json_out and not no_dashboard and sys.stdout.isatty()
    events: list[str] = []

    def note(message: str) -> None:
        events.append(f"{time.strftime('%H:%M:%S')} {message}")
        if not live:
            err(f"sandbox: {message}")

    box = Sandbox(SandboxOptions(miners=miners, rounds=rounds, validators=validators,
                                 adversaries=list(adversary or []), directory=directory, mode=mode,
                                 batch_audit=batch_audit, check=check, model=model, protocol=protocol),
                  on_event=note)
    code, interrupted = _run(box, note, events, rounds, live=live, directory=directory)
    if interrupted:
        err("sandbox: interrupted; every neuron was stopped")
        box.cleanup()
        raise typer.Exit(130)
    _report(box, directory, json_out)
    if code != 0:
        raise CommandError(f"a validator exited with code {code}; see its log under neurons/validator*/")


def _run(box, note, events: list[str], rounds: int, *, live: bool, directory: Optional[Path]) -> tuple[int, bool]:
    """Run until the validators finish or SIGINT/SIGTERM arrives, then stop every neuron.
    Returns (the validators' exit code, whether a signal stopped the run)."""
    from dtrain.sandbox.orchestrator import SandboxError

    interrupted = threading.Event()

    def on_signal(signum, frame):
        interrupted.set()
        box._stopping.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    code = 0
    try:
        box.setup()
        box.start()
        if live:
            code = _watch(box, events, rounds)
        else:
            code = box.wait_for_validator()
    except SandboxError as exc:
        raise CommandError(f"{exc} (state kept in {box.root})" if directory else str(exc)) from None
    finally:
        note("stopping every neuron")
        box.stop_all()
        for s, handler in previous.items():
            signal.signal(s, handler)
    return code, interrupted.is_set()


def _report(box, directory: Optional[Path], json_out: bool) -> None:
    """Save and print the closing summary, and remove a temporary sandbox directory."""
    summary = box.summary()
    _save_summary(box.root, summary)
    for name, why in summary["stop_notes"].items():
        err(f"sandbox: {name} did not stop cleanly: {why}")
    if directory is None:
        summary["dir"] = None  # the temporary directory is gone after this command
    box.cleanup()
    if json_out:
        print_json(summary)
    else:
        from rich.console import Console

        from dtrain.ui.summary import render_summary

        Console().print(render_summary(summary))
        if directory is not None:
            typer.echo(f"state kept in {directory}; inspect it with: "
                       f"dtrain status --network sandbox --sandbox-dir {directory}")


def _watch(box, events: list[str], rounds: int) -> int:
    from rich.console import Console
    from rich.live import Live

    from dtrain.ui.sandbox_view import render_sandbox

    with Live(console=Console(), auto_refresh=False, transient=False) as live:
        while not box._stopping.is_set():
            code = box.validators_done()
            live.update(render_sandbox(box.neuron_views(), events, rounds=rounds,
                                       elapsed_s=time.time() - box.started_at), refresh=True)
            if code is not None:
                return code
            time.sleep(1.0)
    return 130


def _save_summary(root: Path, summary: dict) -> None:
    import json

    from dtrain.sandbox import layout

    try:
        layout.summary_path(root).write_text(json.dumps(summary, indent=2))
    except OSError:
        pass
