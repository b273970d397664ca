"""``ValidatorPermits``: the miner API's ``is_allowed`` callable, backed by a Chain.

Checking the chain on every request would make each validator call a chain
round-trip and let request floods hammer the node, so the permitted set is
cached and refreshed every ``refresh_s``. During a chain outage the last
known set keeps serving (validators keep working); only if it was never loaded
does the check raise, which the API turns into 503.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

from dtrain.chain.base import Chain, ChainError

log = logging.getLogger("dtrain.chain")


class ValidatorPermits:
    """Callable ``(hotkey) -> bool``: does ``hotkey`` hold a validator permit
    (and at least ``min_stake``) on this chain? Thread-safe."""

    def __init__(
        self,
        chain: Chain,
        *,
        refresh_s: float = 60.0,
        min_stake: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.chain = chain
        self.refresh_s = float(refresh_s)
        self.min_stake = float(min_stake)
        self._clock = clock
        self._lock = threading.Lock()
        self._allowed: Optional[frozenset[str]] = None
        self._loaded_at = float("-inf")

    def refresh(self) -> frozenset[str]:
        allowed = frozenset(
            n.hotkey for n in self.chain.neurons() if n.validator_permit and n.stake >= self.min_stake
        )
        with self._lock:
            self._allowed = allowed
            self._loaded_at = self._clock()
        return allowed

    def __call__(self, hotkey: str) -> bool:
        with self._lock:
            allowed, fresh = self._allowed, self._clock() - self._loaded_at < self.refresh_s
        if allowed is None or not fresh:
            try:
                allowed = self.refresh()
            except ChainError as exc:
                if allowed is None:
                    raise
                log.warning("validator permits not refreshed (%s); using the last known set", exc)
                with self._lock:
                    # Back off a full period instead of retrying on every request.
                    self._loaded_at = self._clock()
        return hotkey in allowed
