"""``dtrain init``: write a config file, by prompts on a terminal or by flags in scripts."""

from __future__ import annotations

import os
import sys
from typing import Annotated, Optional

import typer

from dtrain.cli.common import (
    CommandError, ConfigOpt, HotkeyOpt, NetuidOpt, NetworkOpt, WalletOpt, WalletPathOpt, cli_errors, err,
)
from dtrain.config import Config, apply_env, apply_overrides, check_consistency, resolve_config_path, save_config
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
    })
    interactive = not no_prompt and sys.stdin.isatty()
    if interactive:
        _prompt(cfg)
    if cfg.chain.network == "sandbox":
        # The sandbox trains the tiny model on the shipped text; nothing needs the network.
        cfg.model.preset, cfg.model.seq_len, cfg.data.source = "tiny", 128, "local"
    check_consistency(cfg, source="init")
    save_config(cfg, path, overwrite=force, sections=ROLE_SECTIONS[cfg.node.role])
    typer.echo(f"Wrote {cfg.node.role} config to {path}")

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


def _prompt_choice(text: str, choices: tuple[str, ...], default: str) -> str:
    while True:
        answer = typer.prompt(text, default=default).strip()
        if answer in choices:
            return answer
        err(f"expected one of {', '.join(choices)}, found {answer!r}")
