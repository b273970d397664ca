"""Gradient averaging over hivemind's butterfly all-reduce, with dtrain's robustness rules.

Transport, matchmaking and the butterfly itself are hivemind's; everything hivemind-specific
is behind the wall (dtrain/swarm/hivemind_internals/), imported first here so its shims are
installed before any averaging starts. dtrain's rules, one module each:

* ``settings``: AveragingConfig, whose defaults are the config schema's ([allreduce]);
* ``swarm``: GradientSwarm, the caller's side (one round -> one RoundRecord);
* ``averager``: the averager process, one group's round;
* ``group_rules``: what a group's gathered data decides (model check, caps, scale check,
  commitments, sitting out, the round report): pure functions;
* ``runner`` / ``reducer``: the checks on every part sent and returned, and how a share is
  reduced (weighted mean or ``centered_clip``);
* ``assembly``: when a leader may form its group early; ``contribution``: work commitments.

Each round yields a :class:`~dtrain.swarm.records.RoundRecord` from this peer's view.
"""

from __future__ import annotations

import dtrain.swarm.hivemind_internals  # noqa: F401  (first: hivemind's shims, and its version check)
from dtrain.swarm.averaging.settings import AveragingConfig, settings_from
from dtrain.swarm.averaging.swarm import GradientSwarm, Interrupted, wait_unless_stopped

__all__ = ["AveragingConfig", "GradientSwarm", "Interrupted", "settings_from", "wait_unless_stopped"]
