"""What every docs generator in scripts/ does with its output: write it, or (--check) say it is stale."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def check_flag(description: str | None = None) -> bool:
    """Parse the generators' one flag: True for ``--check``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is stale instead of writing it")
    return parser.parse_args().check


def write_or_check(path: Path, fresh: str, *, check: bool, what: str, note: str = "") -> int:
    """Write ``fresh`` to ``path``; with ``check``, only compare and name the command that fixes it."""
    rel = path.relative_to(ROOT)
    if check:
        if not path.exists() or path.read_text() != fresh:
            script = Path(sys.argv[0]).name
            print(f"{rel} {what} stale (run: python scripts/{script})", file=sys.stderr)
            return 1
        return 0
    path.write_text(fresh)
    print(f"wrote {rel}{note}")
    return 0
