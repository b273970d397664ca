"""Waiting for hivemind's background processes to start, without waiting forever.

hivemind forks a process for the DHT and one for each averager, and the parent then waits for
a "ready" future with no time limit. If the child dies first (an exception outside hivemind's
own try block, a signal, the kernel refusing a thread), nobody ever sets that future: the
parent waits forever, with no CPU use and no message. If the child hangs (a peer process it
must talk to is stuck), the parent waits forever as well. A neuron that hangs at start is
worse than one that stops with a reason, so the wait here notices a dead child within a
second and gives a live one a bounded time, then shows where it was stuck and stops it.
"""

from __future__ import annotations

import concurrent.futures
import faulthandler
import logging
import os
import signal
import time
from typing import Callable, Optional

logger = logging.getLogger(__name__)

# An averager is ready in under a second on an idle machine and in a few seconds on a loaded
# 2-core one. A child that is alive but not ready after this long is stuck, not slow.
START_TIMEOUT_S = 120.0
POLL_S = 0.5
# How long the child gets to write its stacks (SIGUSR1) before it is killed.
_DUMP_GRACE_S = 1.0
STACK_DUMP_SIGNAL = signal.SIGUSR1


class ProcessStartError(RuntimeError):
    """A hivemind background process died or hung before it was ready."""


def enable_stack_dumps() -> None:
    """In a child process: write every thread's stack to stderr on SIGUSR1.

    Called first thing in each child, so a stuck start (or an operator's ``kill -USR1 <pid>``)
    shows where the process is waiting. faulthandler writes from a C-level handler, so it
    works even when every Python thread is blocked.
    """
    try:
        faulthandler.register(STACK_DUMP_SIGNAL, all_threads=True, chain=False)
    except (AttributeError, ValueError, RuntimeError, OSError):  # no SIGUSR1 or no usable stderr
        pass


def await_ready(process, wait_until_ready: Callable[[float], None], what: str,
                limit_s: float = START_TIMEOUT_S, explain: Optional[Callable[[], str]] = None) -> None:
    """Wait until ``process`` (a started multiprocessing.Process) reports ready, at most ``limit_s``.

    ``wait_until_ready(timeout)`` is hivemind's own wait: it returns once the child is ready,
    re-raises the child's start-up exception, and raises TimeoutError when ``timeout`` passes.
    Raises ProcessStartError, naming ``what``, when the child exits first or is still not
    ready at the limit; in the second case its stacks go to stderr and it is killed.
    ``explain()`` adds what the caller knows (the averager: whether its DHT process runs).
    """
    def extra() -> str:
        return f"; {explain()}" if explain is not None else ""

    deadline = time.monotonic() + limit_s
    while True:
        try:
            wait_until_ready(max(0.01, min(POLL_S, deadline - time.monotonic())))
            return
        except concurrent.futures.TimeoutError:  # builtin TimeoutError from 3.11 on
            pass
        if not process.is_alive():
            # The child may have said "ready" just before it exited; that reply is in flight.
            try:
                wait_until_ready(POLL_S)
                return
            except concurrent.futures.TimeoutError:
                pass
            raise ProcessStartError(
                f"the {what} process (pid {process.pid}) exited with code {process.exitcode} before it was "
                f"ready; its own error, if it printed one, is on stderr above{extra()}"
            )
        if time.monotonic() >= deadline:
            why = extra()  # before the kill: the caller may look at processes this one uses
            _dump_stacks_then_kill(process, what)
            raise ProcessStartError(
                f"the {what} process (pid {process.pid}) was not ready after {limit_s:.0f} s and was stopped; "
                f"its thread stacks are on stderr above{why}"
            )


def _dump_stacks_then_kill(process, what: str) -> None:
    pid = process.pid
    logger.error("swarm: the %s process (pid %s) is stuck at start; dumping its stacks to stderr", what, pid)
    try:
        os.kill(pid, STACK_DUMP_SIGNAL)
        time.sleep(_DUMP_GRACE_S)
    except (ProcessLookupError, PermissionError):
        pass
    process.kill()
    process.join(5.0)
