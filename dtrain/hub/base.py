"""The model-store contract shared by the Hub and local-directory backends."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol, runtime_checkable

log = logging.getLogger("dtrain.hub")


class StoreError(Exception):
    """A store operation failed. ``retryable`` says whether trying again may help."""

    def __init__(self, message: str, *, retryable: bool = False, attempts: int = 0) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.attempts = attempts


class StoreAuthError(StoreError):
    """Missing/invalid credentials or no permission (HTTP 401/403). Never retried."""


class StoreNotFoundError(StoreError):
    """The repo, tag or directory does not exist (HTTP 404). Never retried."""


@dataclass(frozen=True)
class ProgressEvent:
    """One progress report. ``stage`` is one of STAGES; byte counts are 0 when unknown.

    The CLI draws a bar from ``bytes_done / bytes_total`` and shows ``stage``/``message``.
    """

    stage: str
    bytes_done: int = 0
    bytes_total: int = 0
    attempt: int = 1
    message: str = ""


STAGES = ("snapshot", "prepare", "upload", "download", "tag", "retry", "done")

ProgressCallback = Callable[[ProgressEvent], None]


def emit(progress: ProgressCallback | None, event: ProgressEvent) -> None:
    """Report progress; a broken callback must never break an upload."""
    if progress is None:
        return
    try:
        progress(event)
    except Exception:  # noqa: BLE001 - the callback is UI code, not ours to fail on
        log.debug("progress callback raised", exc_info=True)


@dataclass(frozen=True)
class PushResult:
    target: str  # e.g. "hf://owner/repo" or "file:///abs/path"
    tag: str
    revision: str  # commit id on the Hub; the tag itself for a local store
    url: str  # where a human (or fetch) finds it
    attempts: int = 1  # total attempts across all steps (1 = no retry was needed)
    already_existed: bool = False  # the tag was already there (retried or repeated push)
    bytes_total: int = 0


@runtime_checkable
class ModelStore(Protocol):
    """Where checkpoints go. Implementations: LocalStore, HfStore.

    A checkpoint is an opaque folder of files; tags follow ``dtrain.hub.tags``. Tags are
    immutable: pushing a tag that already exists leaves it as it is and reports
    ``already_existed=True`` (this makes a retried push idempotent).
    """

    target: str

    def push(self, folder: str | os.PathLike, tag: str, progress: ProgressCallback | None = None) -> PushResult: ...

    def list_tags(self) -> list[str]: ...

    def latest(self, run_id: str | None = None) -> str | None: ...

    def fetch(self, tag: str, dest: str | os.PathLike, progress: ProgressCallback | None = None) -> Path: ...


def folder_files(folder: Path) -> list[Path]:
    """Regular files under folder (recursively), sorted; symlinks are followed for files."""
    if not folder.is_dir():
        raise StoreNotFoundError(f"checkpoint folder {folder} does not exist or is not a directory")
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    if not files:
        raise StoreError(f"checkpoint folder {folder} is empty; nothing to push")
    return files
