"""Bounded exponential backoff with jitter, and the health record it keeps."""

from __future__ import annotations

import random

import pytest

from dtrain.chain.base import ChainHealth, ChainUnavailable, RateLimited
from dtrain.chain.retry import RetryPolicy, retry_call


def test_retries_then_succeeds_with_bounded_jittered_delays():
    sleeps: list[float] = []
    calls = {"n": 0}
    health = ChainHealth()

    def flaky():
        calls["n"] += 1
        if calls["n"] < 4:
            raise ChainUnavailable(f"down {calls['n']}")
        return "ok"

    policy = RetryPolicy(attempts=5, base_delay=1.0, max_delay=3.0)
    assert retry_call(flaky, policy=policy, health=health, sleep=sleeps.append, rng=random.Random(1)) == "ok"
    assert calls["n"] == 4 and len(sleeps) == 3
    ceilings = [1.0, 2.0, 3.0]  # 1, 2, then capped at max_delay
    assert all(0.0 <= s <= c for s, c in zip(sleeps, ceilings))
    assert health.ok and health.last_error == "down 3"


def test_gives_up_after_attempts_and_reraises():
    health = ChainHealth()
    calls = {"n": 0}

    def down():
        calls["n"] += 1
        raise ChainUnavailable("unreachable")

    with pytest.raises(ChainUnavailable, match="unreachable"):
        retry_call(down, policy=RetryPolicy(attempts=3), health=health, sleep=lambda _s: None)
    assert calls["n"] == 3
    assert health.snapshot()["consecutive_failures"] == 3 and not health.ok


def test_non_retryable_errors_propagate_immediately():
    calls = {"n": 0}
    health = ChainHealth()

    def limited():
        calls["n"] += 1
        raise RateLimited("wait", blocks_remaining=3)

    with pytest.raises(RateLimited):
        retry_call(limited, policy=RetryPolicy(attempts=5), health=health, sleep=lambda _s: None)
    assert calls["n"] == 1
    assert health.ok  # the chain answered; not an outage

    def bug():
        raise KeyError("x")

    with pytest.raises(KeyError):
        retry_call(bug, sleep=lambda _s: None)

