"""Background checkpoint pushes for miners: training never waits for the network.

A snapshot thread copies each queued checkpoint into staging (again if a file changed while it
copied), and an upload thread pushes the newest snapshot, retrying failures with a growing
interval; a newer snapshot replaces an older one (latest wins). docs/model-store.md,
"Background pushes (miners)".
"""

from __future__ import annotations

import os
import shutil
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from dtrain.hub.base import (
    ModelStore,
    ProgressCallback,
    ProgressEvent,
    PushResult,
    StoreError,
    emit,
    folder_files,
    log,
)
from dtrain.hub.tags import parse_tag

_PREFIX = "snap-"


@dataclass(frozen=True)
class PusherStatus:
    """A consistent copy of the pusher's state, for dashboards and logs."""

    last_success_tag: str | None = None
    last_success_at: float | None = None  # time.time()
    last_result: PushResult | None = None
    last_error: str | None = None
    last_error_tag: str | None = None
    last_error_at: float | None = None
    pending: tuple[str, ...] = ()  # tags not yet pushed, oldest first
    uploading: str | None = None
    next_retry_in: float | None = None  # seconds until the next retry, if one is scheduled
    pushed: int = 0
    failures: int = 0  # failed upload attempts in total
    consecutive_failures: int = 0
    superseded: int = 0  # snapshots dropped because a newer one was queued
    running: bool = False


@dataclass
class _Snap:
    tag: str
    path: Path


@dataclass
class _Shared:
    to_snapshot: tuple[Path, str] | None = None
    snapshotting: str | None = None
    ready: _Snap | None = None
    uploading: str | None = None
    retry_at: float | None = None
    status: PusherStatus = field(default_factory=PusherStatus)


def _signature(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder_files(folder)}


