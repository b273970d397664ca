"""Where the config file is, and reading and writing it as TOML.

Reading uses the standard library's tomllib; tomli-w is imported only when a file is written,
so the ``dtrain --help`` path stays standard-library only.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Mapping

from dtrain.config.checks import ConfigError
from dtrain.config.schema import Config

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on 3.10
    import tomli as tomllib


def default_config_path(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    base = env.get("XDG_CONFIG_HOME") or str(Path(env.get("HOME", str(Path.home()))) / ".config")
    return Path(base) / "dtrain" / "config.toml"


def resolve_config_path(flag: str | os.PathLike | None, env: Mapping[str, str] | None = None) -> tuple[Path, bool]:
    """The config file to use and whether the operator named it explicitly.

    An explicitly named file (flag or DTRAIN_CONFIG) must exist; the default
    location may be absent, in which case the built-in defaults apply.
    """
    env = os.environ if env is None else env
    if flag:
        return Path(flag).expanduser(), True
    if env.get("DTRAIN_CONFIG"):
        return Path(env["DTRAIN_CONFIG"]).expanduser(), True
    return default_config_path(env), False


def read_toml(path: Path) -> dict[str, Any]:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError("file not found (create one with `dtrain init`)", source=str(path)) from None
    except IsADirectoryError:
        raise ConfigError("expected a TOML file, found a directory", source=str(path)) from None
    except PermissionError:
        raise ConfigError("permission denied reading the file", source=str(path)) from None
    try:
        return tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"expected UTF-8 text, found invalid byte at offset {exc.start}", source=str(path)) from None
    except tomllib.TOMLDecodeError as exc:
        # tomllib reports "... (at line L, column C)"; keep its wording, it names the line.
        raise ConfigError(f"invalid TOML: {exc}", source=str(path)) from None


def to_toml(cfg: Config, sections: tuple[str, ...] | None = None) -> str:
    import tomli_w

    doc = cfg.to_dict()
    if sections is not None:
        doc = {name: doc[name] for name in sections}
    return tomli_w.dumps(doc)


def save_config(cfg: Config, path: Path, *, overwrite: bool = False, sections: tuple[str, ...] | None = None) -> None:
    """Write atomically; refuse to replace an existing file unless ``overwrite``."""
    path = Path(path).expanduser()
    if path.exists() and not overwrite:
        raise FileExistsError(str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    from dtrain.atomic import write_text

    write_text(path, to_toml(cfg, sections))


def expand(path: str) -> Path:
    """A configured path with ``$VARS`` and ``~`` expanded."""
    return Path(os.path.expandvars(path)).expanduser()
