"""Which hivemind dtrain's swarm runs on, checked without importing it.

dtrain reaches into hivemind's internals (dtrain/swarm/hivemind_internals/, the one package
that does), so a hivemind release other than the one the tests ran on may change a private
method and break a round in ways no import error shows: a peer that still matchmakes but
bans every sender, say. Refusing to start on an untested release is cheaper than that.

Nothing here imports hivemind: the CLI and the neurons call :func:`check_swarm_library`
before they start anything heavy, and ``dtrain --help`` stays fast.
"""

from __future__ import annotations

import importlib.metadata
import re
from typing import Optional

# (lowest, highest) hivemind release the test suite ran on; both inclusive.
TESTED_VERSIONS = ("1.1.12", "1.1.12")
DISTRIBUTION = "hivemind"


class UnsupportedHivemind(ImportError):
    """The installed hivemind is missing or a release dtrain was not tested with."""


def _release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: "1.1.12" -> (1, 1, 12), "1.2.0rc1" -> (1, 2, 0)."""
    out = []
    for piece in version.split("."):
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        out.append(int(digits))
        if len(digits) != len(piece):
            break  # a suffix such as rc1 or .dev0 ends the release
    return tuple(out)


def supported_range() -> str:
    low, high = TESTED_VERSIONS
    return low if low == high else f"{low} to {high}"


def fix_command() -> str:
    low, high = TESTED_VERSIONS
    return f"pip install '{DISTRIBUTION}=={high}'" if low == high else \
        f"pip install '{DISTRIBUTION}>={low},<={high}'"


def version_problem() -> Optional[str]:
    """Why the installed hivemind cannot be used (None when it is a tested release)."""
    try:
        installed = importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return f"hivemind is not installed; dtrain's swarm needs hivemind {supported_range()}. Fix: {fix_command()}"
    low, high = (_release(v) for v in TESTED_VERSIONS)
    release = _release(installed)
    # a pre-release of a tested release is not that release ("1.1.12rc1", "1.1.12.dev0"); a
    # post-release (packaging fixes only) or a local build label is
    final = re.search(r"(a|b|c|rc|alpha|beta|pre|preview|dev)\d*", installed.lower().split("+")[0]) is None
    if release and final and low <= release[:len(low)] <= high:
        return None
    return (f"hivemind {installed} is installed, but dtrain's swarm is tested with hivemind {supported_range()} "
            f"only (it relies on hivemind internals that change between releases). Fix: {fix_command()}")


def check_swarm_library() -> None:
    """Raise :class:`UnsupportedHivemind` with the fix when the installed hivemind is not a tested one."""
    problem = version_problem()
    if problem:
        raise UnsupportedHivemind(problem)
