"""Chain calls under the shared retry policy (``dtrain.retry``), recording the chain's health.

Public chain endpoints drop connections and rate-limit. Only ``ChainUnavailable`` (the
chain could not be reached) is retried; any other ``ChainError`` (a rate limit, a
missing permit) propagates at once because retrying cannot fix it, and anything that
is not a ``ChainError`` is a bug and propagates untouched. Each outcome is recorded in
the backend's ``ChainHealth``, the one place chain health lives.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Callable, Optional, TypeVar

from dtrain.chain.base import ChainError, ChainHealth, ChainUnavailable
from dtrain.retry import RetryPolicy, retry

T = TypeVar("T")
log = logging.getLogger("dtrain.chain")

__all__ = ["RetryPolicy", "retry_call"]


def retry_call(
    fn: Callable[[], T],
    *,
    policy: RetryPolicy = RetryPolicy(),
    health: Optional[ChainHealth] = None,
    what: str = "chain call",
    sleep: Callable[[float], None] = time.sleep,
    rng: Optional[random.Random] = None,
) -> T:
    """Call ``fn`` until it succeeds or ``policy.attempts`` are used; re-raise the last error."""

    def attempt() -> T:
        try:
            result = fn()
        except ChainUnavailable as exc:
            if health is not None:
                health.record_error(exc)
            raise
        except ChainError:
            # A chain that answers "no" (rate limit, permit) was reachable: not an outage.
            if health is not None:
                health.record_ok()
            raise
        if health is not None:
            health.record_ok()
        return result

    def on_retry(exc: BaseException, failures: int, wait: float) -> None:
        log.info("%s failed (%s); retry %d/%d in %.2fs", what, exc, failures, policy.attempts - 1, wait)

    try:
        result, _ = retry(attempt, policy=policy, retryable=lambda e: isinstance(e, ChainUnavailable),
                          on_retry=on_retry, sleep=sleep, rng=rng)
    except ChainUnavailable as exc:
        log.warning("%s failed after %d attempts: %s", what, policy.attempts, exc)
        raise
    return result
