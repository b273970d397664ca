"""Building the effective configuration: built-in defaults < config file < environment <
command-line flags, each value checked against the schema as it is applied.

The environment is ``DTRAIN_<SECTION>_<KEY>`` plus bittensor's ``BT_NETWORK``/``BT_WALLET``/
``BT_WALLET_HOTKEY`` (docs/configuration.md).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

from dtrain.config.checks import (
    ConfigError, check_consistency, check_range, check_type, describe, parse_env_value, suggest,
)
from dtrain.config.files import read_toml, resolve_config_path
from dtrain.lifeline import LIFELINE_ENV
from dtrain.config.schema import MOVED_KEYS, REMOVED_KEYS, SECTIONS, Config, env_name, retired_reason, section_fields

# bittensor's own environment variables, honoured as btcli users expect.
BT_ENV = {"BT_NETWORK": ("chain", "network"), "BT_WALLET": ("wallet", "name"),
          "BT_WALLET_HOTKEY": ("wallet", "hotkey")}


def apply_mapping(cfg: Config, data: Mapping[str, Any], *, source: str) -> None:
    """Validate a parsed TOML document against the schema and merge it into ``cfg``."""
    for section, table in data.items():
        if section not in SECTIONS:
            raise ConfigError(f"unknown section{suggest(section, list(SECTIONS))}; "
                              f"known sections: {', '.join(SECTIONS)}", source=source, key=f"[{section}]")
        if not isinstance(table, dict):
            raise ConfigError(f"expected a table, found {describe(table)}", source=source, key=section)
        fields = section_fields(section)
        target = getattr(cfg, section)
        for key, value in table.items():
            dotted = f"{section}.{key}"
            if key not in fields:
                why = retired_reason(section, key)
                raise ConfigError(why or f"unknown key{suggest(key, list(fields))}", source=source, key=dotted)
            typ, fld = fields[key]
            value = check_type(value, typ, source=source, key=dotted)
            check_range(value, fld, source=source, key=dotted)
            setattr(target, key, value)


def apply_env(cfg: Config, env: Mapping[str, str]) -> None:
    for var, (section, key) in BT_ENV.items():
        if env.get(var):
            _set_checked(cfg, section, key, env[var], source=f"env {var}", from_string=True)
    for section in SECTIONS:
        for key in section_fields(section):
            var = env_name(section, key)
            if var in env:
                _set_checked(cfg, section, key, env[var], source=f"env {var}", from_string=True)
    # A misspelt DTRAIN_ variable would otherwise be ignored silently.
    known = {env_name(s, k) for s in SECTIONS for k in section_fields(s)} | {"DTRAIN_CONFIG", LIFELINE_ENV}
    retired = {env_name(*dotted.split(".")): dotted for dotted in (*MOVED_KEYS, *REMOVED_KEYS)}
    for var in env:
        if var.startswith("DTRAIN_") and var not in known and not var.startswith("DTRAIN_TEST_"):
            if var in retired:
                section, key = retired[var].split(".")
                raise ConfigError(retired_reason(section, key), source=f"env {var}")
            raise ConfigError(f"unknown setting{suggest(var, sorted(known))}", source=f"env {var}")


def _set_checked(cfg: Config, section: str, key: str, value: Any, *, source: str, from_string: bool = False) -> None:
    typ, fld = section_fields(section)[key]
    dotted = f"{section}.{key}"
    if from_string and isinstance(value, str):
        value = parse_env_value(value, typ, source=source, key=dotted)
    value = check_type(value, typ, source=source, key=dotted)
    check_range(value, fld, source=source, key=dotted)
    setattr(getattr(cfg, section), key, value)


def apply_overrides(cfg: Config, overrides: Mapping[str, Any]) -> None:
    """Command-line flags, keyed ``section.key``; ``None`` means "flag not given"."""
    for dotted, value in overrides.items():
        if value is None:
            continue
        section, key = dotted.split(".", 1)
        flag = "--" + key.replace("_", "-")
        _set_checked(cfg, section, key, value, source=f"flag {flag}")


def load_config(path: str | os.PathLike | None = None, *, overrides: Mapping[str, Any] | None = None,
                env: Mapping[str, str] | None = None) -> tuple[Config, Path | None]:
    """Build the effective configuration. Returns it with the file it read (None if none)."""
    env = os.environ if env is None else env
    file, explicit = resolve_config_path(path, env)
    cfg = Config()
    used: Path | None = None
    if explicit or file.exists():
        apply_mapping(cfg, read_toml(file), source=str(file))
        used = file
    apply_env(cfg, env)
    apply_overrides(cfg, overrides or {})
    check_consistency(cfg, source=str(used) if used else "configuration")
    return cfg, used
