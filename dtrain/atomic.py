"""Crash-safe file writes: a reader sees the old file or the new one, never half of one.

Write to a temporary file in the same directory, fsync it, ``os.replace`` it over
the target, then fsync the directory so the rename itself survives a power cut.
Standard library only: config saving uses this on fast CLI paths.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterator


def fsync_dir(directory: str | os.PathLike) -> None:
    """Make renames in ``directory`` durable; a no-op where directories cannot be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(folder: str | os.PathLike) -> None:
    """fsync every file under ``folder`` and the folder itself, before it is renamed into
    place: a rename can reach the disk before the files' data does, and a power loss would
    then leave a complete-looking folder of truncated files."""
    folder = Path(folder)
    for p in folder.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fsync_dir(folder)


def publish_dir(tmp: str | os.PathLike, final: str | os.PathLike) -> None:
    """Make the finished folder ``tmp`` appear as ``final`` (same filesystem), durably:
    its files are on disk before the name is, and the name is on disk when this returns."""
    fsync_tree(tmp)
    os.rename(tmp, final)
    fsync_dir(Path(final).parent)


@contextmanager
def replacing(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """Open a temporary file beside ``path`` for writing; on a clean exit it replaces ``path``.

    The one temp-file / fsync / ``os.replace`` / fsync-directory sequence of the code base:
    a reader of ``path`` sees the old file or the complete new one. If the block raises
    (or the process is interrupted), the partial file is removed and ``path`` is untouched.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with replacing(path) as fh:
        fh.write(data)


def write_text(path: str | os.PathLike, text: str) -> None:
    write_bytes(path, text.encode("utf-8"))
