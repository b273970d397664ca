"""Local-directory model store (the sandbox default), same tag scheme as the Hub.

Layout under the root::

    tags/<run_id>.<epoch>.<inner_step>/   one complete checkpoint per tag
    latest                                the last pushed tag, one line
    .staging/                             in-progress copies (safe to delete when idle)

A tag appears only complete and fsynced (docs/model-store.md, "Local directory backend").
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from dtrain.atomic import fsync_dir
from dtrain.hub.base import (
    ProgressCallback,
    ProgressEvent,
    PushResult,
    StoreError,
    StoreNotFoundError,
    emit,
    folder_files,
)
from dtrain.hub.tags import is_tag, newest, parse_tag

_CHUNK = 1 << 20


def _copy_tree(
    src: Path, dst: Path, progress: ProgressCallback | None, stage: str, total: int | None = None
) -> int:
    """Copy src's regular files into dst, fsyncing each; returns bytes copied."""
    files = folder_files(src)
    if total is None:
        total = sum(f.stat().st_size for f in files)
    done = 0
    emit(progress, ProgressEvent(stage, 0, total))
    for f in files:
        rel = f.relative_to(src)
        out = dst / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(f, "rb") as fi, open(out, "wb") as fo:
            while True:
                buf = fi.read(_CHUNK)
                if not buf:
                    break
                fo.write(buf)
                done += len(buf)
                emit(progress, ProgressEvent(stage, done, max(total, done)))
            fo.flush()
            os.fsync(fo.fileno())
        shutil.copystat(f, out, follow_symlinks=True)
    return done


class LocalStore:
    """ModelStore over a directory. ``root`` may be a path or a ``file://`` URL."""

    def __init__(self, root: str | os.PathLike) -> None:
        r = str(root)
        if r.startswith("file://"):
            r = r[len("file://") :]
        self.root = Path(r).expanduser().absolute()
        self.target = self.root.as_uri()

    @property
    def tags_dir(self) -> Path:
        return self.root / "tags"

    def _tag_dir(self, tag: str) -> Path:
        parse_tag(tag)  # also refuses anything that could escape tags/ (slashes, "..")
        return self.tags_dir / tag

    def push(self, folder: str | os.PathLike, tag: str, progress: ProgressCallback | None = None) -> PushResult:
        src = Path(folder)
        final = self._tag_dir(tag)
        files = folder_files(src)
        total = sum(f.stat().st_size for f in files)
        try:
            self.tags_dir.mkdir(parents=True, exist_ok=True)
            staging_root = self.root / ".staging"
            staging_root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(f"cannot create model store at {self.root}: {e.strerror or e}") from e

        existed = final.is_dir()
        if not existed:
            emit(progress, ProgressEvent("prepare", 0, total, message=f"copying into {self.root}"))
            staging = staging_root / f"{tag}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
            try:
                _copy_tree(src, staging, progress, "upload", total)
                fsync_dir(staging)
                try:
                    os.rename(staging, final)
                except OSError:
                    # Another pusher won the race for this tag: tags are immutable, keep theirs.
                    if not final.is_dir():
                        raise
                    existed = True
                fsync_dir(self.tags_dir)
            except OSError as e:
                raise StoreError(f"push of {tag} to {self.root} failed: {e.strerror or e}") from e
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        emit(progress, ProgressEvent("tag", total, total, message=tag))
        self._write_latest(tag)
        emit(progress, ProgressEvent("done", total, total, message=tag))
        return PushResult(
            target=self.target,
            tag=tag,
            revision=tag,
            url=final.as_uri(),
            attempts=1,
            already_existed=existed,
            bytes_total=total,
        )

    def _write_latest(self, tag: str) -> None:
        tmp = self.root / f".latest.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(tag + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.root / "latest")
            fsync_dir(self.root)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise StoreError(f"cannot update {self.root / 'latest'}: {e.strerror or e}") from e

    def list_tags(self) -> list[str]:
        if not self.tags_dir.is_dir():
            return []
        tags = [p.name for p in self.tags_dir.iterdir() if p.is_dir() and is_tag(p.name)]
        return sorted(tags, key=lambda t: (parse_tag(t).run_id, parse_tag(t).epoch, parse_tag(t).inner_step))

    def latest(self, run_id: str | None = None) -> str | None:
        """The last pushed tag (the ``latest`` pointer), or the newest tag if it is missing.

        With ``run_id``, the pointer is used only if it belongs to that run; otherwise the
        newest tag of the run.
        """
        try:
            pointer = (self.root / "latest").read_text(encoding="utf-8").strip()
        except OSError:
            pointer = ""
        if pointer and is_tag(pointer) and (self.tags_dir / pointer).is_dir():
            if run_id is None or parse_tag(pointer).run_id == run_id:
                return pointer
        return newest(self.list_tags(), run_id)

    def fetch(self, tag: str, dest: str | os.PathLike, progress: ProgressCallback | None = None) -> Path:
        src = self._tag_dir(tag)
        if not src.is_dir():
            raise StoreNotFoundError(f"tag {tag!r} not found in {self.root}")
        out = Path(dest)
        if out.exists() and any(out.iterdir()):
            raise StoreError(f"fetch destination {out} exists and is not empty")
        tmp = out.with_name(f".{out.name}.fetch.{uuid.uuid4().hex[:8]}")
        try:
            _copy_tree(src, tmp, progress, "download")
            if out.exists():
                out.rmdir()
            os.rename(tmp, out)
        except OSError as e:
            raise StoreError(f"fetch of {tag} into {out} failed: {e.strerror or e}") from e
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        emit(progress, ProgressEvent("done", message=tag))
        return out
