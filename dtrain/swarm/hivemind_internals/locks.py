"""Cross-process locks that a process killed while holding one does not leave locked.

hivemind guards its MPFutures with three ``multiprocessing.Lock`` objects made at import
(``MPFuture._initialization_lock``, ``MPFuture._update_lock``, ``SharedBytes._lock``) and
shared by a neuron and every process it forks: the DHT and averager processes. Every MPFuture
created takes ``SharedBytes._lock``, and every result sent to another process takes
``_update_lock``. A DHT or averager process killed (OOM killer, SIGKILL) in the moment it held
one left it locked for ever: the neuron's next DHT call, and every process forked after,
waited on it, and restarting the swarm node could not help (its new processes inherit the
same lock). A test suite run that killed a DHT process hung that way in later tests.

:class:`SurvivableLock` is such a lock that also records its holder's pid in shared memory.
A waiter that cannot take it within a second looks at the holder: if that process is gone
(or a zombie), the waiter releases the dead holder's lock and takes it. Waiting is otherwise
unchanged: a live holder is waited for, however long it holds the lock, and a release wakes
a waiter at once. What is left: a process killed between taking the lock and writing its pid
(a few instructions), and a second, short-held guard that serialises takeovers.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import time

logger = logging.getLogger(__name__)

# How often a blocked waiter looks whether the holder still lives.
HOLDER_CHECK_S = 1.0


def process_gone(pid: int) -> bool:
    """Whether ``pid`` is no longer a running process (exited, or a zombie not reaped yet)."""
    if os.path.exists("/proc/self/stat"):  # Linux: a zombie still exists for kill(pid, 0)
        try:
            with open(f"/proc/{pid}/stat", "rb") as fh:
                state = fh.read().rsplit(b")", 1)[1].split()[0]
            return state in (b"Z", b"X")
        except FileNotFoundError:
            return True
        except (OSError, IndexError):
            pass
    try:  # elsewhere (or an unreadable stat): ask the kernel whether the pid exists
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


class SurvivableLock:
    """A ``multiprocessing.Lock`` that is taken over when its holder process died holding it."""

    def __init__(self) -> None:
        self._lock = mp.Lock()
        self._guard = mp.Lock()  # held only to take a dead holder's lock over
        self._holder = mp.RawValue("i", 0)  # pid of the process that holds _lock, 0 if none
        self.takeovers = mp.RawValue("i", 0)  # how many times a dead holder's lock was taken

    def acquire(self, block: bool = True, timeout: float | None = None) -> bool:
        deadline = None if timeout is None or timeout < 0 else time.monotonic() + timeout
        while True:
            wait = HOLDER_CHECK_S if block else 0
            if deadline is not None:
                wait = max(0.0, min(wait, deadline - time.monotonic()))
            if self._lock.acquire(block=wait > 0, timeout=wait if wait > 0 else None):
                self._holder.value = os.getpid()
                return True
            self._take_over_from_the_dead()
            if not block or (deadline is not None and time.monotonic() >= deadline):
                return False

    def _take_over_from_the_dead(self) -> None:
        holder = self._holder.value
        if not holder or holder == os.getpid() or not process_gone(holder):
            return
        if not self._guard.acquire(timeout=HOLDER_CHECK_S):
            return
        try:
            # another waiter may have taken it over (and may hold it now) since we looked
            if self._holder.value == holder:
                self._holder.value = 0
                self.takeovers.value += 1
                self._lock.release()  # the dead holder's; the next acquire takes it
                logger.warning("swarm: process %d died holding a hivemind lock; taking it over", holder)
        finally:
            self._guard.release()

    def release(self) -> None:
        self._holder.value = 0
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def install_survivable_locks() -> None:
    """Give hivemind's MPFuture machinery survivable locks (idempotent).

    Must run before the DHT and averager processes are forked, so that they share these; the
    wall calls it at import (dtrain/swarm/hivemind_internals/__init__.py)."""
    from hivemind.utils.mpfuture import MPFuture, SharedBytes

    for owner, name in ((MPFuture, "_initialization_lock"), (MPFuture, "_update_lock"), (SharedBytes, "_lock")):
        if not isinstance(getattr(owner, name), SurvivableLock):
            setattr(owner, name, SurvivableLock())
