"""``dtrain init``: write a config file, by prompts on a terminal or by flags in scripts."""

from __future__ import annotations

import os
import sys
from typing import Annotated, Optional

import typer

from dtrain.cli.common import (
    AnnounceMaddrOpt, CommandError, ConfigOpt, ExternalAddressOpt, HostMaddrOpt, HotkeyOpt, NetuidOpt, NetworkOpt,
    WalletOpt, WalletPathOpt, address_overrides, check_addresses, cli_errors, err,
)
from dtrain.config import (
    Config, ConfigError, apply_env, apply_overrides, check_consistency, resolve_config_path, save_config,
)
from dtrain.wallets import check_wallet, create_command

ROLES = ("miner", "validator")

# Sections each role's file spells out; the rest keep their built-in defaults.
ROLE_SECTIONS = {
    "miner": ("wallet", "chain", "node", "model", "data", "training", "miner", "allreduce", "hub", "api", "dashboard"),
    # validators recompute miners' gradients with [training], and serve /metrics per [api]
    "validator": ("wallet", "chain", "node", "model", "data", "training", "validator", "allreduce", "api",
                  "dashboard"),
}


@cli_errors
def init(
    config: ConfigOpt = None,
    role: Annotated[Optional[str], typer.Option("--role", help="miner or validator.",
                                                autocompletion=lambda incomplete: [r for r in ROLES if r.startswith(incomplete)])] = None,
    netuid: NetuidOpt = None,
    network: NetworkOpt = None,
    wallet: WalletOpt = None,
    wallet_hotkey: HotkeyOpt = None,
    wallet_path: WalletPathOpt = None,
    external_address: ExternalAddressOpt = None,
    announce_maddr: AnnounceMaddrOpt = None,
    host_maddr: HostMaddrOpt = None,
    no_prompt: Annotated[bool, typer.Option("--no-prompt", help="Take every answer from flags and defaults.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing config file.")] = False,
) -> None:
    """Create a config file for a miner or a validator."""
    path, _ = resolve_config_path(config)
    if path.exists() and not force:
        # Checked before any prompt so nobody answers five questions for nothing.
        raise CommandError(f"{path} already exists; it was left untouched. Use --force to overwrite it.")

    cfg = Config()
    apply_env(cfg, os.environ)
    apply_overrides(cfg, {
        "node.role": role, "chain.netuid": netuid, "chain.network": network,
        "wallet.name": wallet, "wallet.hotkey": wallet_hotkey, "wallet.path": wallet_path,
        **address_overrides(external_address, announce_maddr, host_maddr),
    })
    interactive = not no_prompt and sys.stdin.isatty()
    if interactive:
        _prompt(cfg)
    notes = _settle_addresses(cfg, host_maddr_given=bool(host_maddr))
    if cfg.chain.network == "sandbox":
        # The sandbox trains the tiny model on the shipped text with the shipped tokenizer
        # (as `dtrain sandbox` does); nothing needs the network.
        cfg.model.preset, cfg.model.seq_len, cfg.data.source = "tiny", 128, "local"
        cfg.data.tokenizer = "shipped"
    check_consistency(cfg, source="init")
    save_config(cfg, path, overwrite=force, sections=ROLE_SECTIONS[cfg.node.role])
    typer.echo(f"Wrote {cfg.node.role} config to {path}")
    for note in notes:
        err(f"note: {note}")

    check = check_wallet(cfg.wallet.path, cfg.wallet.name, cfg.wallet.hotkey)
    if not check.ok:
        missing = "hotkey" if check.coldkey_exists else "wallet"
        err(f"warning: {missing} {cfg.wallet.name}/{cfg.wallet.hotkey} not found under {cfg.wallet.path}. "
            f"Create it with: {create_command(cfg.wallet.path, cfg.wallet.name, cfg.wallet.hotkey, coldkey_exists=check.coldkey_exists)}")


def _prompt(cfg: Config) -> None:
    cfg.node.role = _prompt_choice("Role (miner/validator)", ROLES, cfg.node.role)
    cfg.chain.network = typer.prompt("Network (finney/test/local/ws://.../sandbox)", default=cfg.chain.network)
    cfg.chain.netuid = typer.prompt("Netuid", default=cfg.chain.netuid, type=int)
    cfg.wallet.name = typer.prompt("Wallet name", default=cfg.wallet.name)
    cfg.wallet.hotkey = typer.prompt("Hotkey name", default=cfg.wallet.hotkey)
    if cfg.node.role == "miner":
        cfg.hub.repo = typer.prompt("Model store (hf://owner/repo or a directory; empty to skip)",
                                    default=cfg.hub.repo, show_default=False)
        cfg.api.port = typer.prompt("Miner API port", default=cfg.api.port, type=int)
    # Flags went through validation in apply_overrides; prompted answers go through it too.
    apply_overrides(cfg, {"node.role": cfg.node.role, "chain.network": cfg.chain.network,
                          "chain.netuid": cfg.chain.netuid, "api.port": cfg.api.port})
    from dtrain.swarm.reachability import requires_public

    if requires_public(cfg.chain.network):
        _prompt_addresses(cfg)


