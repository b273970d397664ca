"""Waiting for the averager process: a wait a stop event ends, and one a dead process ends."""

from __future__ import annotations

import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable, Optional


class Interrupted(Exception):
    """A wait was abandoned because the caller's stop event was set."""


class NoAnswer(FutureTimeout):
    """A wait ran out of its own time (not the future's own timeout error)."""


# How often a blocked wait looks at its stop event: short enough that SIGINT ends a neuron
# promptly, long enough to cost nothing.
_STOP_POLL_S = 0.25


def wait_unless_stopped(future, stop: Optional[threading.Event], timeout_s: Optional[float] = None,
                        alive: Optional[Callable[[], bool]] = None):
    """``future.result(timeout_s)``, but cancel the future and raise :class:`Interrupted` once ``stop`` is set
    (hivemind's futures block in a lock a signal does not wake: SIGINT must still end a neuron promptly).

    Past ``timeout_s`` it cancels the future and raises :class:`NoAnswer` (a
    ``concurrent.futures.TimeoutError`` callers can tell from the future's own); with ``alive``
    (whether the process that owes the answer still runs), a dead one ends the wait at once.
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        if stop is not None and stop.is_set():
            future.cancel()
            raise Interrupted("stopped while waiting for the swarm")
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            future.cancel()
            raise NoAnswer(f"no answer within {timeout_s:g} s")
        wait_s = _STOP_POLL_S if remaining is None else min(_STOP_POLL_S, remaining)
        try:
            return future.result(timeout=wait_s)
        except FutureTimeout:
            if future.done():  # the future's own outcome is a timeout (Python 3.11: one class)
                raise
        if alive is not None and not future.done() and not alive():
            future.cancel()
            raise NoAnswer("the process that owed the answer is not running")
