"""Training modes: per-step gradient averaging and DiLoCo (``allreduce.mode``).

``build_mode(cfg, model, device, reader)`` returns the configured :class:`Mode`; miners,
validators and ``benchmarks/convergence.py`` drive it without asking which one it is
(``dtrain.modes.base`` describes the interface). Importing this package is cheap: torch is
imported when a mode is built.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from dtrain.config import Config
from dtrain.modes.base import (
    AuditRequest, Contribution, Mode, ModeSettings, NoSnapshots, PageTrained, Progress,
)
from dtrain.modes.diloco import DiLoCo
from dtrain.modes.per_step import PerStep

# allreduce.mode -> the class (or any callable with its constructor's signature) that runs it
MODES: dict[str, Callable[..., Mode]] = {"gradient": PerStep, "diloco": DiLoCo}


class UnknownMode(ValueError):
    """An ``allreduce.mode`` no mode is registered for."""


def build_mode(cfg: Config, model, device: str, reader, fused: bool | None = None,
               modes: Mapping[str, Callable[..., Mode]] | None = None) -> Mode:
    """The mode ``cfg.allreduce.mode`` names, holding ``model`` as its shared replica.

    ``fused`` forces (True) or forbids (False) torch's fused AdamW for the local steps (None:
    on CUDA only). ``modes`` replaces the registry (the cheating miners of
    dtrain.sandbox.adversary pass their own mode classes).
    """
    registry = MODES if modes is None else modes
    name = cfg.allreduce.mode
    try:
        factory = registry[name]
    except KeyError:
        raise UnknownMode(f"allreduce.mode {name!r} is not a training mode; expected one of "
                          f"{', '.join(sorted(registry))}") from None
    return factory(ModeSettings.from_config(cfg), model, device, reader, fused=fused)


__all__ = [
    "MODES",
    "AuditRequest",
    "Contribution",
    "DiLoCo",
    "Mode",
    "ModeSettings",
    "NoSnapshots",
    "PageTrained",
    "PerStep",
    "Progress",
    "UnknownMode",
    "build_mode",
]
