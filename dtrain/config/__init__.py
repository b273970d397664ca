"""Typed configuration: the names the rest of dtrain imports, from the modules that do the work.

- ``dtrain.config.schema``: the sections, their defaults, docs and rules (swarm-wide keys marked);
- ``dtrain.config.checks``: value checks and :class:`ConfigError`, which names file and key;
- ``dtrain.config.files``: where the file is, TOML read and atomic write;
- ``dtrain.config.loading``: precedence, defaults < file < environment < flags.

Reference: docs/configuration.md (generated from the schema by scripts/gen_config_docs.py).
On the ``dtrain --help`` path: standard library only (tomli-w lazily, when writing).
"""

from __future__ import annotations

from dtrain.config.checks import ConfigError, check_consistency
from dtrain.config.files import default_config_path, expand, read_toml, resolve_config_path, save_config, to_toml
from dtrain.config.loading import BT_ENV, apply_env, apply_mapping, apply_overrides, load_config
from dtrain.config.schema import (
    MOVED_KEYS, REMOVED_KEYS, SECTIONS, AllReduceConfig, ApiConfig, ChainConfig, Config, DashboardConfig, DataConfig,
    HubConfig, MinerConfig, ModelConfig, NodeConfig, TrainingConfig, ValidatorConfig, WalletConfig, env_name,
    section_fields, swarm_settings,
)

__all__ = [
    "BT_ENV", "MOVED_KEYS", "REMOVED_KEYS", "SECTIONS", "AllReduceConfig", "ApiConfig", "ChainConfig", "Config",
    "ConfigError", "DashboardConfig", "DataConfig", "HubConfig", "MinerConfig", "ModelConfig", "NodeConfig",
    "TrainingConfig", "ValidatorConfig", "WalletConfig", "apply_env", "apply_mapping", "apply_overrides",
    "check_consistency", "default_config_path", "env_name", "expand", "load_config", "read_toml",
    "resolve_config_path", "save_config", "section_fields", "swarm_settings", "to_toml",
]
