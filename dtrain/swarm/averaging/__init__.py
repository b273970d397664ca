"""Gradient averaging over hivemind's butterfly all-reduce, with dtrain's robustness rules.

Transport, matchmaking and the butterfly itself are hivemind's; everything hivemind-specific
is behind the wall (dtrain/swarm/hivemind_internals/), which the modules that run a round
(``swarm``, ``averager``, ``runner``) import first so its shims are installed and its version
check has run. The rule modules do not import hivemind, and this package loads its public
names lazily, so ``import dtrain.swarm.averaging.group_rules`` (or ``settings``) does not load
hivemind either. dtrain's rules, one module each:

* ``settings``: AveragingConfig, whose defaults are the config schema's ([allreduce]);
* ``swarm``: GradientSwarm, the caller's side (one round -> one RoundRecord);
* ``averager``: the averager process, one group's round;
* ``group_rules``: what a group's gathered data decides (model check, caps, scale check,
  commitments, sitting out, the round report): pure functions;
* ``runner`` / ``reducer``: the checks on every part sent and returned, and how a share is
  reduced (weighted mean or ``centered_clip``);
* ``assembly``: when a leader may form its group early; ``contribution``: work commitments,
  and ``claims_tree``: the Merkle sum tree a commitment broadcasts instead of its claims.

Each round yields a :class:`~dtrain.swarm.records.RoundRecord` from this peer's view.
"""

from __future__ import annotations

import importlib

# public name -> the module of this package that defines it (loaded on first use)
_EXPORTS = {
    "AveragingConfig": "settings",
    "settings_from": "settings",
    "GradientSwarm": "swarm",
    "Interrupted": "swarm",
    "wait_unless_stopped": "swarm",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
