"""The ``Chain`` protocol every backend answers, and the types it speaks.

Core code (miner, validator, status) is written against this protocol only, so
the embedded sandbox and the real subtensor chain are interchangeable.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol, Sequence, runtime_checkable

from dtrain import __version__
from dtrain.chain.commitment import MinerCommitment


def spec_version(version: str) -> int:
    """``major*10000 + minor*100 + patch``: the integer version dtrain sends as ``version_key``.

    Bittensor subnet templates use ``1000*major + 10*minor + patch``, which stops growing
    monotonically at patch 10 (0.1.10 and 0.2.0 both give 20); two digits per part keep
    every release above the one before (patch and minor below 100). Pre-release suffixes
    are ignored: ``"1.2.3rc1"`` → 10203. bittensor 11 itself defines no spec version."""
    parts = []
    for piece in version.split(".")[:3]:
        digits = ""
        for char in piece:
            if not char.isdigit():
                break
            digits += char
        parts.append(int(digits or 0))
    major, minor, patch = (parts + [0, 0, 0])[:3]
    return 10000 * major + 100 * minor + min(patch, 99)


# dtrain's own weights version (0.1.0 → 100).
SPEC_VERSION = spec_version(__version__)


def choose_version_key(required: Optional[int]) -> int:
    """The ``version_key`` dtrain sends with ``set_weights``: its own :data:`SPEC_VERSION`.

    The chain refuses weights whose ``version_key`` is below the subnet's
    ``weights_version`` hyperparameter (``WeightsVersionKey``; 0 disables the check) with
    ``IncorrectWeightVersionKey``. That is the subnet owner's lever to shut out validators
    running outdated code, so dtrain never echoes a higher requirement back: when the
    subnet asks for more than this dtrain is, :class:`OutdatedValidator` says to upgrade
    (before an extrinsic the chain would refuse anyway). ``required`` None (the
    hyperparameter could not be read) or 0 sends :data:`SPEC_VERSION`.
    """
    if required is not None and required > SPEC_VERSION:
        raise OutdatedValidator(
            f"the subnet requires weights_version {required}, newer than this dtrain "
            f"({__version__}, spec version {SPEC_VERSION}): upgrade dtrain (pip install -U dtrain). "
            "The chain refuses weights from older validators.")
    return SPEC_VERSION


class ChainError(Exception):
    """Any failure of the chain layer that a caller can act on."""


class ChainUnavailable(ChainError):
    """The chain could not be reached (after bounded retries)."""


class OutdatedValidator(ChainError):
    """The subnet's ``weights_version`` is newer than this dtrain: upgrade to set weights."""


class ChainClientBug(Exception):
    """The chain SDK raised a programming error (TypeError, AttributeError, ...).

    Deliberately *not* a :class:`ChainError`: callers that ride out chain outages
    (catching ``ChainError``) must not swallow it, and the retry layer must not retry
    it, because it is a bug in dtrain or an SDK version dtrain does not support, and
    waiting cannot fix it. The original exception is chained as ``__cause__``.
    """


class UnknownNetwork(ChainError):
    """The network name is none of sandbox/finney/test/local/ws(s)://."""


class SandboxMissing(ChainError):
    """The sandbox directory (or its database) does not exist."""


class NotRegistered(ChainError):
    """The hotkey has no uid on this subnet."""


class NotPermitted(ChainError):
    """The hotkey may not do this (e.g. set weights without a validator permit)."""


class RateLimited(ChainError):
    """Weights were set too recently; ``blocks_remaining`` says how long to wait."""

    def __init__(self, message: str, blocks_remaining: int = 0):
        super().__init__(message)
        self.blocks_remaining = blocks_remaining


@dataclass(frozen=True)
class Neuron:
    """One registered neuron as the core sees it.

    ``stake`` is in whole units (rao / 1e9): the subnet's alpha on a real chain.
    """

    uid: int
    hotkey: str
    coldkey: Optional[str]
    stake: float
    validator_permit: bool


@dataclass(frozen=True)
class WeightsStatus:
    """What a validator needs to pace weight setting."""

    block: int
    rate_limit: Optional[int]  # blocks between sets; None when the backend cannot tell
    last_set_block: Optional[int]  # None when never set or unknown

    @property
    def blocks_until_allowed(self) -> int:
        if not self.rate_limit or self.last_set_block is None:
            return 0
        return max(0, self.last_set_block + self.rate_limit - self.block)


@dataclass
class ChainHealth:
    """The one record of whether the chain answers: every backend call updates it
    (``dtrain.chain.retry``), and neurons mirror it into their telemetry through
    ``subscribe`` (dashboard, logs, ``dtrain_chain_up``).

    Thread-safe: the miner's API thread and its main loop may both touch it.
    """

    last_ok: Optional[float] = None
    last_error: Optional[str] = None
    last_error_at: Optional[float] = None
    consecutive_failures: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    _listeners: list = field(default_factory=list, repr=False, compare=False)

    def subscribe(self, listener: Callable[[bool, str], None]) -> None:
        """``listener(ok, detail)`` runs after every recorded call; it must be quick."""
        self._listeners.append(listener)

    def _notify(self, ok: bool, detail: str) -> None:
        for listener in list(self._listeners):
            try:
                listener(ok, detail)
            except Exception:  # a broken display must never fail a chain call
                pass

    def record_ok(self) -> None:
        with self._lock:
            self.last_ok = time.time()
            self.consecutive_failures = 0
        self._notify(True, "")

    def record_error(self, error: BaseException | str) -> None:
        with self._lock:
            self.last_error = str(error) or type(error).__name__
            self.last_error_at = time.time()
            self.consecutive_failures += 1
            detail = self.last_error
        self._notify(False, detail)

    @property
    def ok(self) -> bool:
        """True when the last call succeeded (or none failed yet)."""
        return self.consecutive_failures == 0

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "ok": self.consecutive_failures == 0,
                "last_ok": self.last_ok,
                "last_error": self.last_error,
                "last_error_at": self.last_error_at,
                "consecutive_failures": self.consecutive_failures,
            }


@runtime_checkable
class Chain(Protocol):
    """What the core needs from a chain. Methods are synchronous and may raise
    :class:`ChainError` (``ChainUnavailable`` after retries are exhausted)."""

    network: str
    netuid: int
    health: ChainHealth

    def block(self) -> int:
        """Current block number."""
        ...

    def neurons(self) -> list[Neuron]:
        """Every registered neuron, sorted by uid."""
        ...

    def commitments(self) -> dict[str, MinerCommitment]:
        """Each hotkey's parsed commitment; malformed ones are logged and skipped."""
        ...

    def commit(self, record: MinerCommitment) -> bool:
        """Publish this node's own commitment (signed by its hotkey).
        Returns False without writing when the chain already holds it."""
        ...

    def set_weights(
        self, uids: Sequence[int], weights: Sequence[float], *, version_key: Optional[int] = None
    ) -> None:
        """Set this validator's weights; retried on transient failure.
        ``version_key`` None: the backend picks it (:func:`choose_version_key` over the
        subnet's ``weights_version``). Raises RateLimited / NotPermitted / NotRegistered
        without retrying."""
        ...

    def weights(self) -> dict[int, dict[int, float]]:
        """``{validator_uid: {miner_uid: fraction}}``, rows normalised to sum 1."""
        ...

    def weights_status(self, uid: Optional[int] = None) -> WeightsStatus:
        """Rate limit and last-set block for ``uid`` (default: this node's uid)."""
        ...

    def close(self) -> None:
        ...
