"""Options and error handling shared by every subcommand.

Nothing here may import torch, hivemind, transformers, datasets or bittensor:
this module is loaded for ``--help`` and for every TAB press of shell completion.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from typing import Annotated, Any, Callable, Optional, TypeVar

import typer

from dtrain.config import Config, ConfigError, load_config

F = TypeVar("F", bound=Callable[..., Any])

NETWORKS = ("finney", "test", "local", "sandbox")


class CommandError(Exception):
    """A runtime failure the operator can act on (not a config problem). Exits 1."""


def _complete_network(incomplete: str) -> list[str]:
    return [n for n in NETWORKS if n.startswith(incomplete)]


def _complete_preset(incomplete: str) -> list[str]:
    from dtrain.config import section_fields

    choices = section_fields("model")["preset"][1].metadata["choices"]
    return [c for c in choices if c.startswith(incomplete)]


# --- option declarations ---------------------------------------------------

ConfigOpt = Annotated[Optional[Path], typer.Option(
    "--config", "-c", dir_okay=False,
    help="Config file. Env DTRAIN_CONFIG. Default: $XDG_CONFIG_HOME/dtrain/config.toml.")]
NetworkOpt = Annotated[Optional[str], typer.Option(
    "--network", help="finney, test, local, a ws:// URL, or sandbox. Env BT_NETWORK.",
    autocompletion=_complete_network)]
NetuidOpt = Annotated[Optional[int], typer.Option("--netuid", help="Subnet uid (38 is Distributed Training).")]
WalletOpt = Annotated[Optional[str], typer.Option("--wallet", help="Wallet (coldkey) name. Env BT_WALLET.")]
HotkeyOpt = Annotated[Optional[str], typer.Option("--wallet-hotkey", help="Hotkey name. Env BT_WALLET_HOTKEY.")]
WalletPathOpt = Annotated[Optional[str], typer.Option("--wallet-path", help="Wallets directory (default ~/.bittensor/wallets).")]
SandboxDirOpt = Annotated[Optional[Path], typer.Option(
    "--sandbox-dir", file_okay=False, help="State directory of a sandbox chain (with --network sandbox).")]
DataDirOpt = Annotated[Optional[Path], typer.Option("--data-dir", file_okay=False, help="Checkpoints, identity and records.")]
NoDashboardOpt = Annotated[bool, typer.Option("--no-dashboard", help="Plain line logs instead of the live dashboard.")]
LogFormatOpt = Annotated[Optional[str], typer.Option("--log-format", help="Plain log format: text or json.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout and nothing else there.")]
DeviceOpt = Annotated[Optional[str], typer.Option("--device", help="auto, cpu, cuda or cuda:N (training.device).")]
PresetOpt = Annotated[Optional[str], typer.Option("--preset", help="Model preset.", autocompletion=_complete_preset)]


def chain_overrides(network: str | None, netuid: int | None, wallet: str | None, hotkey: str | None,
                    wallet_path: str | None = None, sandbox_dir: Path | None = None) -> dict[str, Any]:
    return {
        "chain.network": network,
        "chain.netuid": netuid,
        "wallet.name": wallet,
        "wallet.hotkey": hotkey,
        "wallet.path": wallet_path,
        "chain.sandbox_dir": str(sandbox_dir) if sandbox_dir is not None else None,
    }


def load(config: Path | None, overrides: dict[str, Any] | None = None) -> Config:
    cfg, _ = load_config(config, overrides=overrides or {})
    return cfg


# --- error handling ----------------------------------------------------------


def err(message: str) -> None:
    """One line on stderr; stdout stays clean for --json."""
    sys.stderr.write(message.rstrip("\n") + "\n")
    sys.stderr.flush()


def cli_errors(fn: F) -> F:
    """Turn known failures into a message and an exit code instead of a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except ConfigError as exc:
            err(f"dtrain: config error: {exc}")
            raise typer.Exit(2) from None
        except CommandError as exc:
            err(f"dtrain: error: {exc}")
            raise typer.Exit(1) from None

    return wrapper  # type: ignore[return-value]


def print_json(doc: Any) -> None:
    """One strict JSON document on stdout (NaN/inf as null: ``dtrain.jsonutil``)."""
    from dtrain import jsonutil

    text = jsonutil.dumps(doc, indent=2, sort_keys=False)
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def use_dashboard(cfg: Config, no_dashboard: bool) -> bool:
    """Live dashboards only on an interactive terminal; pm2/systemd get line logs."""
    if no_dashboard or not cfg.dashboard.enabled:
        return False
    if os.environ.get("TERM") == "dumb":
        return False
    return sys.stdout.isatty()
