"""A neuron's swarm node heals itself.

A miner runs for weeks under pm2 or systemd, and the hivemind processes under it can go: the
OOM killer picks the DHT process, a crash ends the averager, a DHT stops answering. Without a
check the neuron carries on with a dead node: every later round fails (or, before the waits
were bounded, hangs), and the operator finds out from a falling weight. So between rounds the
neuron's own loop asks :class:`SwarmWatch` whether a check is due, looks at its node, and
restarts the whole swarm node (DHT, p2pd and averager; the identity key keeps the peer id,
so the chain commitment stays valid) when:

- a process is dead: at once;
- the DHT is alive but does not answer: after :data:`SILENT_CHECKS` checks in a row, so one
  slow answer on a loaded host does not cost a restart.

A restart that fails is tried again with a growing wait (:data:`RESTART_BACKOFF_S`). Each
step is said in the log and on the dashboard (the ``swarm`` health line).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

# How often the neuron's loop looks at its swarm node. A dead process is seen within this; a
# silent DHT within SILENT_CHECKS of these plus the DHT call timeout of each.
SWARM_CHECK_S = 5.0
SILENT_CHECKS = 2
# Waits before the next attempt after a failed restart (the last one repeats).
RESTART_BACKOFF_S = (5.0, 10.0, 20.0, 40.0, 60.0)


@dataclass(frozen=True)
class Finding:
    """What a look at the swarm node found: ``problem`` is None when all is well; ``dead``
    says a process is gone (restart at once) rather than slow to answer."""

    problem: Optional[str] = None
    dead: bool = False


class SwarmWatch:
    """When to look at the swarm node and when what it finds calls for a restart."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._next_check = 0.0
        self._silent = 0
        self._failed_restarts = 0

    def due(self) -> bool:
        return self._clock() >= self._next_check

    def judge(self, finding: Finding) -> Optional[str]:
        """The reason to restart now, or None; schedules the next check either way."""
        self._next_check = self._clock() + SWARM_CHECK_S
        if finding.problem is None:
            self._silent = 0
            return None
        if finding.dead:
            return finding.problem
        self._silent += 1
        if self._silent >= SILENT_CHECKS:
            return f"{finding.problem} ({self._silent} checks in a row)"
        return None

    def restarted(self, ok: bool) -> float:
        """Record a restart's outcome; returns how long until the next check."""
        self._silent = 0
        if ok:
            self._failed_restarts = 0
            wait = SWARM_CHECK_S
        else:
            wait = RESTART_BACKOFF_S[min(self._failed_restarts, len(RESTART_BACKOFF_S) - 1)]
            self._failed_restarts += 1
        self._next_check = self._clock() + wait
        return wait


def look_at(node, swarm, *, ping: bool = True) -> Finding:
    """Look at a SwarmNode and its GradientSwarm (either may be None before the first start).

    Without ``ping`` only whether the processes run is looked at (no round trip to the DHT):
    cheap enough to do before every round.
    """
    if node is None or swarm is None:
        return Finding("the swarm node is not running", dead=True)
    problem = swarm.problem()  # the averager process: a liveness check only, no round trip
    if problem:
        return Finding(problem, dead=True)
    if not node.alive():
        return Finding(node.problem() or "the DHT process is not running", dead=True)
    problem = node.problem() if ping else None
    if problem:
        return Finding(problem, dead=not node.alive())
    return Finding()
