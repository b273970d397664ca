"""Host memory per parameter of a miner's and a validator's whole process tree, per mode and model.

Each run is a real ``dtrain sandbox --model PRESET --mode MODE`` (2 miners and a validator, each
its own ``dtrain mine`` / ``dtrain validate`` process with hivemind's DHT, averager and p2pd);
the sandbox samples every process tree's Pss every 0.5 s and reports each tree's peak
(dtrain/procmem.py). Pss, not RSS: the forked DHT and averager share pages with the neuron.

What is reported, per mode and model, as the median over ``--repeats`` runs with its spread:

* ``miner_peak`` / ``validator_peak``: the worst miner tree's and the validator tree's peak Pss;
* ``miner_bytes_per_param`` / ``validator_bytes_per_param``: (peak - the same role's peak at the
  ``tiny`` preset, the runtime: interpreter, torch, hivemind, p2pd) / the preset's parameters;
* ``ratio_to_adamw``: miner bytes per parameter over the baseline, mixed-precision AdamW's 16
  bytes per parameter (weights, gradients and two moments; ZeRO's accounting), the floor any
  trainer of these models pays before DiLoCo's anchor and momentum (8 more).

    python benchmarks/memory.py --json                      # tiny and gpt2-124m, both modes, 3 runs
    python benchmarks/memory.py --models tiny,gpt2-250m --modes diloco --repeats 1

Linux only (it reads /proc). The runs share this machine's cores: figures are of memory, which
does not depend on speed, but each run takes minutes at gpt2-124m on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ADAMW_BYTES_PER_PARAM = 16.0  # fp32 weights + gradients + exp_avg + exp_avg_sq (ZeRO's mixed-precision count)
RUNTIME_PRESET = "tiny"
REPO = Path(__file__).resolve().parents[1]


def run_sandbox(model: str, mode: str, *, miners: int, rounds: int, timeout_s: float) -> dict:
    """One sandbox run's summary (its JSON); RuntimeError naming why it did not give one."""
    with tempfile.TemporaryDirectory(prefix="dtrain-memory-") as tmp:
        argv = [sys.executable, "-m", "dtrain", "sandbox", "--model", model, "--mode", mode, "--miners", str(miners),
                "--rounds", str(rounds), "--json", "--no-dashboard", "--dir", str(Path(tmp) / "sandbox")]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(REPO),
                                env={**os.environ, "PYTHONPATH": str(REPO)})
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except BaseException:  # a timeout or Ctrl-C: the sandbox stops its neurons on SIGINT
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv[2:])} exited {proc.returncode}: {err.strip()[-800:]}")
        return json.loads(out)


def peaks_of(summary: dict) -> dict:
    """The worst miner tree's and the validator tree's peak Pss, and each's processes."""
    rows = {r["name"]: r for r in summary.get("memory") or []}
    roles = {m["name"]: "miner" for m in summary.get("miners") or []}
    miners = [rows[n] for n in roles if n in rows]
    validators = [r for n, r in rows.items() if n.startswith("validator")]
    if not miners or not validators:
        raise RuntimeError("the sandbox summary has no memory rows (is /proc readable?)")
    worst = max(miners, key=lambda r: r["peak_pss"])
    statuses = [r.get("status") for r in summary.get("rounds") or []]
    return {"miner": worst["peak_pss"], "miner_processes": worst["processes"],
            "validator": validators[0]["peak_pss"], "validator_processes": validators[0]["processes"],
            "parameters": (summary.get("model") or {}).get("parameters"),
            "rounds_ok": bool(statuses) and all(s == "success" for s in statuses),
            "loss": summary.get("loss", {}).get("curve")}


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def measure(models: list[str], modes: list[str], *, repeats: int, miners: int, rounds: int, timeout_s: float,
            log=print) -> dict:
    """{mode: {model: figures}}; every model's bytes per parameter are beyond the tiny preset's tree."""
    out: dict = {}
    for mode in modes:
        runs: dict[str, list[dict]] = {}
        for model in [RUNTIME_PRESET] + [m for m in models if m != RUNTIME_PRESET]:
            for i in range(repeats):
                t0 = time.monotonic()
                runs.setdefault(model, []).append(peaks_of(run_sandbox(model, mode, miners=miners, rounds=rounds,
                                                                       timeout_s=timeout_s)))
                last = runs[model][-1]
                log(f"{mode} {model} run {i + 1}/{repeats}: miner {last['miner'] / 1e9:.2f} GB, validator "
                    f"{last['validator'] / 1e9:.2f} GB, rounds ok {last['rounds_ok']} "
                    f"({time.monotonic() - t0:.0f} s)")
        out[mode] = summarise(runs)
    return out


