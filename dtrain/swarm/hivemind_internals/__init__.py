"""The wall: the one place in dtrain that knows hivemind's internals.

Everything that subclasses hivemind's classes, overrides their private methods or patches its
module globals is here, and only here (tests/test_hivemind_wall.py scans the rest of dtrain).
Importing this package on an untested hivemind release raises :class:`UnsupportedHivemind` with
the fix (dtrain/swarm/library.py), before any hivemind module is imported.

dtrain's rules never subclass what is here: the averager process runs a ``RoundHandler`` and
the butterfly runner a ``ButterflyChecks`` (dtrain/swarm/averaging/). Modules: ``averager``
(the averager process), ``matchmaking`` (a leader's early formation), ``runner`` and
``reply_stream`` (the butterfly), ``processes`` (the DHT process, the command pipe), ``locks``,
``state_server`` and ``shims`` (what is patched into hivemind at import: docs/swarm.md,
"Compatibility shims and the hivemind wall").
"""

from __future__ import annotations

from dtrain.swarm.library import TESTED_VERSIONS, UnsupportedHivemind, version_problem

_problem = version_problem()
if _problem:
    raise UnsupportedHivemind(_problem)

# Only once the release is known to be a tested one:
from dtrain.swarm.hivemind_internals.averager import (  # noqa: E402
    AVERAGER_TORCH_THREADS,
    AVERAGER_WIRE_NAME,
    ROLE_OF_MODE,
    AveragerProcess,
    Group,
    MatchmakingException,
    RoundHandler,
    reset_torch_threads_after_fork,
)
from dtrain.swarm.hivemind_internals.locks import (  # noqa: E402
    SurvivableLock,
    install_survivable_locks,
)
from dtrain.swarm.hivemind_internals.processes import (  # noqa: E402
    DHTProcess,
    daemon_pid,
    dial,
    undeclare_in_background,
)
from dtrain.swarm.hivemind_internals.reply_stream import ReplyStream, SendingFailed  # noqa: E402
from dtrain.swarm.hivemind_internals.runner import ButterflyChecks, ButterflyFacts, ButterflyRunner  # noqa: E402
from dtrain.swarm.hivemind_internals.state_server import install_state_server  # noqa: E402
from dtrain.swarm.hivemind_internals.shims import (  # noqa: E402
    BlockwiseAbsmax8BitCompression,
    BlockwiseTernaryCompression,
    compression,
    deserialize_part,
    install_shims,
    load_balance,
    optimize_parts_highs,
    serialize_part,
    shims_installed,
)

install_shims()
install_survivable_locks()
install_state_server()

__all__ = [
    "AVERAGER_TORCH_THREADS",
    "AVERAGER_WIRE_NAME",
    "ROLE_OF_MODE",
    "TESTED_VERSIONS",
    "AveragerProcess",
    "BlockwiseAbsmax8BitCompression",
    "BlockwiseTernaryCompression",
    "ButterflyChecks",
    "ButterflyFacts",
    "ButterflyRunner",
    "DHTProcess",
    "Group",
    "MatchmakingException",
    "ReplyStream",
    "RoundHandler",
    "SendingFailed",
    "SurvivableLock",
    "UnsupportedHivemind",
    "compression",
    "daemon_pid",
    "deserialize_part",
    "dial",
    "install_shims",
    "install_state_server",
    "install_survivable_locks",
    "load_balance",
    "optimize_parts_highs",
    "reset_torch_threads_after_fork",
    "serialize_part",
    "shims_installed",
    "undeclare_in_background",
]
