"""Model-store calls under the shared retry policy (``dtrain.retry``), and the retryable/fatal split.

Retryable: HTTP 5xx, 408 and 429, connection errors, timeouts, and StoreError(retryable=True).
Fatal at once: 401/403 (credentials or permission), 404, other 4xx, programming errors.
Retrying a fatal error only delays the message the operator needs to see.
"""

from __future__ import annotations

import errno
import random
import sys
import time
from typing import Callable, TypeVar

from dtrain.hub.base import ProgressCallback, ProgressEvent, StoreError, emit, log
from dtrain.retry import RetryPolicy, retry

__all__ = ["HUB_RETRY", "RetryPolicy", "call_with_retries", "http_status", "is_retryable"]

T = TypeVar("T")

# Uploads are slow and Hub outages last minutes: start at 2 s, allow up to a minute, and
# keep the waits close to the schedule (+0/-25 %) so a push is not delayed needlessly.
HUB_RETRY = RetryPolicy(attempts=5, base_delay=2.0, max_delay=60.0, jitter=0.25)

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
    attempts = 0

    def counted() -> T:
        nonlocal attempts
        attempts += 1
        return fn()

    def on_retry(exc: BaseException, failures: int, wait: float) -> None:
        nice = translate(exc) if translate is not None else exc
        log.warning("%s failed (attempt %d/%d): %s; retrying in %.1fs", what, failures, policy.attempts, nice, wait)
        emit(progress, ProgressEvent("retry", attempt=failures, message=f"{what}: {nice}; retry in {wait:.1f}s"))

    try:
        return retry(counted, policy=policy, retryable=is_retryable, on_retry=on_retry, sleep=sleep, rng=rng)
    except Exception as exc:
        nice = translate(exc) if translate is not None else exc
        if not is_retryable(exc):
            if isinstance(nice, StoreError):
                nice.attempts = attempts
                raise nice from exc
            raise StoreError(f"{what} failed: {nice}", retryable=False, attempts=attempts) from exc
        raise StoreError(f"{what} failed after {attempts} attempts: {nice}", retryable=True,
                         attempts=attempts) from exc
