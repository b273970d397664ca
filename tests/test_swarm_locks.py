"""hivemind's cross-process MPFuture locks survive a process killed while holding one
(dtrain/swarm/hivemind_internals/locks.py). Real forked processes, real SIGKILL."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest

from dtrain.swarm import hivemind_internals  # noqa: F401  (installs the locks, as a neuron does)
from dtrain.swarm.hivemind_internals.locks import SurvivableLock, process_gone

fork = mp.get_context("fork")


def _hold(lock, held, seconds):
    lock.acquire()
    held.set()
    time.sleep(seconds)
    lock.release()


def _holder(lock, seconds=600):
    held = fork.Event()
    child = fork.Process(target=_hold, args=(lock, held, seconds), daemon=True)
    child.start()
    assert held.wait(30)
    return child


def test_a_lock_whose_holder_was_killed_is_taken_over():
    lock = SurvivableLock()
    child = _holder(lock)
    os.kill(child.pid, signal.SIGKILL)
    time.sleep(0.2)
    assert process_gone(child.pid)  # a zombie: killed, not reaped yet, still "gone"
    started = time.monotonic()
    assert lock.acquire(timeout=30)  # a plain multiprocessing.Lock would wait for ever here
    assert time.monotonic() - started < 10
    assert lock.takeovers.value == 1
    lock.release()
    child.join(5)
    with lock:  # and it works as a lock afterwards
        assert not lock.acquire(block=False)


def test_a_live_holder_is_waited_for_not_overtaken():
    lock = SurvivableLock()
    child = _holder(lock, seconds=4)
    assert not lock.acquire(timeout=2.5)  # it lives: no takeover, however long it holds
    assert lock.acquire(timeout=30)  # released by its holder: taken at once
    lock.release()
    child.join(10)
    assert lock.takeovers.value == 0


@pytest.mark.parametrize("name", ["SharedBytes._lock", "MPFuture._update_lock"])
def test_hivemind_goes_on_after_a_process_died_holding_its_lock(name):
    from hivemind.utils.mpfuture import MPFuture, SharedBytes

    owner, attribute = name.split(".")
    lock = getattr({"SharedBytes": SharedBytes, "MPFuture": MPFuture}[owner], attribute)
    assert isinstance(lock, SurvivableLock)
    child = _holder(lock)
    os.kill(child.pid, signal.SIGKILL)
    future = MPFuture()  # takes SharedBytes._lock
    future.set_result(7)
    assert future.result(timeout=30) == 7
    other = MPFuture()
    sender = fork.Process(target=other.set_result, args=(11,))  # sends through _update_lock
    sender.start()
    assert other.result(timeout=30) == 11
    sender.join(10)
    child.join(5)


def test_process_gone():
    assert not process_gone(os.getpid())
    child = fork.Process(target=time.sleep, args=(0,))
    child.start()
    child.join(10)  # reaped: the pid no longer exists
    assert process_gone(child.pid)
