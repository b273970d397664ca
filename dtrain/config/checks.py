"""Validation of configuration values, and the :class:`ConfigError` that names the culprit.

Every check says where the bad value came from (file, ``env DTRAIN_...`` or ``--flag``), its
dotted key, what was expected and what was found (docs/configuration.md, "Errors").
Standard library only: this module is on the ``dtrain --help`` path.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

from dtrain.config.schema import Config


class ConfigError(Exception):
    """A configuration problem an operator must fix. The CLI prints it and exits 2.

    ``source`` is the file (or ``env DTRAIN_...`` / ``--flag``) the bad value came
    from, ``key`` the dotted key, and the message says what was expected and found.
    """

    def __init__(self, message: str, *, source: str | None = None, key: str | None = None):
        self.source = source
        self.key = key
        self.detail = message
        where = ": ".join(part for part in (source, key) if part)
        super().__init__(f"{where}: {message}" if where else message)


TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string", list: "a list of strings"}


def describe(value: Any) -> str:
    """A found value as an error message names it: ``integer 3``, ``string 'x'``, ``a table``."""
    if isinstance(value, bool):
        return f"boolean {str(value).lower()}"
    if isinstance(value, int):
        return f"integer {value}"
    if isinstance(value, float):
        return f"number {value}"
    if isinstance(value, str):
        return f"string {value!r}"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a table"
    return type(value).__name__


def check_type(value: Any, typ: type, *, source: str, key: str) -> Any:
    """``value`` as the field's type (an integer is a valid float), else ConfigError."""
    expected = TYPE_NAMES[typ]
    ok = (
        (typ is bool and isinstance(value, bool))
        or (typ is int and isinstance(value, int) and not isinstance(value, bool))
        or (typ is float and isinstance(value, (int, float)) and not isinstance(value, bool))
        or (typ is str and isinstance(value, str))
        or (typ is list and isinstance(value, list) and all(isinstance(v, str) for v in value))
    )
    if not ok:
        raise ConfigError(f"expected {expected}, found {describe(value)}", source=source, key=key)
    return float(value) if typ is float else value


def check_range(value: Any, fld: dataclasses.Field, *, source: str, key: str) -> None:
    """The field's ``choices``, ``min`` and ``max`` (schema metadata), else ConfigError."""
    meta = fld.metadata
    choices = meta.get("choices")
    if choices and value not in choices:
        raise ConfigError(f"expected one of {', '.join(choices)}, found {describe(value)}", source=source, key=key)
    lo, hi = meta.get("min"), meta.get("max")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            if lo is not None and hi is not None:
                want = f"a value from {_num(lo)} to {_num(hi)}"
            elif lo is not None:
                want = f"a value >= {_num(lo)}"
            else:
                want = f"a value <= {_num(hi)}"
            raise ConfigError(f"expected {want}, found {describe(value)}", source=source, key=key)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def parse_env_value(raw: str, typ: type, *, source: str, key: str) -> Any:
    """Environment values are strings; read them as the field's type."""
    text = raw.strip()
    try:
        if typ is bool:
            low = text.lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if typ is int:
            return int(text, 0)
        if typ is float:
            return float(text)
        if typ is list:
            return [part.strip() for part in text.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"expected {TYPE_NAMES[typ]}, found {raw!r}", source=source, key=key) from None
    return raw


def suggest(name: str, known: list[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest known name, or ''."""
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def check_consistency(cfg: Config, *, source: str) -> None:
    """Rules that span keys (each key on its own was checked when it was set)."""
    net = cfg.chain.network
    if net not in ("finney", "test", "local", "sandbox") and not net.startswith(("ws://", "wss://")):
        raise ConfigError(f"expected finney, test, local, sandbox or a ws:// URL, found {net!r}",
                          source=source, key="chain.network")
    if cfg.allreduce.min_group_size > cfg.allreduce.target_group_size:
        raise ConfigError(f"expected min_group_size <= target_group_size ({cfg.allreduce.target_group_size}), "
                          f"found {cfg.allreduce.min_group_size}", source=source, key="allreduce.min_group_size")
    if cfg.validator.ema_alpha <= 0:
        raise ConfigError(f"expected a value above 0, found {cfg.validator.ema_alpha}", source=source,
                          key="validator.ema_alpha")
    v = cfg.validator
    if v.weight_gradient + v.weight_steps + v.weight_bandwidth + v.weight_allreduce <= 0:
        raise ConfigError("expected at least one of weight_gradient, weight_steps, weight_bandwidth, "
                          "weight_allreduce above 0, found all 0", source=source, key="validator.weight_gradient")
    t = cfg.training
    if t.micro_batch_size > t.local_batch_size:
        raise ConfigError(f"expected micro_batch_size <= local_batch_size ({t.local_batch_size}), "
                          f"found {t.micro_batch_size}", source=source, key="training.micro_batch_size")
    if cfg.allreduce.target_batch_size < t.local_batch_size:
        raise ConfigError(f"expected target_batch_size >= training.local_batch_size ({t.local_batch_size}), found "
                          f"{cfg.allreduce.target_batch_size}", source=source, key="allreduce.target_batch_size")
