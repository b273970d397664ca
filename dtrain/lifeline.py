"""A neuron that outlives its supervisor stops: the lifeline pipe.

A supervisor (``dtrain sandbox``) passes each neuron the read end of a pipe whose write end only
the supervisor holds, and names its descriptor in ``DTRAIN_LIFELINE_FD``. When the supervisor
dies, however it dies (``kill -9`` included), the kernel closes the write end and the read
returns end-of-file: the neuron then stops as on SIGINT (checkpoint, DHT left), and if it is
still running ``grace_s`` later it kills its whole process group (its hivemind processes and
p2pd with it), so nothing the supervisor started is left running.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Callable, Mapping, Optional

logger = logging.getLogger(__name__)

LIFELINE_ENV = "DTRAIN_LIFELINE_FD"
# How long a neuron whose supervisor died gets to stop cleanly before its group is killed: a
# sandbox neuron stops in a few seconds; this bounds one stuck in a round or a download.
GRACE_S = 20.0


def lifeline_fd(env: Mapping[str, str] | None = None) -> Optional[int]:
    """The lifeline descriptor named in the environment, or None when there is none.

    A value that is not a descriptor number, or names no open descriptor, is a ValueError that
    names the variable: a supervisor that means to hold the neuron's life must not be ignored."""
    raw = (os.environ if env is None else env).get(LIFELINE_ENV, "").strip()
    if not raw:
        return None
    try:
        fd = int(raw)
        if fd < 0:
            raise ValueError
    except ValueError:
        raise ValueError(f"{LIFELINE_ENV} must be a file descriptor number, got {raw!r}") from None
    try:
        os.fstat(fd)
    except OSError:
        raise ValueError(f"{LIFELINE_ENV}={fd} names no open file descriptor") from None
    return fd


def watch_lifeline(fd: int, on_lost: Callable[[], None], grace_s: float = GRACE_S) -> threading.Thread:
    """Start a daemon thread that waits on ``fd``; at end-of-file (or a read error) it calls
    ``on_lost()`` and, ``grace_s`` later, kills this process's group if the process still runs."""

    def wait() -> None:
        try:
            while os.read(fd, 4096):
                pass  # the supervisor never writes; anything it does write is not a reason to stop
        except OSError as exc:
            logger.warning("lifeline: reading descriptor %d failed (%s); stopping", fd, exc)
        logger.warning("lifeline: the supervisor is gone; stopping")
        try:
            on_lost()
        except Exception:  # the hard stop below must happen whatever the clean stop did
            logger.exception("lifeline: the clean stop failed")
        time.sleep(grace_s)
        logger.warning("lifeline: still running %g s after the supervisor died; killing the process group", grace_s)
        kill_own_group()

    thread = threading.Thread(target=wait, name="dtrain-lifeline", daemon=True)
    thread.start()
    return thread


def kill_own_group() -> None:
    """SIGKILL this process's group when this process leads it (a supervisor started it in a
    session of its own), else this process alone: never a group this process did not start."""
    if os.getpgrp() == os.getpid():
        os.killpg(os.getpgrp(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)
