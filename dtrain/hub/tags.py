"""Checkpoint tag scheme shared by every store: ``{run_id}.{epoch}.{inner_step}``.

The same string is a git tag on the Hub and a directory name in a local store, so it must
be valid for both: run_ids are restricted to ``[A-Za-z0-9][A-Za-z0-9_-]{0,63}`` (no dot,
since the dot separates the fields; no slash, space or other git-ref specials).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_RUN_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
_TAG_RE = re.compile(r"(?P<run>[A-Za-z0-9][A-Za-z0-9_-]{0,63})\.(?P<epoch>0|[1-9][0-9]*)\.(?P<step>0|[1-9][0-9]*)")


class TagError(ValueError):
    """A run_id or tag that does not follow the scheme."""


@dataclass(frozen=True, order=True)
class Tag:
    # Field order gives the natural ordering within a run: epoch, then inner step.
    epoch: int
    inner_step: int
    run_id: str

    def __str__(self) -> str:
        return f"{self.run_id}.{self.epoch}.{self.inner_step}"


def validate_run_id(run_id: str) -> str:
    """Return run_id unchanged, or raise TagError saying what is allowed."""
    if not isinstance(run_id, str) or not _RUN_ID_RE.fullmatch(run_id):
        raise TagError(
            f"invalid run_id {run_id!r}: use 1-64 characters from A-Z a-z 0-9 '_' '-', "
            "starting with a letter or digit (no dots, slashes or spaces)"
        )
    return run_id


def format_tag(run_id: str, epoch: int, inner_step: int) -> str:
    validate_run_id(run_id)
    for name, v in (("epoch", epoch), ("inner_step", inner_step)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise TagError(f"{name} must be a non-negative integer, got {v!r}")
    return f"{run_id}.{epoch}.{inner_step}"


def parse_tag(tag: str) -> Tag:
    m = _TAG_RE.fullmatch(tag) if isinstance(tag, str) else None
    if m is None:
        raise TagError(f"invalid checkpoint tag {tag!r}: expected '<run_id>.<epoch>.<inner_step>'")
    return Tag(epoch=int(m["epoch"]), inner_step=int(m["step"]), run_id=m["run"])


def is_tag(tag: str) -> bool:
    try:
        parse_tag(tag)
    except TagError:
        return False
    return True


def newest(tags: list[str] | tuple[str, ...] | set[str], run_id: str | None = None) -> str | None:
    """The newest scheme tag (highest epoch, then inner step), optionally within one run.

    Tags that do not follow the scheme are ignored (a repo may carry other tags).
    """
    parsed = [parse_tag(t) for t in tags if is_tag(t)]
    if run_id is not None:
        parsed = [t for t in parsed if t.run_id == run_id]
    if not parsed:
        return None
    return str(max(parsed, key=lambda t: (t.epoch, t.inner_step, t.run_id)))
