"""The one retry policy the chain and the model store share (dtrain.retry)."""

from __future__ import annotations

import random

import pytest

from dtrain.retry import RetryPolicy, retry


def test_schedule_doubles_up_to_the_cap_without_jitter():
    p = RetryPolicy(attempts=10, base_delay=1, max_delay=5, jitter=0)
    assert [p.delay(n) for n in range(1, 6)] == [1, 2, 4, 5, 5]


@pytest.mark.parametrize("jitter, low", [(1.0, 0.0), (0.25, 3.0)])
def test_jitter_stays_below_the_ceiling_and_spreads(jitter, low):
    p = RetryPolicy(base_delay=4, max_delay=60, jitter=jitter)
    rng = random.Random(3)
    delays = [p.delay(1, rng) for _ in range(200)]
    assert all(low <= d <= 4.0 for d in delays)
    assert len(set(delays)) > 100  # spread apart: many nodes do not retry in lock-step


def test_bad_policies_are_refused():
    for bad in (dict(attempts=0), dict(base_delay=-1), dict(jitter=1.5)):
        with pytest.raises(ValueError):
            RetryPolicy(**bad)


def test_retries_retryable_errors_and_counts_attempts():
    seen, waits = [], []
    outcomes = [ConnectionError("a"), ConnectionError("b"), "done"]

    def fn():
        x = outcomes.pop(0)
        if isinstance(x, Exception):
            raise x
        return x

    result = retry(fn, policy=RetryPolicy(attempts=5, base_delay=1, jitter=0),
                   retryable=lambda e: isinstance(e, ConnectionError),
                   on_retry=lambda e, n, w: seen.append((str(e), n, w)), sleep=waits.append)
    assert result == ("done", 3)
    assert seen == [("a", 1, 1.0), ("b", 2, 2.0)] and waits == [1.0, 2.0]


def test_last_and_fatal_errors_propagate_unchanged():
    calls = []

    def down():
        calls.append(1)
        raise ConnectionError("still down")

    with pytest.raises(ConnectionError, match="still down"):
        retry(down, policy=RetryPolicy(attempts=3, jitter=0), retryable=lambda e: True, sleep=lambda s: None)
    assert len(calls) == 3

    calls.clear()

    def bug():
        calls.append(1)
        raise KeyError("x")

    with pytest.raises(KeyError):
        retry(bug, policy=RetryPolicy(attempts=3), retryable=lambda e: isinstance(e, ConnectionError),
              sleep=lambda s: None)
    assert len(calls) == 1


def test_interrupts_are_never_retried():
    calls = []

    def interrupted():
        calls.append(1)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        retry(interrupted, policy=RetryPolicy(attempts=5), retryable=lambda e: True, sleep=lambda s: None)
    assert len(calls) == 1
