"""Bounded retries with exponential backoff and jitter: one policy for the chain and the model store.

A service that gives up on the first error never sets weights or pushes a model; one
that retries without bound, or in lock-step with every other node after a shared
outage, makes the outage worse. So: a fixed number of attempts, waits that double up
to a cap, and jitter that spreads the retries of many nodes apart.

Callers decide what is worth retrying (``retryable``) and what to record on each
failure (``on_retry``); this module only counts, waits and re-raises.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """``attempts`` tries in total; after the n-th failure wait ``delay(n)``.

    ``delay(n) = min(max_delay, base_delay * 2**(n-1)) * (1 - jitter * U[0, 1))``: ``jitter``
    is the share of each wait drawn at random (1.0 is "full jitter", uniform in [0, ceiling];
    0 is a fixed schedule). Waits never exceed ``max_delay``.
    """

    attempts: int = 5
    base_delay: float = 1.0
    max_delay: float = 30.0
    jitter: float = 1.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {self.attempts}")
        if self.base_delay < 0 or self.max_delay < 0:
            raise ValueError("base_delay and max_delay must be >= 0")
        if not 0.0 <= self.jitter <= 1.0:
            raise ValueError(f"jitter must be in [0, 1], got {self.jitter}")

    def delay(self, failures: int, rng: random.Random | None = None) -> float:
        """Seconds to wait after the ``failures``-th failed attempt (1-based)."""
        # the exponent is capped so that a caller retrying for hours (a neuron waiting for its
        # data) never overflows a float; 2**60 is past any max_delay anyway
        ceiling = min(self.max_delay, self.base_delay * 2 ** min(60, max(0, failures - 1)))
        if self.jitter:
            ceiling *= 1.0 - self.jitter * (rng or random).random()
        return max(0.0, ceiling)


def retry(
    fn: Callable[[], T],
    *,
    policy: RetryPolicy,
    retryable: Callable[[BaseException], bool],
    on_retry: Callable[[BaseException, int, float], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
    rng: random.Random | None = None,
) -> tuple[T, int]:
    """Call ``fn`` until it returns; returns ``(result, attempts used)``.

    An exception that is not ``retryable``, or the last attempt's, propagates unchanged.
    ``on_retry(error, failures, wait)`` runs before each wait. KeyboardInterrupt and
    SystemExit are never retried.
    """
    failures = 0
    while True:
        try:
            return fn(), failures + 1
        except Exception as exc:
            failures += 1
            if failures >= policy.attempts or not retryable(exc):
                raise
            wait = policy.delay(failures, rng)
            if on_retry is not None:
                on_retry(exc, failures, wait)
            sleep(wait)
