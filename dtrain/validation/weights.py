"""From smoothed scores to on-chain weights, and when to set them. Pure functions.

See docs/scoring.md ("Weights" and "When weights are set").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Iterable, Mapping

U16_MAX = 65535


def compute_weights(scores: Mapping[int, float], miner_uids: Iterable[int] | None = None) -> dict[int, float]:
    """Normalise scores to weights that sum to 1 over miners.

    ``miner_uids`` are the uids eligible for weight (validators excluded by the caller);
    None means every uid in ``scores``. Eligible uids without a positive finite score get 0.
    Returns ``{}`` when no eligible uid has a positive score: there is nothing to reward,
    and the caller should not set weights.

    Total for any finite scores: they are divided by the largest before summing, so
    scores near the float maximum cannot overflow the sum to inf (which would turn
    every weight into 0), and tiny ones are not lost to underflow relative to each other.
    """
    eligible = set(scores) if miner_uids is None else set(miner_uids)
    positive = {
        uid: float(scores[uid])
        for uid in eligible
        if uid in scores and math.isfinite(scores[uid]) and scores[uid] > 0
    }
    if not positive:
        return {}
    top = max(positive.values())
    scaled = {uid: v / top for uid, v in positive.items()}  # each in (0, 1]; the sum is at most len
    total = sum(scaled.values())
    return {uid: scaled.get(uid, 0.0) / total for uid in sorted(eligible)}


def to_u16(weights: Mapping[int, float]) -> tuple[list[int], list[int]]:
    """Convert float weights to the chain's u16 form: (uids, values), max scaled to 65535.

    This is the convention of bittensor's ``convert_weights_and_uids_for_emit``: the chain
    normalises again, so only ratios matter, and scaling the largest to U16_MAX keeps the
    most precision. Zero weights are dropped (the chain treats missing uids as 0).
    """
    items = sorted((uid, w) for uid, w in weights.items() if math.isfinite(w) and w > 0)
    if not items:
        return [], []
    top = max(w for _, w in items)
    uids: list[int] = []
    vals: list[int] = []
    for uid, w in items:
        v = int(round(w / top * U16_MAX))
        if v > 0:
            uids.append(uid)
            vals.append(v)
    return uids, vals


def from_u16(uids: Iterable[int], values: Iterable[int]) -> dict[int, float]:
    """Inverse of ``to_u16`` up to rounding: weights summing to 1 (for display)."""
    pairs = list(zip(uids, values))
    total = sum(v for _, v in pairs)
    if total <= 0:
        return {}
    return {u: v / total for u, v in pairs}


@dataclass(frozen=True)
class WeightSetPolicy:
    """When to set weights.

    ``rate_limit_blocks`` is the chain's weights rate limit (``weights_rate_limit``);
    ``min_interval_blocks`` lets an operator set less often (e.g. once per tempo).
    After a failed attempt we wait ``retry_base_blocks * 2**(failures-1)`` blocks, capped
    at ``retry_max_blocks``.
    """

    rate_limit_blocks: int = 100
    min_interval_blocks: int = 0
    retry_base_blocks: int = 2
    retry_max_blocks: int = 50

    @property
    def interval(self) -> int:
        return max(self.rate_limit_blocks, self.min_interval_blocks)


@dataclass(frozen=True)
class WeightSetState:
    """Memory of past attempts (persisted with the validator state)."""

    last_set_block: int | None = None
    failures: int = 0
    next_retry_block: int | None = None
    last_error: str | None = None

    def as_dict(self) -> dict:
        return {
            "last_set_block": self.last_set_block,
            "failures": self.failures,
            "next_retry_block": self.next_retry_block,
            "last_error": self.last_error,
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> "WeightSetState":
        return cls(
            last_set_block=d.get("last_set_block"),
            failures=int(d.get("failures", 0)),
            next_retry_block=d.get("next_retry_block"),
            last_error=d.get("last_error"),
        )


def should_set(policy: WeightSetPolicy, state: WeightSetState, now_block: int) -> bool:
    """True when a weight-setting attempt is due at ``now_block``.

    Due when strictly more than ``interval`` blocks have passed since the last success
    (strictly: being one block late costs nothing, being one block early is a rejected
    extrinsic), and any backoff after a failure has expired.
    """
    if state.next_retry_block is not None and now_block < state.next_retry_block:
        return False
    if state.last_set_block is None:
        return True
    return now_block - state.last_set_block > policy.interval


def blocks_until_due(policy: WeightSetPolicy, state: WeightSetState, now_block: int) -> int:
    """0 when ``should_set`` is true, else how many blocks to wait (for the dashboard)."""
    waits = [0]
    if state.last_set_block is not None:
        waits.append(state.last_set_block + policy.interval + 1 - now_block)
    if state.next_retry_block is not None:
        waits.append(state.next_retry_block - now_block)
    return max(waits)


def record_success(state: WeightSetState, block: int) -> WeightSetState:
    """State after weights were accepted at ``block``."""
    return WeightSetState(last_set_block=block, failures=0, next_retry_block=None, last_error=None)


def record_failure(
    policy: WeightSetPolicy, state: WeightSetState, block: int, error: str = ""
) -> WeightSetState:
    """State after a failed attempt at ``block``: exponential backoff in blocks."""
    failures = state.failures + 1
    wait = min(policy.retry_max_blocks, policy.retry_base_blocks * 2 ** (failures - 1))
    return replace(state, failures=failures, next_retry_block=block + max(1, wait), last_error=error or None)