def summarise(runs: dict[str, list[dict]]) -> dict:
    """Medians and spreads per model; bytes per parameter against the runtime preset's medians."""
    base = runs[RUNTIME_PRESET]
    base_miner = statistics.median(r["miner"] for r in base)
    base_validator = statistics.median(r["validator"] for r in base)
    figures = {}
    for model, rs in runs.items():
        params = rs[0]["parameters"]
        doc = {"parameters": params, "miner_peak": spread([r["miner"] for r in rs]),
               "validator_peak": spread([r["validator"] for r in rs]),
               "miner_processes": rs[-1]["miner_processes"], "validator_processes": rs[-1]["validator_processes"],
               "rounds_ok": all(r["rounds_ok"] for r in rs), "loss_curves": [r["loss"] for r in rs]}
        if model != RUNTIME_PRESET and params:
            miner_bpp = [(r["miner"] - base_miner) / params for r in rs]
            doc["miner_bytes_per_param"] = spread(miner_bpp)
            doc["validator_bytes_per_param"] = spread([(r["validator"] - base_validator) / params for r in rs])
            doc["ratio_to_adamw"] = statistics.median(miner_bpp) / ADAMW_BYTES_PER_PARAM
        figures[model] = doc
    return figures


def render(result: dict) -> str:
    lines = [f"peak Pss per process tree; bytes/param beyond the {RUNTIME_PRESET} preset's tree (the runtime); "
             f"baseline: AdamW's {ADAMW_BYTES_PER_PARAM:g} bytes/param"]
    lines.append(f"{'mode':<9}{'model':<11}{'params':>8}{'miner GB':>10}{'B/param':>9}{'validator GB':>14}"
                 f"{'B/param':>9}{'÷ AdamW':>9}")
    for mode, models in result["figures"].items():
        for model, f in models.items():
            mb, vb = f.get("miner_bytes_per_param"), f.get("validator_bytes_per_param")
            lines.append(f"{mode:<9}{model:<11}{f['parameters'] / 1e6:>7.1f}M{f['miner_peak']['median'] / 1e9:>10.2f}"
                         f"{(mb['median'] if mb else float('nan')):>9.1f}{f['validator_peak']['median'] / 1e9:>14.2f}"
                         f"{(vb['median'] if vb else float('nan')):>9.1f}{f.get('ratio_to_adamw', float('nan')):>9.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="tiny,gpt2-124m", help="comma-separated presets (tiny is always run)")
    ap.add_argument("--modes", default="gradient,diloco")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--miners", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per sandbox run")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if not os.path.exists("/proc/self/smaps_rollup"):
        print("benchmarks/memory.py reads /proc/*/smaps_rollup: Linux only", file=sys.stderr)
        return 2
    command = "python benchmarks/memory.py " + " ".join(argv if argv is not None else sys.argv[1:])
    figures = measure([m for m in args.models.split(",") if m], [m for m in args.modes.split(",") if m],
                      repeats=args.repeats, miners=args.miners, rounds=args.rounds, timeout_s=args.timeout,
                      log=lambda s: print(s, file=sys.stderr, flush=True))
    result = {"command": command.strip(), "baseline_bytes_per_param": ADAMW_BYTES_PER_PARAM,
              "runtime_preset": RUNTIME_PRESET, "cpus": os.cpu_count(), "figures": figures}
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
