"""Bounded exponential backoff with jitter for chain calls.

Public chain endpoints drop connections and rate-limit; a validator that gives
up on the first error never sets weights, and one that retries without bound or
in lock-step with its peers makes the outage worse. So: capped exponential
delays, "full jitter" (uniform in [0, delay]), and a fixed number of attempts.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from typing import Callable, Optional, Tuple, Type, TypeVar

from dtrain.chain.base import ChainError, ChainHealth, ChainUnavailable

T = TypeVar("T")
log = logging.getLogger("dtrain.chain")


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 5  # total tries, first included
    base_delay: float = 0.5  # seconds before the first retry (before jitter)
    max_delay: float = 30.0  # cap for any single wait
    multiplier: float = 2.0

    def delay(self, retry_index: int, rng: random.Random) -> float:
        """Wait before retry number ``retry_index`` (0-based): full jitter."""
        ceiling = min(self.max_delay, self.base_delay * self.multiplier**retry_index)
        return rng.uniform(0.0, ceiling)


def retry_call(
    fn: Callable[[], T],
    *,
    policy: RetryPolicy = RetryPolicy(),
    retry_on: Tuple[Type[BaseException], ...] = (ChainUnavailable,),
    health: Optional[ChainHealth] = None,
    what: str = "chain call",
    sleep: Callable[[float], None] = time.sleep,
    rng: Optional[random.Random] = None,
) -> T:
    """Call ``fn`` until it succeeds or ``policy.attempts`` are used.

    Only exceptions in ``retry_on`` are retried; anything else (a rate limit,
    a missing permit) propagates at once because retrying cannot fix it. Each
    outcome is recorded in ``health`` so dashboards can show an outage. The
    last retryable error is re-raised when attempts run out.
    """
    rng = rng or random.Random()
    attempts = max(1, int(policy.attempts))
    for attempt in range(attempts):
        try:
            result = fn()
        except retry_on as exc:
            if health is not None:
                health.record_error(exc)
            if attempt == attempts - 1:
                log.warning("%s failed after %d attempts: %s", what, attempts, exc)
                raise
            wait = policy.delay(attempt, rng)
            log.info("%s failed (%s); retry %d/%d in %.2fs", what, exc, attempt + 1, attempts - 1, wait)
            sleep(wait)
        except ChainError as exc:
            # Non-retryable chain answers (rate limit, permit) still mean the
            # chain was reachable; don't count them as an outage.
            if health is not None:
                if isinstance(exc, ChainUnavailable):
                    health.record_error(exc)
                else:
                    health.record_ok()
            raise
        else:
            if health is not None:
                health.record_ok()
            return result
    raise AssertionError("unreachable")  # pragma: no cover
