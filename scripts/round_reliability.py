"""Run `dtrain sandbox` again and again and check that no honest miner is ever hurt by the
protocol's own timing (issue #50's bar): every round averages every miner, and no honest miner
is FAIL, named in a note, gated or on probation.

    python scripts/round_reliability.py --runs 50 -- --protocol dtrain
    python scripts/round_reliability.py --runs 5 -- --protocol dtrain --miners 12 --check 3 --rounds 8

Arguments after ``--`` go to `dtrain sandbox` (``--json`` and ``--dir`` are added). It stops at
the first run that breaks the bar, keeps that run's directory and prints why; it prints one JSON
line per run and a summary at the end. Exit 0 when every run held.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def problems(doc: dict) -> list[str]:
    """What in one sandbox summary breaks the bar (empty: it held)."""
    honest = {m["uid"] for m in doc["miners"] if m["kind"] == "honest"}
    found = []
    for r in doc["rounds"]:
        if r["status"] != "success":
            found.append(f"round {r['round']}: {r['status']} ({r.get('error', '')})")
        missing = honest - set(r["averaged"])
        if missing:
            found.append(f"round {r['round']}: miners {sorted(missing)} not averaged")
        for uid in sorted(honest & {int(u) for u in r["outcomes"]}):  # the miners the validators scored
            outcome, note = r["outcomes"][str(uid)], r["notes"].get(str(uid))
            if outcome != "SUCCESS" or note:
                found.append(f"round {r['round']}: miner {uid} {outcome}: {note}")
    for m in doc["miners"]:
        if m["uid"] in honest and (m.get("gated") or m["weight"] <= 0):
            found.append(f"miner {m['uid']}: weight {m['weight']}, gated {m.get('gated')}")
    return found


def main() -> int:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds one sandbox may take")
    args = parser.parse_args(own)
    held, walls = 0, []
    for run in range(1, args.runs + 1):
        root = Path(tempfile.mkdtemp(prefix="dtrain-reliability-")) / "box"
        t0 = time.monotonic()
        result = subprocess.run([sys.executable, "-m", "dtrain", "sandbox", *extra, "--json", "--dir", str(root)],
                                capture_output=True, text=True, timeout=args.timeout)
        wall = time.monotonic() - t0
        try:
            found = problems(json.loads(result.stdout)) if result.returncode == 0 else [
                f"exit {result.returncode}: {result.stderr[-500:]}"]
        except json.JSONDecodeError:
            found = [f"no JSON summary: {result.stderr[-500:]}"]
        print(json.dumps({"run": run, "wall_s": round(wall, 1), "problems": found}), flush=True)
        if found:
            print(json.dumps({"runs": run, "held": held, "kept": str(root)}))
            return 1
        held += 1
        walls.append(wall)
        shutil.rmtree(root.parent, ignore_errors=True)
    walls.sort()
    print(json.dumps({"runs": args.runs, "held": held, "median_wall_s": round(walls[len(walls) // 2], 1),
                      "args": extra}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
