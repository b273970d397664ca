"""Regenerate the shell completion scripts in completions/.

    python scripts/gen_completions.py          # rewrite completions/
    python scripts/gen_completions.py --check  # exit 1 if any file is stale

The scripts come from Typer's own generator (``_DTRAIN_COMPLETE=source_<shell>``),
run through the installed ``dtrain`` entry point so they match what users get.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

SHELLS = {"bash": "dtrain.bash", "zsh": "_dtrain", "fish": "dtrain.fish"}
ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "completions"


def generate(shell: str) -> str:
    env = {**os.environ, "_DTRAIN_COMPLETE": f"source_{shell}"}
    cmd = [sys.executable, "-c", "import sys; sys.argv[0] = 'dtrain'; from dtrain.cli.app import main; main()"]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return result.stdout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="report stale files instead of writing them")
    args = parser.parse_args()
    stale = []
    OUT.mkdir(exist_ok=True)
    for shell, name in SHELLS.items():
        text = generate(shell)
        path = OUT / name
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path.relative_to(ROOT)))
        else:
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    if stale:
        print("stale completion scripts: " + ", ".join(stale) + " (run: python scripts/gen_completions.py)")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
