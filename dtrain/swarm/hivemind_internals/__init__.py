"""The wall: the one place in dtrain that knows hivemind's internals.

dtrain needs a few rules hivemind has no hooks for (receiver-side weights, part checks,
early group formation, bit-identical results, a command pipe that survives a dead sender).
Adding them means subclassing hivemind's averager and all-reduce runner, overriding private
methods, and patching a few module globals. All of that is in this package, and only here
(tests/test_hivemind_wall.py scans the rest of dtrain for it), so:

* a hivemind upgrade is checked in one place, against ``TESTED_VERSIONS``
  (dtrain/swarm/library.py): importing this package on another release raises
  :class:`UnsupportedHivemind` with the fix, before any hivemind module is imported;
* the rest of dtrain sees dtrain-shaped hooks (``average_with_group``, ``should_form_group``,
  ``serve_stream``, ``messages_to_reducer`` ...), and dtrain's rules live outside the wall
  (dtrain/swarm/averaging/).

Modules: ``shims`` (what is patched into hivemind, and its compression objects),
``processes`` (the DHT process, the command pipe, dialling, leaving the matchmaking queue),
``averager`` (AveragerProcess: hivemind's DecentralizedAverager with hooks), ``runner``
(ButterflyRunner: hivemind's AllReduceRunner with hooks). One package rather than one file
only to keep each part readable; nothing outside imports the submodules directly.

What is patched, at import (:func:`install_shims`, idempotent):

1. hivemind's 8-bit quantizers decode the codebook length with ``int(np.frombuffer(...))``,
   which numpy >= 2.4 refuses; fixed subclasses are registered under the same wire ids, so
   the bytes on the wire are unchanged and unpatched peers still interoperate.
2. The load balancer's ``linprog(method="interior-point")`` is deprecated (fatal under
   ``-W error``) and slated for removal: the same LP is solved with HiGHS, with an equal
   split if the solver fails, so a round never dies in load balancing.
3. dtrain's 8-bit codec (dtrain/swarm/codecs.py) is registered under ``BLOCKWISE_8BIT``.

And (:func:`install_survivable_locks`, ``locks``): hivemind's three cross-process MPFuture
locks become locks that a process killed while holding one does not leave locked for ever.
And (:func:`install_state_server`, ``averager``): the neuron's thread that serves this peer's
state to peers catching up no longer holds the last state it served, nor its request's pipe.
"""

from __future__ import annotations

from dtrain.swarm.library import TESTED_VERSIONS, UnsupportedHivemind, version_problem

_problem = version_problem()
if _problem:
    raise UnsupportedHivemind(_problem)

# Only once the release is known to be a tested one:
from dtrain.swarm.hivemind_internals.averager import (  # noqa: E402
    AVERAGER_WIRE_NAME,
    ROLE_OF_MODE,
    AveragerProcess,
    Group,
    MatchmakingException,
    install_state_server,
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
from dtrain.swarm.hivemind_internals.runner import ButterflyRunner, CountingStub  # noqa: E402
from dtrain.swarm.hivemind_internals.shims import (  # noqa: E402
    BlockwiseAbsmax8BitCompression,
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
    "AVERAGER_WIRE_NAME",
    "ROLE_OF_MODE",
    "TESTED_VERSIONS",
    "AveragerProcess",
    "BlockwiseAbsmax8BitCompression",
    "ButterflyRunner",
    "CountingStub",
    "DHTProcess",
    "Group",
    "MatchmakingException",
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
    "serialize_part",
    "shims_installed",
    "undeclare_in_background",
]
