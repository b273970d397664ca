"""The embedded sandbox chain: SQLite in WAL mode, shared by local processes.

Layout: ``<dir>/chain.sqlite``. Every process (the sandbox command, the
validator, each miner, ``dtrain status``) opens the same file; WAL lets readers
run while one writer commits, and a busy timeout makes writers queue instead of
failing. Writes that must be atomic across processes (uid assignment, weight
rate limit) run inside ``BEGIN IMMEDIATE`` so the check and the write hold the
write lock together.

Block clock: ``block = floor((now - genesis) / block_time) + offset``. Time
advances blocks on its own (default 1 s per block so rate limits pass quickly
in a demo); ``advance(n)`` adds ``n`` to ``offset`` for tests and scripted
runs. ``block_time`` and ``weights_rate_limit`` are fixed at ``create``.
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from dtrain.chain.base import (
    ChainError,
    ChainHealth,
    ChainUnavailable,
    Neuron,
    NotPermitted,
    NotRegistered,
    RateLimited,
    SandboxMissing,
    WeightsStatus,
    choose_version_key,
)
from dtrain.chain.commitment import (
    MAX_COMMITMENT_BYTES,
    MinerCommitment,
    parse_commitments,
)
from dtrain.chain.retry import RetryPolicy, retry_call

DB_NAME = "chain.sqlite"
# The version_key each validator last sent with set_weights, so tests and `status` can
# see what a real chain would have received. Also created on open: sandboxes made before
# this table existed keep working.
_VERSION_KEYS_TABLE = (
    "CREATE TABLE IF NOT EXISTS weights_version_keys ("
    "uid INTEGER PRIMARY KEY, version_key INTEGER NOT NULL, block INTEGER NOT NULL)"
)
SCHEMA_VERSION = 1
DEFAULT_BLOCK_TIME = 1.0
DEFAULT_WEIGHTS_RATE_LIMIT = 5
BUSY_TIMEOUT_MS = 15_000

_SCHEMA = """
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
""" + "\n" + _VERSION_KEYS_TABLE


def _connect(path: Path) -> sqlite3.Connection:
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


def create(
    directory: str | os.PathLike,
    *,
    netuid: int = 38,
    block_time: float = DEFAULT_BLOCK_TIME,
    weights_rate_limit: int = DEFAULT_WEIGHTS_RATE_LIMIT,
    weights_version: int = 0,
    exist_ok: bool = True,
) -> Path:
    """Create (or reuse) a sandbox chain in ``directory``; returns the db path.

    Re-creating an existing sandbox keeps its state (genesis, uids) so a
    restarted sandbox resumes; pass ``exist_ok=False`` to refuse instead.
    """
    if not block_time > 0 or not math.isfinite(block_time):
        raise ValueError("block_time must be a positive number of seconds")
    if weights_rate_limit < 0:
        raise ValueError("weights_rate_limit must be >= 0")
    if weights_version < 0:
        raise ValueError("weights_version must be >= 0")
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    path = root / DB_NAME
    if path.exists() and not exist_ok:
        raise ChainError(f"sandbox chain already exists at {path}")
    conn = _connect(path)
    try:
        conn.execute("BEGIN IMMEDIATE")
        for statement in filter(str.strip, _SCHEMA.split(";")):
            conn.execute(statement)
        defaults = {
            "schema_version": str(SCHEMA_VERSION),
            "genesis": repr(time.time()),
            "block_time": repr(float(block_time)),
            "offset": "0",
            "weights_rate_limit": str(int(weights_rate_limit)),
            # The subnet's weights_version hyperparameter: set_weights with a lower
            # version_key is refused, as on subtensor (0 disables the check).
            "weights_version": str(int(weights_version)),
            "netuid": str(int(netuid)),
            "faults": "{}",
        }
        for key, value in defaults.items():
            conn.execute("INSERT OR IGNORE INTO meta(key, value) VALUES (?, ?)", (key, value))
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    finally:
        conn.close()
    return path


class SandboxChain:
    """A :class:`~dtrain.chain.base.Chain` over the sandbox database.

    ``hotkey`` is this node's ss58 hotkey (needed for ``commit`` and
    ``set_weights``; read-only users may leave it None).
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        hotkey: Optional[str] = None,
        netuid: Optional[int] = None,
        retry: RetryPolicy = RetryPolicy(attempts=4, base_delay=0.1, max_delay=2.0),
        clock: Callable[[], float] = time.time,
    ):
        root = Path(directory)
        path = root / DB_NAME
        if not root.is_dir():
            raise SandboxMissing(
                f"sandbox directory {root} does not exist (create it with `dtrain sandbox --dir {root}`)"
            )
        if not path.is_file():
            raise SandboxMissing(f"no sandbox chain in {root} (expected {path})")
        self.path = path
        self.hotkey = hotkey
        self.network = "sandbox"
        self.health = ChainHealth()
        self.retry = retry
        self._clock = clock
        self._lock = threading.Lock()
        self._conn = _connect(path)
        self._conn.execute(_VERSION_KEYS_TABLE)
        stored = int(self._meta("netuid"))
        if netuid is not None and int(netuid) != stored:
            raise ChainError(f"sandbox at {root} runs netuid {stored}, not {netuid}")
        self.netuid = stored

    # -- plumbing -----------------------------------------------------------------

    def _meta(self, key: str, default: Optional[str] = None) -> str:
        row = self._conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        if row is None:
            if default is not None:
                return default
            raise ChainError(f"sandbox database {self.path} is missing meta key {key!r}")
        return row[0]

    def _weights_version(self) -> int:
        # Sandboxes created before the key existed read as 0 (check disabled).
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

    def _require_hotkey(self) -> str:
        if not self.hotkey:
            raise ChainError("this chain handle has no hotkey; open it with a wallet or hotkey")
        return self.hotkey

    # -- Chain protocol -----------------------------------------------------------

    def block(self) -> int:
        return self._run("block", self._block_at)

    def neurons(self) -> list[Neuron]:
        rows = self._run(
            "neurons",
            lambda c: c.execute(
                "SELECT uid, hotkey, coldkey, stake, validator_permit FROM neurons ORDER BY uid"
            ).fetchall(),
        )
        return [Neuron(int(u), h, ck, float(s), bool(p)) for u, h, ck, s, p in rows]

    def raw_commitments(self) -> dict[str, str]:
        rows = self._run(
            "commitments", lambda c: c.execute("SELECT hotkey, data FROM commitments").fetchall()
        )
        return {hotkey: data for hotkey, data in rows}

    def commitments(self) -> dict[str, MinerCommitment]:
        return parse_commitments(self.raw_commitments())

    def commit(self, record: MinerCommitment) -> bool:
        """Publish ``record``; False (and no write) when it is already current."""
        data = record.to_json()
        hotkey = self._require_hotkey()
        if self.raw_commitments().get(hotkey) == data:
            return False
        self.commit_raw(data)
        return True

    def commit_raw(self, data: str) -> None:
        """Store any string as this hotkey's commitment (as a real chain would;
        readers validate). Used by adversary scenarios and tests."""
        hotkey = self._require_hotkey()
        if len(data.encode("utf-8", "surrogatepass")) > MAX_COMMITMENT_BYTES:
            raise ChainError(f"commitment larger than {MAX_COMMITMENT_BYTES} bytes")

        def write(conn: sqlite3.Connection) -> None:
            if self._uid_of(conn, hotkey) is None:
                raise NotRegistered(f"hotkey {hotkey} is not registered on the sandbox")
            conn.execute(
                "INSERT INTO commitments(hotkey, data, block) VALUES (?, ?, ?) "
                "ON CONFLICT(hotkey) DO UPDATE SET data = excluded.data, block = excluded.block",
                (hotkey, data, self._block_at(conn)),
            )

        self._run("commit", write, write=True)

    def set_weights(
        self, uids: Sequence[int], weights: Sequence[float], *, version_key: Optional[int] = None
    ) -> None:
        """Like subtensor's ``set_weights``; ``version_key`` None picks it the way the
        bittensor backend does (``choose_version_key`` over ``weights_version``)."""
        hotkey = self._require_hotkey()
        pairs = _normalise(uids, weights)

        def write(conn: sqlite3.Connection) -> None:
            if self._take_fault(conn, "set_weights"):
                # Commit the decremented fault counter, then fail like an outage.
                conn.execute("COMMIT")
                raise ChainUnavailable("sandbox: injected set_weights failure")
            uid = self._uid_of(conn, hotkey)
            if uid is None:
                raise NotRegistered(f"hotkey {hotkey} is not registered on the sandbox")
            permit = conn.execute("SELECT validator_permit FROM neurons WHERE uid = ?", (uid,)).fetchone()[0]
            if not permit:
                raise NotPermitted(f"uid {uid} has no validator permit")
            required = self._weights_version()
            key = choose_version_key(required) if version_key is None else int(version_key)
            if required and key < required:
                # subtensor's IncorrectWeightVersionKey; not retried (a ChainError).
                raise ChainError(
                    f"version_key {key} is older than netuid {self.netuid}'s weights_version "
                    f"{required} (IncorrectWeightVersionKey)"
                )
            known = {row[0] for row in conn.execute("SELECT uid FROM neurons")}
            unknown = sorted(u for u, _ in pairs if u not in known)
            if unknown:
                raise ChainError(f"weights name unregistered uids {unknown[:10]}")
            now = self._block_at(conn)
            rate = int(self._meta("weights_rate_limit"))
            last = conn.execute("SELECT block FROM last_update WHERE uid = ?", (uid,)).fetchone()
            if last is not None and rate and now - int(last[0]) < rate:
                remaining = rate - (now - int(last[0]))
                raise RateLimited(
                    f"weights set {now - int(last[0])} blocks ago; rate limit is {rate} blocks "
                    f"(retry in {remaining})",
                    blocks_remaining=remaining,
                )
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

        # _run already retries ChainUnavailable with self.retry.
        self._run("set_weights", write, write=True)

    def weights(self) -> dict[int, dict[int, float]]:
        rows = self._run(
            "weights",
            lambda c: c.execute(
                "SELECT validator_uid, target_uid, weight FROM weights ORDER BY validator_uid, target_uid"
            ).fetchall(),
        )
        out: dict[int, dict[int, float]] = {}
        for validator, target, value in rows:
            out.setdefault(int(validator), {})[int(target)] = float(value)
        return out

    def weights_status(self, uid: Optional[int] = None) -> WeightsStatus:
        def read(conn: sqlite3.Connection) -> WeightsStatus:
            target = uid
            if target is None and self.hotkey:
                target = self._uid_of(conn, self.hotkey)
            last = None
            if target is not None:
                row = conn.execute("SELECT block FROM last_update WHERE uid = ?", (target,)).fetchone()
                last = None if row is None else int(row[0])
            return WeightsStatus(
                block=self._block_at(conn),
                rate_limit=int(self._meta("weights_rate_limit")),
                last_set_block=last,
            )

        return self._run("weights_status", read)

    def weights_version(self) -> int:
        """The sandbox subnet's ``weights_version`` hyperparameter."""
        return self._run("weights_version", lambda c: self._weights_version())

    def version_keys(self) -> dict[int, int]:
        """``{validator_uid: version_key}`` of each validator's last accepted set_weights."""
        rows = self._run(
            "version_keys",
            lambda c: c.execute("SELECT uid, version_key FROM weights_version_keys").fetchall(),
        )
        return {int(uid): int(key) for uid, key in rows}

    def uid(self, hotkey: Optional[str] = None) -> Optional[int]:
        key = hotkey or self._require_hotkey()
        return self._run("uid", lambda c: self._uid_of(c, key))

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def __enter__(self) -> "SandboxChain":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- admin (used by `dtrain sandbox` and tests) ---------------------------------

    def register(
        self,
        hotkey: str,
        coldkey: Optional[str] = None,
        stake: float = 0.0,
        validator_permit: bool = False,
    ) -> int:
        """Register ``hotkey`` and return its uid; idempotent for a known hotkey
        (its coldkey/stake/permit are updated). Uids are 0, 1, 2, ... and unique
        across processes: assignment happens under the database write lock."""
        if not isinstance(hotkey, str) or not hotkey:
            raise ValueError("hotkey must be a non-empty ss58 string")
        if not math.isfinite(stake) or stake < 0:
            raise ValueError("stake must be a finite, non-negative number")

        def write(conn: sqlite3.Connection) -> int:
            existing = self._uid_of(conn, hotkey)
            if existing is not None:
                conn.execute(
                    "UPDATE neurons SET coldkey = ?, stake = ?, validator_permit = ? WHERE uid = ?",
                    (coldkey, float(stake), int(bool(validator_permit)), existing),
                )
                return existing
            uid = conn.execute("SELECT COALESCE(MAX(uid), -1) + 1 FROM neurons").fetchone()[0]
            conn.execute(
                "INSERT INTO neurons(uid, hotkey, coldkey, stake, validator_permit, registered_block) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (uid, hotkey, coldkey, float(stake), int(bool(validator_permit)), self._block_at(conn)),
            )
            return int(uid)

        return self._run("register", write, write=True)

    def advance(self, blocks: int) -> int:
        """Move the block clock forward by ``blocks``; returns the new block."""
        if blocks < 0:
            raise ValueError("the block clock only moves forward")

        def write(conn: sqlite3.Connection) -> int:
            offset = int(self._meta("offset")) + int(blocks)
            conn.execute("UPDATE meta SET value = ? WHERE key = 'offset'", (str(offset),))
            return self._block_at(conn)

        return self._run("advance", write, write=True)

    def set_weights_version(self, value: int) -> None:
        """Set the subnet's ``weights_version`` (what a subnet owner's
        ``sudo_set_weights_version_key`` does on subtensor)."""
        if int(value) < 0:
            raise ValueError("weights_version must be >= 0")

        def write(conn: sqlite3.Connection) -> None:
            conn.execute(
                "INSERT INTO meta(key, value) VALUES ('weights_version', ?) "
                "ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                (str(int(value)),),
            )

        self._run("set_weights_version", write, write=True)

    def inject_faults(self, op: str, count: int) -> None:
        """Make the next ``count`` calls of ``op`` (only "set_weights" today)
        fail as if the chain were unreachable, in whichever process makes them.
        Lets the sandbox demonstrate (and tests check) retry and outage display."""
        if op != "set_weights":
            raise ValueError(f"unknown fault op {op!r}")

        def write(conn: sqlite3.Connection) -> None:
            faults = json.loads(self._meta("faults"))
            faults[op] = int(count)
            conn.execute("UPDATE meta SET value = ? WHERE key = 'faults'", (json.dumps(faults),))

        self._run("inject_faults", write, write=True)

    def info(self) -> dict:
        """Clock and limits, for `dtrain sandbox --json` / status."""

        def read(conn: sqlite3.Connection) -> dict:
            return {
                "path": str(self.path),
                "netuid": self.netuid,
                "block": self._block_at(conn),
                "block_time": float(self._meta("block_time")),
                "weights_rate_limit": int(self._meta("weights_rate_limit")),
                "weights_version": self._weights_version(),
                "genesis": float(self._meta("genesis")),
            }

        return self._run("info", read)


def _normalise(uids: Sequence[int], weights: Sequence[float]) -> list[tuple[int, float]]:
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
