"""CLI start-up: `dtrain --help` against `btcli --help`, measured in the same run.

    python benchmarks/cli_startup.py [--runs 15] [--json]

Both are Typer apps started as fresh processes, the way an operator (or a TAB
press of shell completion) starts them. Runs are interleaved so machine noise
hits both alike; the median wall time of each is compared. Target: dtrain at
most a quarter of btcli's time (ratio <= 0.25).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time


def time_once(argv: list[str], env: dict[str, str] | None = None) -> float:
    start = time.perf_counter()
    subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True,
                   env={**os.environ, **(env or {})})
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    bindir = os.path.dirname(sys.executable)
    dtrain = shutil.which("dtrain", path=bindir) or shutil.which("dtrain")
    btcli = shutil.which("btcli", path=bindir) or shutil.which("btcli")
    if not dtrain or not btcli:
        print("needs both `dtrain` and `btcli` on PATH (pip install -e . installs both)", file=sys.stderr)
        return 1
    cases = {
        "dtrain_help": [dtrain, "--help"],
        "btcli_help": [btcli, "--help"],
    }
    completion = {"_DTRAIN_COMPLETE": "complete_bash", "COMP_WORDS": "dtrain bench", "COMP_CWORD": "1"}
    samples: dict[str, list[float]] = {name: [] for name in cases}
    samples["dtrain_completion"] = []
    for name, argv in cases.items():  # warm the page cache before measuring
        time_once(argv)
    for _ in range(args.runs):
        for name, argv in cases.items():
            samples[name].append(time_once(argv))
        samples["dtrain_completion"].append(time_once([dtrain], completion))

    medians = {name: statistics.median(values) for name, values in samples.items()}
    result = {
        "runs": args.runs,
        "dtrain_help_s": round(medians["dtrain_help"], 4),
        "btcli_help_s": round(medians["btcli_help"], 4),
        "dtrain_completion_s": round(medians["dtrain_completion"], 4),
        "ratio": round(medians["dtrain_help"] / medians["btcli_help"], 3),
        "target_ratio": 0.25,
    }
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>22}: {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
