"""The sandbox chain's rules for ``set_weights``, as subtensor applies them.

A weight vector is validated and normalised to sum 1; the version key must not be below the
subnet's ``weights_version``; every target must be registered; and a validator may set weights
once per ``weights_rate_limit`` blocks. Each function runs inside the write transaction.
"""

from __future__ import annotations

import math
import sqlite3
from typing import Sequence

from dtrain.chain.base import ChainError, RateLimited


def normalise(uids: Sequence[int], weights: Sequence[float]) -> list[tuple[int, float]]:
    """Validate and row-normalise a weight vector like the chain does (sum 1)."""
    uid_list = [int(u) for u in uids]
    values = [float(w) for w in weights]
    if len(uid_list) != len(values):
        raise ValueError(f"{len(uid_list)} uids but {len(values)} weights")
    if len(set(uid_list)) != len(uid_list):
        raise ValueError("duplicate uids in weights")
    if any(u < 0 for u in uid_list):
        raise ValueError("uids must be >= 0")
    if any(not math.isfinite(v) or v < 0 for v in values):
        raise ValueError("weights must be finite and >= 0")
    total = sum(values)
    if total <= 0:
        return []
    return [(u, v / total) for u, v in zip(uid_list, values) if v > 0]


def check_version_key(key: int, required: int, netuid: int) -> None:
    if required and key < required:
        # subtensor's IncorrectWeightVersionKey; not retried (a ChainError).
        raise ChainError(
            f"version_key {key} is older than netuid {netuid}'s weights_version "
            f"{required} (IncorrectWeightVersionKey)"
        )


def check_targets(conn: sqlite3.Connection, pairs: list[tuple[int, float]]) -> None:
    known = {row[0] for row in conn.execute("SELECT uid FROM neurons")}
    unknown = sorted(u for u, _ in pairs if u not in known)
    if unknown:
        raise ChainError(f"weights name unregistered uids {unknown[:10]}")


def check_rate_limit(conn: sqlite3.Connection, uid: int, now: int, rate: int) -> None:
    last = conn.execute("SELECT block FROM last_update WHERE uid = ?", (uid,)).fetchone()
    if last is not None and rate and now - int(last[0]) < rate:
        remaining = rate - (now - int(last[0]))
        raise RateLimited(
            f"weights set {now - int(last[0])} blocks ago; rate limit is {rate} blocks "
            f"(retry in {remaining})",
            blocks_remaining=remaining,
        )


def store(conn: sqlite3.Connection, uid: int, pairs: list[tuple[int, float]], key: int, now: int) -> None:
    """Replace ``uid``'s weight row and record the block and version key it was set with."""
    conn.execute("DELETE FROM weights WHERE validator_uid = ?", (uid,))
    conn.executemany(
        "INSERT INTO weights(validator_uid, target_uid, weight, block) VALUES (?, ?, ?, ?)",
        [(uid, target, value, now) for target, value in pairs],
    )
    conn.execute(
        "INSERT INTO last_update(uid, block) VALUES (?, ?) "
        "ON CONFLICT(uid) DO UPDATE SET block = excluded.block",
        (uid, now),
    )
    conn.execute(
        "INSERT INTO weights_version_keys(uid, version_key, block) VALUES (?, ?, ?) "
        "ON CONFLICT(uid) DO UPDATE SET version_key = excluded.version_key, "
        "block = excluded.block",
        (uid, key, now),
    )
