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
ExternalAddressOpt = Annotated[Optional[str], typer.Option(
    "--external-address", metavar="HOST:PORT",
    help="Public host:port validators dial for the miner API, committed on chain (api.external_address).")]
AnnounceMaddrOpt = Annotated[Optional[list[str]], typer.Option(
    "--announce-maddr", metavar="MADDR",
    help="Public multiaddr peers dial for all-reduce, e.g. /ip4/203.0.113.7/tcp/31337 (repeatable; "
         "allreduce.announce_maddrs).")]
HostMaddrOpt = Annotated[Optional[list[str]], typer.Option(
    "--host-maddr", metavar="MADDR",
    help="Multiaddr hivemind listens on, e.g. /ip4/0.0.0.0/tcp/31337 (repeatable; allreduce.host_maddrs).")]
InitialPeerOpt = Annotated[Optional[list[str]], typer.Option(
    "--initial-peer", help="Extra hivemind multiaddr to bootstrap from (repeatable).")]


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


def address_overrides(external_address: str | None = None, announce_maddrs: list[str] | None = None,
                      host_maddrs: list[str] | None = None) -> dict[str, Any]:
    """Config keys of the reachability flags, each value checked so a typo is named against its flag."""
    from dtrain.swarm.reachability import (
        AddressError, validate_announce_maddr, validate_external_address, validate_host_maddr,
    )

    def checked(flag: str, key: str, check, values):
        try:
            return [check(v) for v in values]
        except AddressError as exc:
            raise ConfigError(str(exc), source=f"flag {flag}", key=key) from None

    return {
        "api.external_address": checked("--external-address", "api.external_address", validate_external_address,
                                        [external_address])[0] if external_address is not None else None,
        "allreduce.announce_maddrs": checked("--announce-maddr", "allreduce.announce_maddrs",
                                             validate_announce_maddr, announce_maddrs) if announce_maddrs else None,
        "allreduce.host_maddrs": checked("--host-maddr", "allreduce.host_maddrs", validate_host_maddr,
                                         host_maddrs) if host_maddrs else None,
    }


def check_addresses(cfg: Config) -> None:
    """Addresses from the file or the environment parse (flags were checked already); exits 2 if not."""
    from dtrain.swarm.reachability import (
        AddressError, validate_announce_maddr, validate_external_address, validate_host_maddr,
    )

    checks = [("allreduce.announce_maddrs", validate_announce_maddr, cfg.allreduce.announce_maddrs),
              ("allreduce.host_maddrs", validate_host_maddr, cfg.allreduce.host_maddrs)]
    if cfg.api.external_address:
        checks.append(("api.external_address", validate_external_address, [cfg.api.external_address]))
    for key, check, values in checks:
        for value in values:
            try:
                check(value)
            except AddressError as exc:
                from dtrain.config import env_name

                # Flags were checked on their own; what is left came from the file or the environment.
                raise ConfigError(str(exc), source=f"config file or env {env_name(*key.split('.'))}",
                                  key=key) from None


def refuse_unreachable(cfg: Config, role: str) -> None:
    """Stop before the chain is contacted when the config alone shows this node would be
    unreachable on a real network (dtrain.swarm.reachability). Warnings on private addresses
    come from the neuron itself, once it knows what hivemind really announces."""
    from dtrain.swarm.reachability import preflight, refusals

    check_addresses(cfg)
    found = refusals(preflight(network=cfg.chain.network, role=role, announce_maddrs=cfg.allreduce.announce_maddrs,
                               host_maddrs=cfg.allreduce.host_maddrs, external_address=cfg.api.external_address,
                               api_host=cfg.api.host, api_port=cfg.api.port))
    if found:
        raise CommandError("refusing to start: " + " Also: ".join(f.message for f in found))


def require_swarm_library() -> None:
    """Stop with the fix before anything joins a swarm on an untested hivemind release: such a
    release fails mid-round in ways no import error shows (dtrain.swarm.library). Cheap: it
    reads the installed version without importing hivemind."""
    from dtrain.swarm.library import version_problem

    problem = version_problem()
    if problem:
        raise CommandError(problem)


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
