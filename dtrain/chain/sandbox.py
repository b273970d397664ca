"""The embedded sandbox chain: a :class:`~dtrain.chain.base.Chain` over a SQLite file shared
by local processes (its database layer: ``dtrain.chain.sandbox_db``), and ``create`` to make one.

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
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from dtrain.chain import sandbox_weights
from dtrain.chain.base import (
    ChainError,
    ChainUnavailable,
    Neuron,
    NotPermitted,
    NotRegistered,
    SandboxMissing,
    WeightsStatus,
    choose_version_key,
)
from dtrain.chain.commitment import (
    MAX_COMMITMENT_BYTES,
    MinerCommitment,
    parse_commitments,
)
from dtrain.chain.retry import RetryPolicy
from dtrain.chain.sandbox_db import DB_NAME, SCHEMA, SCHEMA_VERSION, SandboxDatabase, connect

DEFAULT_BLOCK_TIME = 1.0
DEFAULT_WEIGHTS_RATE_LIMIT = 5


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
    conn = connect(path)
    try:
        conn.execute("BEGIN IMMEDIATE")
        for statement in filter(str.strip, SCHEMA.split(";")):
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


class SandboxChain(SandboxDatabase):
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
        super().__init__(path, retry=retry, clock=clock)
        self.hotkey = hotkey
        self.network = "sandbox"
        stored = int(self._meta("netuid"))
        if netuid is not None and int(netuid) != stored:
            raise ChainError(f"sandbox at {root} runs netuid {stored}, not {netuid}")
        self.netuid = stored

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
        pairs = sandbox_weights.normalise(uids, weights)

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
            sandbox_weights.check_version_key(key, required, self.netuid)
            sandbox_weights.check_targets(conn, pairs)
            now = self._block_at(conn)
            sandbox_weights.check_rate_limit(conn, uid, now, int(self._meta("weights_rate_limit")))
            sandbox_weights.store(conn, uid, pairs, key, now)

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

