"""Tag scheme, local-directory store, retry classification and the background pusher."""

from __future__ import annotations

import errno
import hashlib
import threading
import time
from pathlib import Path

import pytest

from dtrain.hub.base import ModelStore, PushResult, StoreAuthError, StoreError, StoreNotFoundError
from dtrain.hub.local import LocalStore
from dtrain.hub.pusher import BackgroundPusher
from dtrain.hub.retry import RetryPolicy, call_with_retries, is_retryable
from dtrain.hub.tags import Tag, TagError, format_tag, newest, parse_tag, validate_run_id
from dtrain.hub.targets import open_store


def _tree_digest(d: Path) -> dict[str, tuple[str, int]]:
    return {
        str(p.relative_to(d)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        for p in sorted(d.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def ckpt(tmp_path):
    d = tmp_path / "ckpt"
    (d / "sub").mkdir(parents=True)
    (d / "config.json").write_text('{"step": 1}')
    (d / "model.bin").write_bytes(b"w" * (3 << 20))  # several copy chunks
    (d / "sub" / "opt.bin").write_bytes(b"o" * 100)
    return d


# ---------------------------------------------------------------- tags


def test_tag_roundtrip_and_order():
    t = format_tag("gpt2-250m_a", 3, 17)
    assert t == "gpt2-250m_a.3.17"
    assert parse_tag(t) == Tag(epoch=3, inner_step=17, run_id="gpt2-250m_a")
    assert newest(["r.1.5", "r.2.0", "r.1.10", "x.9.9", "not-a-tag"], run_id="r") == "r.2.0"
    assert newest(["r.1.5", "r.1.10"]) == "r.1.10"  # numeric, not lexicographic
    assert newest([]) is None


@pytest.mark.parametrize("bad", ["", "a.b", "a/b", "-a", "a b", "ä", "x" * 65, "..", None])
def test_bad_run_ids(bad):
    with pytest.raises(TagError, match="invalid run_id"):
        validate_run_id(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["r.1", "r.1.2.3", "r.-1.0", "r.01.0", "../x.1.2", "r.1.x"])
def test_bad_tags(bad):
    with pytest.raises(TagError):
        parse_tag(bad)


def test_format_rejects_negative_and_bool():
    with pytest.raises(TagError):
        format_tag("r", -1, 0)
    with pytest.raises(TagError):
        format_tag("r", True, 0)  # type: ignore[arg-type]


# ---------------------------------------------------------------- local store


def test_local_push_list_latest_fetch(tmp_path, ckpt):
    before = _tree_digest(ckpt)
    store = open_store(str(tmp_path / "store"))
    assert isinstance(store, LocalStore) and isinstance(store, ModelStore)
    events = []
    res = store.push(ckpt, "run.0.5", progress=events.append)
    assert res.bytes_total == (3 << 20) + len('{"step": 1}') + 100
    assert events[-1].stage == "done" and max(e.bytes_done for e in events) == res.bytes_total
    assert (tmp_path / "store" / "tags" / "run.0.5" / "sub" / "opt.bin").read_bytes() == b"o" * 100
    assert store.latest() == "run.0.5"
    (ckpt / "config.json").write_text('{"step": 2}')
    store.push(ckpt, "run.1.0")
    assert store.list_tags() == ["run.0.5", "run.1.0"] and store.latest("run") == "run.1.0"
    # latest is the last pushed, even if older by number
    store.push(ckpt, "run.0.9")
    assert store.latest() == "run.0.9"
    # immutable: pushing an existing tag keeps the first content
    again = store.push(ckpt, "run.0.5")
    assert again.already_existed
    assert (tmp_path / "store" / "tags" / "run.0.5" / "config.json").read_text() == '{"step": 1}'
    out = store.fetch("run.1.0", tmp_path / "out")
    assert (out / "config.json").read_text() == '{"step": 2}'
    with pytest.raises(StoreError, match="not empty"):
        store.fetch("run.1.0", tmp_path / "out")
    with pytest.raises(StoreNotFoundError):
        store.fetch("run.7.0", tmp_path / "out2")
    assert not list((tmp_path / "store" / ".staging").iterdir())
    # the source checkpoint was only read
    assert set(_tree_digest(ckpt)) == set(before)


def test_local_latest_pointer_missing_falls_back(tmp_path, ckpt):
    store = LocalStore(f"file://{tmp_path / 's'}")
    assert store.target.startswith("file://")
    store.push(ckpt, "r.2.0")
    store.push(ckpt, "r.1.0")
    (tmp_path / "s" / "latest").unlink()
    assert store.latest() == "r.2.0"
    assert LocalStore(tmp_path / "empty").latest() is None


def test_local_push_errors(tmp_path, ckpt):
    store = LocalStore(tmp_path / "s")
    with pytest.raises(StoreNotFoundError):
        store.push(tmp_path / "missing", "r.0.0")
    (tmp_path / "empty").mkdir()
    with pytest.raises(StoreError, match="empty"):
        store.push(tmp_path / "empty", "r.0.0")
    with pytest.raises(TagError):
        store.push(ckpt, "../../etc.0.0")


def test_local_push_never_exposes_partial_tag(tmp_path, ckpt, monkeypatch):
    store = LocalStore(tmp_path / "s")
    import dtrain.hub.local as local

    real = local.shutil.copystat
    calls = {"n": 0}

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*a, **k)

    monkeypatch.setattr(local.shutil, "copystat", flaky)
    with pytest.raises(StoreError, match="No space left"):
        store.push(ckpt, "r.0.0")
    assert store.list_tags() == [] and store.latest() is None
    assert not list((tmp_path / "s" / ".staging").iterdir())


# ---------------------------------------------------------------- retry


class _HTTPErr(Exception):
    def __init__(self, code):
        super().__init__(f"HTTP {code}")
        self.response = type("R", (), {"status_code": code})()


def test_classification():
    assert is_retryable(_HTTPErr(503)) and is_retryable(_HTTPErr(429)) and is_retryable(_HTTPErr(500))
    assert not is_retryable(_HTTPErr(401)) and not is_retryable(_HTTPErr(403)) and not is_retryable(_HTTPErr(404))
    assert is_retryable(ConnectionResetError()) and is_retryable(TimeoutError())
    assert is_retryable(OSError(errno.ENETUNREACH, "unreachable"))
    assert not is_retryable(OSError(errno.EACCES, "denied")) and not is_retryable(ValueError())
    assert not is_retryable(StoreAuthError("x")) and is_retryable(StoreError("x", retryable=True))


def test_call_with_retries_counts_and_stops_on_fatal():
    seq = [ConnectionResetError("reset"), _HTTPErr(502), "ok"]
    sleeps = []

    def fn():
        x = seq.pop(0)
        if isinstance(x, Exception):
            raise x
        return x

    assert call_with_retries(fn, what="x", policy=RetryPolicy(jitter=0), sleep=sleeps.append) == ("ok", 3)
    assert len(sleeps) == 2

    calls = []

    def fatal():
        calls.append(1)
        raise _HTTPErr(401)

    with pytest.raises(StoreError, match="x failed") as ei:
        call_with_retries(fatal, what="x", policy=RetryPolicy(), sleep=sleeps.append)
    assert len(calls) == 1 and ei.value.attempts == 1 and not ei.value.retryable


# ---------------------------------------------------------------- background pusher


class GatedFlakyStore(LocalStore):
    """LocalStore whose pushes fail ``fail`` times, and can be held at a gate."""

    def __init__(self, root, fail=0):
        super().__init__(root)
        self.fail = fail
        self.attempts: list[str] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def push(self, folder, tag, progress=None) -> PushResult:
        self.attempts.append(tag)
        self.entered.set()
        assert self.gate.wait(10)
        if self.fail > 0:
            self.fail -= 1
            raise StoreError("Hub answered HTTP 503", retryable=True)
        return super().push(folder, tag, progress)


def _wait(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return False


def test_pusher_enqueue_is_immediate_and_pushes(tmp_path, ckpt):
    store = GatedFlakyStore(tmp_path / "s")
    store.gate.clear()  # the "network" hangs
    before = _tree_digest(ckpt)
    with BackgroundPusher(store, tmp_path / "staging") as p:
        # enqueue must return while the upload is still blocked (the gate stays closed)
        caller = threading.Thread(target=p.enqueue, args=(ckpt, "r.0.1"))
        caller.start()
        caller.join(30)
        assert not caller.is_alive() and not store.gate.is_set()
        assert store.entered.wait(5)
        st = p.status()
        assert st.uploading == "r.0.1" and st.pending == ("r.0.1",)
        # The trainer overwrites the checkpoint while the upload hangs: the upload
        # still carries the snapshot taken at enqueue time.
        (ckpt / "config.json").write_text('{"step": 999}')
        store.gate.set()
        assert p.flush(10)
        st = p.status()
        assert st.last_success_tag == "r.0.1" and st.pushed == 1 and st.pending == () and st.last_error is None
    assert (tmp_path / "s" / "tags" / "r.0.1" / "config.json").read_text() == '{"step": 1}'
    # checkpoint untouched by the pusher (only our own write above changed it)
    after = _tree_digest(ckpt)
    assert {k: v for k, v in after.items() if k != "config.json"} == {
        k: v for k, v in before.items() if k != "config.json"
    }
    assert not any((tmp_path / "staging").iterdir())  # staging cleaned


def test_pusher_failure_then_retry_later_succeeds(tmp_path, ckpt):
    store = GatedFlakyStore(tmp_path / "s", fail=2)
    p = BackgroundPusher(store, tmp_path / "staging", retry_interval=0.05, max_retry_interval=0.2).start()
    try:
        p.enqueue(ckpt, "r.0.1")
        assert _wait(lambda: p.status().failures >= 1)
        st = p.status()
        assert st.last_error and "503" in st.last_error and st.last_error_tag == "r.0.1"
        assert p.flush(10)
        st = p.status()
        assert store.attempts == ["r.0.1"] * 3
        assert st.last_success_tag == "r.0.1" and st.failures == 2 and st.consecutive_failures == 0
        assert store.latest() == "r.0.1"
    finally:
        p.stop()
    assert not p.status().running


def test_pusher_latest_wins(tmp_path, ckpt):
    store = GatedFlakyStore(tmp_path / "s")
    store.gate.clear()
    with BackgroundPusher(store, tmp_path / "staging") as p:
        p.enqueue(ckpt, "r.0.1")
        assert store.entered.wait(5)  # r.0.1 is uploading (held)
        for step in (2, 3, 4):
            (ckpt / "config.json").write_text(f'{{"step": {step}}}')
            p.enqueue(ckpt, f"r.0.{step}")
        assert _wait(lambda: p.status().pending[-1:] == ("r.0.4",) and p.status().superseded >= 2)
        store.gate.set()
        assert p.flush(10)
        assert store.attempts == ["r.0.1", "r.0.4"]
        assert store.list_tags() == ["r.0.1", "r.0.4"]
    assert (tmp_path / "s" / "tags" / "r.0.4" / "config.json").read_text() == '{"step": 4}'


def test_pusher_new_snapshot_replaces_failed_one(tmp_path, ckpt):
    store = GatedFlakyStore(tmp_path / "s", fail=1)
    with BackgroundPusher(store, tmp_path / "staging", retry_interval=0.3) as p:
        p.enqueue(ckpt, "r.0.1")
        assert _wait(lambda: p.status().failures == 1)
        p.enqueue(ckpt, "r.0.2")
        assert p.flush(10)
        assert store.attempts == ["r.0.1", "r.0.2"] and store.list_tags() == ["r.0.2"]


def test_pusher_missing_checkpoint_reported(tmp_path):
    with BackgroundPusher(LocalStore(tmp_path / "s"), tmp_path / "staging") as p:
        p.enqueue(tmp_path / "nope", "r.0.1")
        assert p.flush(5)
        st = p.status()
        assert st.last_error_tag == "r.0.1" and "does not exist" in st.last_error and st.pushed == 0


def test_enqueue_requires_start_and_valid_tag(tmp_path, ckpt):
    p = BackgroundPusher(LocalStore(tmp_path / "s"), tmp_path / "staging")
    with pytest.raises(RuntimeError):
        p.enqueue(ckpt, "r.0.1")
    with pytest.raises(TagError):
        p.enqueue(ckpt, "bad tag")