class BackgroundPusher:
    def __init__(
        self,
        store: ModelStore,
        staging_dir: str | os.PathLike,
        *,
        retry_interval: float = 30.0,
        max_retry_interval: float = 600.0,
        snapshot_attempts: int = 3,
        progress: ProgressCallback | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.staging = Path(staging_dir)
        self.retry_interval = retry_interval
        self.max_retry_interval = max_retry_interval
        self.snapshot_attempts = snapshot_attempts
        self.progress = progress
        self._clock = clock
        self._cv = threading.Condition()
        self._s = _Shared()
        self._stop = False
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> "BackgroundPusher":
        if self._threads:
            return self
        self.staging.mkdir(parents=True, exist_ok=True)
        # Leftovers of a previous process (crash mid-copy); only our own naming pattern.
        for p in self.staging.glob(_PREFIX + "*"):
            shutil.rmtree(p, ignore_errors=True)
        self._stop = False
        for name, target in (("snapshot", self._snapshot_loop), ("upload", self._upload_loop)):
            t = threading.Thread(target=target, name=f"dtrain-pusher-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        self._update(running=True)
        return self

    def stop(self, *, drain: bool = False, timeout: float | None = None) -> bool:
        """Stop the threads. With ``drain``, first wait (up to ``timeout``) for pending pushes.

        Returns True when nothing was left pending.
        """
        done = self.flush(timeout) if drain else not self.status().pending
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        for t in self._threads:
            t.join(timeout=5 if timeout is None else max(0.1, timeout))
        self._threads = []
        self._update(running=False)
        return done

    def __enter__(self) -> "BackgroundPusher":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ API

    def enqueue(self, checkpoint_dir: str | os.PathLike, tag: str) -> None:
        """Queue a push and return at once. A push queued before the previous one was
        snapshotted replaces it (latest wins)."""
        parse_tag(tag)
        if not self._threads:
            raise RuntimeError("BackgroundPusher.enqueue called before start()")
        with self._cv:
            if self._s.to_snapshot is not None:
                self._bump_superseded()
            self._s.to_snapshot = (Path(checkpoint_dir), tag)
            self._refresh_pending()
            self._cv.notify_all()

    def status(self) -> PusherStatus:
        with self._cv:
            st = self._s.status
            retry_in = None
            if self._s.retry_at is not None and self._s.ready is not None:
                retry_in = max(0.0, self._s.retry_at - self._clock())
            return replace(st, next_retry_in=retry_in)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued push is done; False if ``timeout`` expired first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._busy():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(timeout=left if left is not None else 1.0)
            return True

    # ------------------------------------------------------------------ internals (call with lock held)

    def _busy(self) -> bool:
        s = self._s
        return any(x is not None for x in (s.to_snapshot, s.snapshotting, s.ready, s.uploading))

    def _update(self, **kw: object) -> None:
        with self._cv:
            self._s.status = replace(self._s.status, **kw)  # type: ignore[arg-type]
            self._cv.notify_all()

    def _bump_superseded(self) -> None:
        self._s.status = replace(self._s.status, superseded=self._s.status.superseded + 1)

    def _refresh_pending(self) -> None:
        s = self._s
        tags = [t for t in (s.uploading, s.ready.tag if s.ready else None, s.snapshotting) if t]
        if s.to_snapshot is not None:
            tags.append(s.to_snapshot[1])
        s.status = replace(s.status, pending=tuple(tags), uploading=s.uploading)

    # ------------------------------------------------------------------ snapshotter

    def _snapshot(self, src: Path, tag: str) -> Path:
        for _ in range(self.snapshot_attempts):
            dest = self.staging / f"{_PREFIX}{tag}-{uuid.uuid4().hex[:8]}"
            before = _signature(src)
            try:
                for rel in before:
                    out = dest / rel
                    out.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(src / rel, out)
                after = _signature(src)
            except (OSError, StoreError):
                # The trainer may be replacing files right now; try again from scratch.
                shutil.rmtree(dest, ignore_errors=True)
                continue
            if before == after:
                return dest
            shutil.rmtree(dest, ignore_errors=True)
        raise StoreError(f"checkpoint {src} kept changing (or vanished) while it was being snapshotted for {tag}")

    def _snapshot_loop(self) -> None:
        while True:
            with self._cv:
                while not self._stop and self._s.to_snapshot is None:
                    self._cv.wait()
                if self._stop:
                    return
                assert self._s.to_snapshot is not None
                src, tag = self._s.to_snapshot
                self._s.to_snapshot = None
                self._s.snapshotting = tag
                self._refresh_pending()
            old: _Snap | None = None
            emit(self.progress, ProgressEvent("snapshot", message=f"{tag} from {src}"))
            try:
                path = self._snapshot(src, tag)
            except Exception as e:  # noqa: BLE001 - reported in the status, thread stays alive
                log.warning("snapshot of %s for %s failed: %s", src, tag, e)
                with self._cv:
                    self._s.status = replace(
                        self._s.status, last_error=str(e), last_error_tag=tag, last_error_at=time.time()
                    )
            else:
                with self._cv:
                    if self._s.ready is not None:
                        old = self._s.ready
                        self._bump_superseded()
                    self._s.ready = _Snap(tag, path)
            finally:
                with self._cv:
                    self._s.snapshotting = None
                    self._refresh_pending()
                    self._cv.notify_all()
            if old is not None:
                shutil.rmtree(old.path, ignore_errors=True)

    # ------------------------------------------------------------------ uploader

    def _upload_loop(self) -> None:
        while True:
            snap = self._take_ready()
            if snap is None:
                return
            try:
                result = self.store.push(snap.path, snap.tag, progress=self.progress)
            except Exception as e:  # noqa: BLE001 - any failure is reported and retried later
                log.warning("push of %s failed: %s", snap.tag, e)
                if self._record_failure(snap, e):
                    shutil.rmtree(snap.path, ignore_errors=True)
            else:
                shutil.rmtree(snap.path, ignore_errors=True)
                self._record_success(snap, result)
            finally:
                with self._cv:
                    self._s.uploading = None
                    self._refresh_pending()
                    self._cv.notify_all()

    def _take_ready(self) -> _Snap | None:
        """Wait until a snapshot is ready and its retry time has come, and mark it uploading;
        None once stopped."""
        with self._cv:
            while not self._stop:
                if self._s.ready is not None:
                    wait = 0.0 if self._s.retry_at is None else self._s.retry_at - self._clock()
                    if wait <= 0:
                        break
                    self._cv.wait(timeout=min(wait, 1.0))
                else:
                    self._cv.wait()
            if self._stop:
                return None
            snap = self._s.ready
            assert snap is not None
            self._s.ready = None
            self._s.uploading = snap.tag
            self._refresh_pending()
            return snap

    def _record_failure(self, snap: _Snap, error: Exception) -> bool:
        """Schedule a retry of ``snap`` with a doubling delay; True when a newer snapshot is
        waiting instead (latest wins) and ``snap`` should be dropped."""
        with self._cv:
            st = self._s.status
            n = st.consecutive_failures + 1
            self._s.status = replace(
                st,
                last_error=str(error),
                last_error_tag=snap.tag,
                last_error_at=time.time(),
                failures=st.failures + 1,
                consecutive_failures=n,
            )
            delay = min(self.max_retry_interval, self.retry_interval * 2 ** (n - 1))
            self._s.retry_at = self._clock() + delay
            if self._s.ready is None:
                self._s.ready = snap  # keep it for the retry
                return False
            self._bump_superseded()
            return True

    def _record_success(self, snap: _Snap, result: PushResult) -> None:
        with self._cv:
            st = self._s.status
            self._s.status = replace(
                st,
                last_success_tag=snap.tag,
                last_success_at=time.time(),
                last_result=result,
                pushed=st.pushed + 1,
                consecutive_failures=0,
            )
            self._s.retry_at = None
