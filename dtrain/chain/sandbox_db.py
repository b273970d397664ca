"""The sandbox chain's SQLite database: schema, connection settings and transactions.

Every process (the sandbox command, the validator, each miner, ``dtrain status``) opens the
same ``<dir>/chain.sqlite``. WAL lets readers run while one writer commits, a busy timeout
makes writers queue instead of failing, and every write runs inside ``BEGIN IMMEDIATE`` so a
check and the write it guards (uid assignment, weight rate limit) hold the write lock together.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path
from typing import Any, Callable, Optional

from dtrain.chain.base import ChainError, ChainHealth, ChainUnavailable
from dtrain.chain.retry import RetryPolicy, retry_call

DB_NAME = "chain.sqlite"
SCHEMA_VERSION = 1
BUSY_TIMEOUT_MS = 15_000
# The version_key each validator last sent with set_weights, so tests and `status` can see what
# a real chain would have received. Also created on open, so an older sandbox database gains it.
VERSION_KEYS_TABLE = (
    "CREATE TABLE IF NOT EXISTS weights_version_keys ("
    "uid INTEGER PRIMARY KEY, version_key INTEGER NOT NULL, block INTEGER NOT NULL)"
)

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS neurons (
    uid INTEGER PRIMARY KEY,
    hotkey TEXT NOT NULL UNIQUE,
    coldkey TEXT,
    stake REAL NOT NULL DEFAULT 0,
    validator_permit INTEGER NOT NULL DEFAULT 0,
    registered_block INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS commitments (
    hotkey TEXT PRIMARY KEY,
    data TEXT NOT NULL,
    block INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS weights (
    validator_uid INTEGER NOT NULL,
    target_uid INTEGER NOT NULL,
    weight REAL NOT NULL,
    block INTEGER NOT NULL,
    PRIMARY KEY (validator_uid, target_uid)
);
CREATE TABLE IF NOT EXISTS last_update (uid INTEGER PRIMARY KEY, block INTEGER NOT NULL);
""" + "\n" + VERSION_KEYS_TABLE


def connect(path: Path) -> sqlite3.Connection:
    # isolation_level=None: we issue BEGIN ourselves so every write
    # transaction is IMMEDIATE (takes the write lock up front, no upgrade
    # deadlocks between processes).
    conn = sqlite3.connect(
        str(path), timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None, check_same_thread=False
    )
    conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute("PRAGMA foreign_keys=ON")
    return conn


class SandboxDatabase:
    """One process's connection to the sandbox database: transactions with health tracking and
    bounded retry, the ``meta`` values, the block clock and the injected-fault counters.

    Block clock: ``block = floor((now - genesis) / block_time) + offset``.
    """

    def __init__(self, path: Path, *, retry: RetryPolicy, clock: Callable[[], float]):
        self.path = path
        self.health = ChainHealth()
        self.retry = retry
        self._clock = clock
        self._lock = threading.Lock()
        self._conn = connect(path)
        self._conn.execute(VERSION_KEYS_TABLE)

    def _meta(self, key: str, default: Optional[str] = None) -> str:
        row = self._conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        if row is None:
            if default is not None:
                return default
            raise ChainError(f"sandbox database {self.path} is missing meta key {key!r}")
        return row[0]

    def _weights_version(self) -> int:
        # A database without the key reads as 0 (check disabled).
        return int(self._meta("weights_version", "0"))

    def _run(self, what: str, fn: Callable[[sqlite3.Connection], Any], *, write: bool = False) -> Any:
        """One transaction, with health tracking and bounded retry on lock contention."""

        def attempt() -> Any:
            with self._lock:
                try:
                    if write:
                        self._conn.execute("BEGIN IMMEDIATE")
                    try:
                        result = fn(self._conn)
                    except BaseException:
                        if self._conn.in_transaction:
                            self._conn.execute("ROLLBACK")
                        raise
                    if self._conn.in_transaction:
                        self._conn.execute("COMMIT")
                    return result
                except sqlite3.OperationalError as exc:
                    # "database is locked" after the busy timeout, or the file
                    # vanished: an outage, not a logic error.
                    raise ChainUnavailable(f"sandbox {what}: {exc}") from exc

        return retry_call(attempt, policy=self.retry, health=self.health, what=f"sandbox {what}")

    def _block_at(self, conn: sqlite3.Connection) -> int:
        genesis = float(self._meta("genesis"))
        block_time = float(self._meta("block_time"))
        offset = int(self._meta("offset"))
        return max(0, int((self._clock() - genesis) // block_time)) + offset

    def _take_fault(self, conn: sqlite3.Connection, op: str) -> bool:
        faults = json.loads(self._meta("faults"))
        remaining = int(faults.get(op, 0))
        if remaining <= 0:
            return False
        faults[op] = remaining - 1
        conn.execute("UPDATE meta SET value = ? WHERE key = 'faults'", (json.dumps(faults),))
        return True

    def _uid_of(self, conn: sqlite3.Connection, hotkey: str) -> Optional[int]:
        row = conn.execute("SELECT uid FROM neurons WHERE hotkey = ?", (hotkey,)).fetchone()
        return None if row is None else int(row[0])

    def close(self) -> None:
        with self._lock:
            self._conn.close()
