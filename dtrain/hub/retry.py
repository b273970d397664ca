"""Retries with exponential backoff and jitter, and the retryable/fatal split.

Retryable: HTTP 5xx, 408 and 429, connection errors, timeouts, and StoreError(retryable=True).
Fatal at once: 401/403 (credentials or permission), 404, other 4xx, programming errors.
Retrying a fatal error only delays the message the operator needs to see.
"""

from __future__ import annotations

import errno
import random
import sys
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

from dtrain.hub.base import ProgressCallback, ProgressEvent, StoreError, emit, log

T = TypeVar("T")

_RETRY_STATUS = {408, 429, 500, 502, 503, 504}
_NETWORK_ERRNOS = {
    errno.ECONNREFUSED,
    errno.ECONNRESET,
    errno.ECONNABORTED,
    errno.ETIMEDOUT,
    errno.EHOSTUNREACH,
    errno.ENETUNREACH,
    errno.ENETDOWN,
    errno.EPIPE,
}


@dataclass(frozen=True)
class RetryPolicy:
    """delay(n) = min(max_delay, base_delay * 2**(n-1)) * (1 + U(-jitter, +jitter))."""

    max_attempts: int = 5
    base_delay: float = 2.0
    max_delay: float = 60.0
    jitter: float = 0.25

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.base_delay < 0 or self.max_delay < 0 or not 0 <= self.jitter < 1:
            raise ValueError("delays must be >= 0 and jitter in [0, 1)")

    def delay(self, failures: int, rng: random.Random | None = None) -> float:
        """Seconds to wait after the ``failures``-th failed attempt (1-based)."""
        base = min(self.max_delay, self.base_delay * 2 ** max(0, failures - 1))
        if self.jitter:
            # Jitter spreads the retries of many miners that failed at the same moment
            # (a Hub outage) so they do not all come back in lockstep.
            base *= 1 + (rng or random).uniform(-self.jitter, self.jitter)
        return max(0.0, base)


def http_status(exc: BaseException) -> int | None:
    """Status code of an HTTP error from huggingface_hub/httpx/requests, if any."""
    resp = getattr(exc, "response", None)
    code = getattr(resp, "status_code", None)
    return code if isinstance(code, int) else None


def _is_network_error(exc: BaseException) -> bool:
    # huggingface_hub has used requests, httpx and (2.x) the httpx2 fork; match the
    # transport errors of whichever of them is installed, without depending on any.
    for modname, names in (
        ("httpx2", ("TransportError", "TimeoutException")),
        ("httpx", ("TransportError", "TimeoutException")),
        ("requests", ("ConnectionError", "Timeout")),
    ):
        mod = sys.modules.get(modname)
        if mod is None:
            continue
        classes = tuple(c for c in (getattr(mod, n, None) for n in names) if isinstance(c, type))
        if classes and isinstance(exc, classes):
            return True
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    return isinstance(exc, OSError) and exc.errno in _NETWORK_ERRNOS


def is_retryable(exc: BaseException) -> bool:
    if isinstance(exc, StoreError):
        return exc.retryable
    code = http_status(exc)
    if code is not None:
        return code in _RETRY_STATUS or code >= 500
    return _is_network_error(exc)


def call_with_retries(
    fn: Callable[[], T],
    *,
    what: str,
    policy: RetryPolicy,
    progress: ProgressCallback | None = None,
    sleep: Callable[[float], None] = time.sleep,
    rng: random.Random | None = None,
    translate: Callable[[BaseException], BaseException] | None = None,
) -> tuple[T, int]:
    """Run ``fn`` until it succeeds, a fatal error occurs, or attempts run out.

    Returns (result, attempts). ``translate`` turns a raw library error into a clearer
    StoreError (it is consulted for the message; retryability comes from the original).
    Raises StoreError whose ``attempts`` says how many tries were made.
    """
    attempt = 0
    while True:
        attempt += 1
        try:
            return fn(), attempt
        except BaseException as exc:  # noqa: BLE001 - classified below, re-raised if not ours
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            retryable = is_retryable(exc)
            nice = translate(exc) if translate is not None else exc
            if not retryable:
                if isinstance(nice, StoreError):
                    nice.attempts = attempt
                    raise nice from exc
                raise StoreError(f"{what} failed: {nice}", retryable=False, attempts=attempt) from exc
            if attempt >= policy.max_attempts:
                raise StoreError(
                    f"{what} failed after {attempt} attempts: {nice}", retryable=True, attempts=attempt
                ) from exc
            wait = policy.delay(attempt, rng)
            log.warning("%s failed (attempt %d/%d): %s; retrying in %.1fs", what, attempt, policy.max_attempts, nice, wait)
            emit(progress, ProgressEvent("retry", attempt=attempt, message=f"{what}: {nice}; retry in {wait:.1f}s"))
            sleep(wait)