def _prompt_addresses(cfg: Config) -> None:
    """Ask where other machines reach this one. The suggestions are built from what the
    operator types: dtrain never asks the internet for this machine's public IP."""
    from dtrain.swarm.reachability import (
        DEFAULT_P2P_PORT, parse_host_port, parse_maddr, validate_announce_maddr,
        validate_external_address,
    )

    known = ""
    if cfg.api.external_address:
        known = parse_host_port(cfg.api.external_address)[0]
    elif cfg.allreduce.announce_maddrs:
        known = parse_maddr(cfg.allreduce.announce_maddrs[0]).host
    host = typer.prompt("Public IP or DNS name other machines reach this one at (empty: set it later)",
                        default=known, show_default=bool(known)).strip().strip("[]")
    if cfg.node.role == "miner":
        suggestion = cfg.api.external_address or (f"{f'[{host}]' if ':' in host else host}:{cfg.api.port}"
                                                  if host else "")
        cfg.api.external_address = _prompt_valid(
            "Miner API address validators dial (host:port forwarded to the API port)", suggestion,
            lambda text: validate_external_address(text) if text else "")
    if host and not cfg.allreduce.announce_maddrs:
        proto = "ip6" if ":" in host else "ip4" if host.replace(".", "").isdigit() else "dns"
        suggestion = f"/{proto}/{host}/tcp/{DEFAULT_P2P_PORT}"
    else:
        suggestion = ",".join(cfg.allreduce.announce_maddrs)

    def announce(text: str) -> list[str]:
        return [validate_announce_maddr(part) for part in text.split(",") if part.strip()]

    cfg.allreduce.announce_maddrs = _prompt_valid(
        "P2P multiaddrs peers dial for all-reduce (comma-separated; a TCP port forwarded to this machine)",
        suggestion, announce)


def _prompt_valid(text: str, default: str, check):
    """Ask until ``check(answer)`` accepts it (an AddressError is shown and the question repeated)."""
    from dtrain.swarm.reachability import AddressError

    while True:
        answer = typer.prompt(text, default=default, show_default=bool(default)).strip()
        try:
            return check(answer)
        except AddressError as exc:
            err(f"{exc}")


def _settle_addresses(cfg: Config, *, host_maddr_given: bool) -> list[str]:
    """Check the addresses the file will hold, fix the listen port to the announced one, and
    return notes for what is still missing. A loopback address on a real network is an error
    here rather than at the first ``dtrain mine``."""
    from dtrain.swarm.reachability import fixed_port_host_maddrs, preflight, refusals, requires_public, warnings

    check_addresses(cfg)
    if cfg.allreduce.announce_maddrs and not host_maddr_given:
        # An announced port must be the port p2pd listens on (or one a router forwards to it);
        # the default tcp/0 changes on every restart, so pin it in the file.
        fixed = fixed_port_host_maddrs(cfg.allreduce.host_maddrs, cfg.allreduce.announce_maddrs)
        if fixed is not None:
            cfg.allreduce.host_maddrs = fixed
    if not requires_public(cfg.chain.network):
        return []
    findings = preflight(network=cfg.chain.network, role=cfg.node.role, announce_maddrs=cfg.allreduce.announce_maddrs,
                         host_maddrs=cfg.allreduce.host_maddrs, external_address=cfg.api.external_address,
                         api_host=cfg.api.host, api_port=cfg.api.port)
    notes = []
    for finding in refusals(findings):
        explicit = cfg.api.external_address if finding.what == "api" else \
            (cfg.allreduce.announce_maddrs or host_maddr_given)
        if explicit:
            key = "api.external_address" if finding.what == "api" else \
                "allreduce.announce_maddrs" if cfg.allreduce.announce_maddrs else "allreduce.host_maddrs"
            raise ConfigError(finding.message, source="init", key=key)
        # Nothing given yet: the file is still useful, the operator adds the address later.
        notes.append(f"{finding.message}. `dtrain {'mine' if cfg.node.role == 'miner' else 'validate'}` "
                     "refuses to start until then.")
    notes += [finding.message for finding in warnings(findings)]
    if not cfg.allreduce.announce_maddrs and not refusals(findings):
        notes.append("allreduce.announce_maddrs is empty: hivemind will announce this machine's interface "
                     "addresses, which works only without NAT; set --announce-maddr to your public address "
                     "(docs/operators.md, \"Reachability and NAT\")")
    return notes


def _prompt_choice(text: str, choices: tuple[str, ...], default: str) -> str:
    while True:
        answer = typer.prompt(text, default=default).strip()
        if answer in choices:
            return answer
        err(f"expected one of {', '.join(choices)}, found {answer!r}")
