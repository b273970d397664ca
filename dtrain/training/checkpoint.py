"""Atomic, verifiable checkpoints, and the publishing extras ``dtrain push`` reads beside them.

Every file is written to a temp name, fsynced and renamed, and ``LATEST`` names the current
checkpoint with its size and SHA-256, so a kill at any instant leaves a complete, verifiable
checkpoint. Layout and guarantees: docs/training.md ("Checkpoints"); ``PUBLISH`` and the
tokenizer copy: docs/model-store.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

from dtrain.atomic import publish_dir, replacing, write_bytes
from dtrain.training.errors import CheckpointError

FORMAT = "dtrain-checkpoint/1"
LATEST = "LATEST"
PUBLISH = "PUBLISH"
PUBLISH_FORMAT = "dtrain-publish/1"
_TOKENIZER = re.compile(r"^tokenizer-[0-9a-f]{16}$")
_NAME = re.compile(r"^ckpt-(\d{8})\.pt$")


class _HashingWriter:
    """File wrapper that hashes and counts bytes as torch.save writes them."""

    def __init__(self, f, on_write: Callable[[int], None] | None):
        self._f = f
        self.sha = hashlib.sha256()
        self.size = 0
        self._on_write = on_write

    def write(self, b) -> int:
        n = self._f.write(b)
        self.sha.update(memoryview(b)[:n] if n is not None else b)
        self.size += n if n is not None else len(b)
        if self._on_write is not None:
            self._on_write(self.size)
        return n

    def flush(self) -> None:
        self._f.flush()


def read_manifest(directory: str | os.PathLike) -> dict | None:
    """The LATEST manifest of a checkpoint directory, or None when there is none yet."""
    path = Path(directory) / LATEST
    if not path.exists():
        return None
    try:
        m = json.loads(path.read_text(encoding="utf-8"))
        if m.get("format") != FORMAT or not _NAME.match(m.get("file", "")):
            raise ValueError("unexpected content")
        return m
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            f"checkpoint manifest {path} is unreadable ({exc}); restore it from a backup or "
            "delete the directory to start from scratch"
        ) from exc


def save_checkpoint(
    directory: str | os.PathLike,
    state: dict[str, Any],
    *,
    on_write: Callable[[int], None] | None = None,
) -> Path:
    """Atomically write ``state`` as the newest checkpoint of ``directory``; return its path.

    ``on_write(bytes_written)`` is called as the payload is written (progress display).
    """
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    prev = read_manifest(d)
    seq = prev["seq"] + 1 if prev else 1
    final = d / f"ckpt-{seq:08d}.pt"
    payload = {"format": FORMAT, **state}
    # An interrupted write leaves the previous checkpoint as LATEST and no partial file.
    with replacing(final) as f:
        w = _HashingWriter(f, on_write)
        torch.save(payload, w)
    entry = {"format": FORMAT, "seq": seq, "file": final.name, "size": w.size, "sha256": w.sha.hexdigest()}
    if prev:
        entry["previous"] = {k: prev[k] for k in ("seq", "file", "size", "sha256")}
    write_bytes(d / LATEST, json.dumps(entry, indent=1).encode())
    # Now that LATEST names the new file, everything but it and its predecessor can go.
    keep = {final.name, prev["file"] if prev else None}
    for p in d.iterdir():
        if (_NAME.match(p.name) and p.name not in keep) or ".tmp-" in p.name:
            try:
                p.unlink()
            except OSError:
                pass
    return final


def _verify_and_load(path: Path, size: int | None, sha256: str | None, map_location) -> dict:
    hint = ("restore it from a backup, load the previous checkpoint (which='previous'), "
            "or delete the checkpoint directory to start from scratch")
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} is missing; {hint}")
    if size is not None and path.stat().st_size != size:
        raise CheckpointError(f"checkpoint {path} is corrupt (size {path.stat().st_size}, expected {size}); {hint}")
    if sha256 is not None:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        if h.hexdigest() != sha256:
            raise CheckpointError(f"checkpoint {path} is corrupt (SHA-256 mismatch); {hint}")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"checkpoint {path} cannot be read ({type(exc).__name__}: {exc}); {hint}") from exc
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a {FORMAT} checkpoint; {hint}")
    return state


def load_checkpoint(
    location: str | os.PathLike,
    *,
    which: str = "latest",
    map_location: str | torch.device = "cpu",
) -> dict[str, Any]:
    """Load a checkpoint from a directory (``which``: 'latest' or 'previous') or a .pt file.

    Raises CheckpointError naming the file when it is missing or corrupt. There is no
    automatic fallback to the previous checkpoint: the caller decides.
    """
    p = Path(location)
    if p.is_file():
        return _verify_and_load(p, None, None, map_location)
    m = read_manifest(p)
    if m is None:
        raise CheckpointError(f"no checkpoint in {p} (no {LATEST} file); start fresh or point at the right directory")
    if which == "previous":
        if "previous" not in m:
            raise CheckpointError(f"{p} has no previous checkpoint")
        m = m["previous"]
    elif which != "latest":
        raise ValueError("which must be 'latest' or 'previous'")
    return _verify_and_load(p / m["file"], m["size"], m["sha256"], map_location)


# ---------------------------------------------------------------------------- publishing extras


def _tree_digest(folder: Path) -> str:
    """SHA-256 over the names and bytes of a folder's files (same files -> same digest)."""
    h = hashlib.sha256()
    for p in sorted(q for q in folder.rglob("*") if q.is_file()):
        h.update(str(p.relative_to(folder)).encode() + b"\0")
        h.update(p.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


def save_publish_info(directory: str | os.PathLike, *, tokenizer: Any = None, facts: dict | None = None) -> None:
    """Record next to the newest checkpoint what a push needs besides the weights.

    ``tokenizer`` is saved with its own ``save_pretrained`` (once per distinct content);
    ``facts`` (JSON-serialisable, e.g. dtrain.hub.model_card.CardFacts.to_dict()) describe
    this checkpoint for the model card. Call it right after :func:`save_checkpoint`.
    """
    d = Path(directory)
    m = read_manifest(d)
    if m is None:
        raise CheckpointError(f"no checkpoint in {d} to attach publishing info to; save a checkpoint first")
    tok_name = None
    if tokenizer is not None:
        tmp = d / f".tokenizer.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            tokenizer.save_pretrained(str(tmp))
            tok_name = f"tokenizer-{_tree_digest(tmp)[:16]}"
            final = d / tok_name
            if final.is_dir():
                shutil.rmtree(tmp)  # unchanged since the last save: keep the existing copy
            else:
                publish_dir(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    doc = {"format": PUBLISH_FORMAT, "checkpoint": {"seq": m["seq"], "sha256": m["sha256"]},
           "tokenizer": tok_name, "facts": facts or {}}
    write_bytes(d / PUBLISH, json.dumps(doc, indent=1, allow_nan=False).encode())
    # Only now that PUBLISH names the current copy may other tokenizer copies go.
    for p in d.iterdir():
        if (_TOKENIZER.match(p.name) and p.name != tok_name) or p.name.startswith(".tokenizer.tmp-"):
            shutil.rmtree(p, ignore_errors=True)


def read_publish_info(directory: str | os.PathLike) -> tuple[Path | None, dict] | None:
    """(tokenizer folder or None, facts) recorded for the newest checkpoint of ``directory``.

    None when there is nothing, or when what is there describes another checkpoint (the
    writer was killed between the checkpoint and its publishing info) or is unreadable:
    the caller then falls back to what it can rebuild, and says "unknown" for the rest.
    """
    d = Path(directory)
    path = d / PUBLISH
    try:
        m = read_manifest(d)
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, CheckpointError):
        return None
    if (m is None or not isinstance(doc, dict) or doc.get("format") != PUBLISH_FORMAT
            or doc.get("checkpoint") != {"seq": m["seq"], "sha256": m["sha256"]}):
        return None
    name = doc.get("tokenizer")
    tok = d / name if isinstance(name, str) and _TOKENIZER.match(name) and (d / name).is_dir() else None
    facts = doc.get("facts")
    return tok, facts if isinstance(facts, dict) else {}
