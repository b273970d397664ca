"""Gradient averaging over hivemind's butterfly all-reduce, with dtrain's rules.

Transport, matchmaking and the butterfly are hivemind's, behind the wall
(dtrain/swarm/hivemind_internals/); each of dtrain's mechanisms is one module here, and
docs/architecture.md draws a round's path through them. The rule modules do not import
hivemind, and this package loads its public names lazily, so importing ``group_rules`` or
``settings`` does not load hivemind either.
"""

from __future__ import annotations

import importlib

# public name -> the module of this package that defines it (loaded on first use)
_EXPORTS = {
    "AveragingConfig": "settings",
    "settings_from": "settings",
    "GradientSwarm": "swarm",
    "Interrupted": "waits",
    "wait_unless_stopped": "waits",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
