"""The embedded sandbox chain: shared by processes, rate-limited weights, retry, health."""

from __future__ import annotations

import json
import logging
import sqlite3
import subprocess
import sys
import textwrap

import pytest

from dtrain.chain import sandbox, sandbox_db
from dtrain.chain.base import (
    Chain,
    ChainError,
    ChainUnavailable,
    NotPermitted,
    NotRegistered,
    RateLimited,
    SandboxMissing,
    UnknownNetwork,
)
from dtrain.chain.commitment import MinerCommitment
from dtrain.chain.factory import open_chain
from dtrain.chain.retry import RetryPolicy
from dtrain.chain.sandbox import SandboxChain

PEER = "12D3KooWabcdefghijkmnopqrstuvwxyzABCDEFGHJKLMNPQRSTU"
FAST = RetryPolicy(attempts=3, base_delay=0.0, max_delay=0.0)


class FrozenClock:
    def __init__(self, now: float = 1_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def chain_dir(tmp_path):
    d = tmp_path / "sandbox"
    sandbox.create(d, netuid=38, block_time=2.0, weights_rate_limit=5)
    return d


def test_open_chain_picks_sandbox_and_protocol(chain_dir):
    chain = open_chain("sandbox", 38, sandbox_dir=chain_dir, hotkey="hk-v")
    assert isinstance(chain, SandboxChain) and isinstance(chain, Chain)
    chain.close()


def test_factory_errors(tmp_path, chain_dir):
    with pytest.raises(UnknownNetwork):
        open_chain("mainnet", 38)
    with pytest.raises(UnknownNetwork):
        open_chain("", 38)
    with pytest.raises(UnknownNetwork):
        open_chain("ws://", 38)
    with pytest.raises(ChainError, match="sandbox directory"):
        open_chain("sandbox", 38)
    with pytest.raises(SandboxMissing, match="does not exist"):
        open_chain("sandbox", 38, sandbox_dir=tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SandboxMissing, match="no sandbox chain"):
        open_chain("sandbox", 38, sandbox_dir=tmp_path / "empty")
    with pytest.raises(ChainError, match="netuid 38, not 7"):
        open_chain("sandbox", 7, sandbox_dir=chain_dir)


def test_block_clock_from_time_and_advance(chain_dir):
    clock = FrozenClock()
    chain = SandboxChain(chain_dir, clock=clock)
    genesis = chain.info()["genesis"]
    clock.now = genesis + 2.0 * 7 + 0.5  # 7 whole blocks of 2 s
    assert chain.block() == 7
    assert chain.advance(3) == 10
    # The offset is shared state: a second handle sees it.
    other = SandboxChain(chain_dir, clock=clock)
    assert other.block() == 10
    with pytest.raises(ValueError):
        chain.advance(-1)


def test_registration_and_neurons(chain_dir):
    chain = SandboxChain(chain_dir)
    assert chain.register("hk-v", "ck-v", 1000.0, True) == 0
    assert chain.register("hk-m1", "ck-m") == 1
    assert chain.register("hk-m2") == 2
    assert chain.register("hk-m1", "ck-m", 5.0) == 1  # idempotent, updates stake
    neurons = chain.neurons()
    assert [(n.uid, n.hotkey, n.coldkey, n.stake, n.validator_permit) for n in neurons] == [
        (0, "hk-v", "ck-v", 1000.0, True),
        (1, "hk-m1", "ck-m", 5.0, False),
        (2, "hk-m2", None, 0.0, False),
    ]
    assert chain.uid("hk-m2") == 2 and chain.uid("nobody") is None
    with pytest.raises(ValueError):
        chain.register("hk-x", stake=float("nan"))


def test_commitments_skip_malformed(chain_dir, caplog):
    admin = SandboxChain(chain_dir)
    for hk in ("hk-a", "hk-b", "hk-c"):
        admin.register(hk)
    record = MinerCommitment(peer_id=PEER, api="127.0.0.1:9000", repo="owner/m")
    writer = SandboxChain(chain_dir, hotkey="hk-a")
    assert writer.commit(record) is True
    assert writer.commit(record) is False  # unchanged: no write
    SandboxChain(chain_dir, hotkey="hk-b").commit_raw("__import__('os').system('id')")
    SandboxChain(chain_dir, hotkey="hk-c").commit_raw('{"v":1}')
    with caplog.at_level(logging.WARNING, logger="dtrain.chain"):
        parsed = admin.commitments()
    assert parsed == {"hk-a": record}
    assert caplog.text.count("malformed commitment") == 2
    with pytest.raises(NotRegistered):
        SandboxChain(chain_dir, hotkey="stranger").commit(record)
    with pytest.raises(ChainError, match="larger than"):
        SandboxChain(chain_dir, hotkey="hk-a").commit_raw("x" * 5000)


def test_weights_rate_limit_permit_and_normalisation(chain_dir):
    clock = FrozenClock()
    admin = SandboxChain(chain_dir, clock=clock)
    admin.register("hk-v", validator_permit=True)
    admin.register("hk-m1")
    admin.register("hk-m2")
    validator = SandboxChain(chain_dir, hotkey="hk-v", clock=clock)
    start = validator.block()
    validator.set_weights([1, 2], [1.0, 3.0])
    assert validator.weights() == {0: {1: 0.25, 2: 0.75}}
    status = validator.weights_status()
    assert (status.rate_limit, status.last_set_block, status.blocks_until_allowed) == (5, start, 5)
    with pytest.raises(RateLimited) as info:
        validator.set_weights([1], [1.0])
    assert info.value.blocks_remaining == 5
    assert validator.weights() == {0: {1: 0.25, 2: 0.75}}  # unchanged
    admin.advance(5)
    validator.set_weights([1, 2], [0.0, 2.0])  # zeros are dropped, like the chain
    assert validator.weights() == {0: {2: 1.0}}
    assert validator.weights_status().last_set_block == start + 5

    miner = SandboxChain(chain_dir, hotkey="hk-m1", clock=clock)
    with pytest.raises(NotPermitted):
        miner.set_weights([2], [1.0])
    with pytest.raises(NotRegistered):
        SandboxChain(chain_dir, hotkey="ghost").set_weights([1], [1.0])
    admin.advance(10)
    for uids, weights in (([1], [float("nan")]), ([1], [-1.0]), ([1, 1], [1, 1]), ([1], [1, 2])):
        with pytest.raises(ValueError):
            validator.set_weights(uids, weights)
    with pytest.raises(ChainError, match="unregistered uids"):
        validator.set_weights([1, 99], [1.0, 1.0])


def test_set_weights_retries_outage_and_reports_health(chain_dir):
    admin = SandboxChain(chain_dir)
    admin.register("hk-v", validator_permit=True)
    admin.register("hk-m")
    validator = SandboxChain(chain_dir, hotkey="hk-v", retry=FAST)
    admin.inject_faults("set_weights", 2)
    validator.set_weights([1], [1.0])  # 2 failures, third attempt lands
    assert validator.weights() == {0: {1: 1.0}}
    snap = validator.health.snapshot()
    assert snap["ok"] and "injected" in snap["last_error"] and snap["last_error_at"] <= snap["last_ok"]

    admin.advance(100)
    admin.inject_faults("set_weights", 4)
    with pytest.raises(ChainUnavailable):
        validator.set_weights([1], [0.5])  # 3 attempts, all fail
    snap = validator.health.snapshot()
    assert snap["ok"] is False and snap["consecutive_failures"] == 3
    # The remaining injected failure proves no more than 3 attempts were made.
    validator.retry = RetryPolicy(attempts=1)
    with pytest.raises(ChainUnavailable):
        validator.set_weights([1], [0.5])
    validator.set_weights([1], [0.5])
    assert validator.health.ok


def test_locked_database_is_an_outage_not_a_crash(chain_dir, monkeypatch):
    chain = SandboxChain(chain_dir, retry=FAST)
    monkeypatch.setattr(sandbox_db, "BUSY_TIMEOUT_MS", 50)
    blocker = sqlite3.connect(chain_dir / sandbox_db.DB_NAME, isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")
    chain._conn.execute("PRAGMA busy_timeout=50")
    try:
        with pytest.raises(ChainUnavailable, match="locked"):
            chain.register("hk-x")
        assert not chain.health.ok
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    assert chain.register("hk-x") == 0
    assert chain.health.ok


_WORKER = textwrap.dedent(
    """
    import json, sys
    from dtrain.chain.sandbox import SandboxChain
    from dtrain.chain.commitment import MinerCommitment
    directory, worker, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    peer = "12D3KooWabcdefghijkmnopqrstuvwxyzABCDEFGHJKLMNPQRSTU"
    out = []
    for i in range(count):
        hotkey = f"hk-{worker}-{i}"
        chain = SandboxChain(directory, hotkey=hotkey)
        uid = chain.register(hotkey, f"ck-{worker}", float(i), i == 0)
        chain.commit(MinerCommitment(peer_id=peer, api=f"127.0.0.1:{10000 + worker * 100 + i}", repo="o/m"))
        out.append([hotkey, uid])
        chain.close()
    print(json.dumps(out))
    """
)

_READER = textwrap.dedent(
    """
    import sys
    from dtrain.chain.sandbox import SandboxChain
    chain = SandboxChain(sys.argv[1])
    seen = 0
    for _ in range(int(sys.argv[2])):
        committed = set(chain.commitments())  # read first: commits follow registration
        neurons = chain.neurons()
        uids = [n.uid for n in neurons]
        assert uids == list(range(len(uids))), uids  # never a gap or duplicate mid-write
        assert committed <= {n.hotkey for n in neurons}
        seen = max(seen, len(uids))
    print(seen)
    """
)


def test_many_processes_share_the_sandbox(chain_dir):
    writers, per_writer = 4, 15
    procs = [
        subprocess.Popen([sys.executable, "-c", _WORKER, str(chain_dir), str(w), str(per_writer)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for w in range(writers)
    ]
    readers = [
        subprocess.Popen([sys.executable, "-c", _READER, str(chain_dir), "40"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    results = []
    for proc in procs + readers:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        results.append(out)
    assigned = [pair for out in results[:writers] for pair in json.loads(out)]
    uids = sorted(uid for _, uid in assigned)
    assert uids == list(range(writers * per_writer))  # unique and dense
    chain = SandboxChain(chain_dir)
    by_hotkey = {n.hotkey: n.uid for n in chain.neurons()}
    assert by_hotkey == dict(assigned)
    commitments = chain.commitments()
    assert set(commitments) == set(by_hotkey)
    assert len({c.api for c in commitments.values()}) == writers * per_writer
    conn = sqlite3.connect(chain_dir / sandbox_db.DB_NAME)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    conn.close()


def test_create_refuses_bad_parameters(tmp_path):
    with pytest.raises(ValueError):
        sandbox.create(tmp_path / "a", block_time=0)
    with pytest.raises(ValueError):
        sandbox.create(tmp_path / "b", weights_rate_limit=-1)
    sandbox.create(tmp_path / "c")
    with pytest.raises(ChainError, match="already exists"):
        sandbox.create(tmp_path / "c", exist_ok=False)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_validator_permits_cache_and_outage(chain_dir):
    from dtrain.chain.permits import ValidatorPermits

    admin = SandboxChain(chain_dir)
    admin.register("hk-v", validator_permit=True, stake=10.0)
    admin.register("hk-poor", validator_permit=True, stake=0.5)
    admin.register("hk-m")
    clock = Clock()
    reader = SandboxChain(chain_dir, retry=RetryPolicy(attempts=1))
    permits = ValidatorPermits(reader, refresh_s=30, min_stake=1.0, clock=clock)
    assert permits("hk-v") and not permits("hk-m") and not permits("hk-poor") and not permits("nobody")
    admin.register("hk-v2", validator_permit=True, stake=5.0)
    assert not permits("hk-v2")  # cached
    clock.now = 31
    assert permits("hk-v2")  # refreshed
    # Outage: the last known set keeps answering.
    calls = {"n": 0}

    def down():
        calls["n"] += 1
        raise ChainUnavailable("sandbox down")

    reader.neurons = down
    clock.now = 100
    assert permits("hk-v") and not permits("hk-m")
    assert calls["n"] == 1  # one refresh attempt per period, not one per request
    # Never loaded + outage: the check raises (the API answers 503).
    with pytest.raises(ChainUnavailable):
        ValidatorPermits(reader)("hk-v")
