"""Soak: memory, file descriptors and threads of every neuron over hundreds of sandbox rounds.

    python benchmarks/soak.py [--miners 3] [--rounds 300] [--warmup 20] [--dir D] [--json]

It runs the real sandbox (``dtrain.sandbox.orchestrator.Sandbox``, what ``dtrain sandbox``
runs: embedded chain, real wallets, one validator with ``--max-rounds``, the miners) and,
each time the validator has persisted a round (``round_counter`` in its state.json), samples
the whole process tree of every neuron from /proc: the neuron, hivemind's forked DHT and
averager processes and the p2pd daemon. Each neuron runs in its own session, so its tree is
every process of that session plus their descendants (a p2pd orphaned by its parent still
counts).

Memory. Four sums are recorded per tree and per process kind (neuron, dht, averager, p2pd,
torch_shm): Pss (smaps_rollup), VmRSS, RssAnon+RssShmem ("anon") and USS. The footprint, the
base of the budget, is Pss at the first post-warm-up round: the DHT and averager are forked
from the neuron and share its copy-on-write pages, so a VmRSS sum counts those pages two or
three times. The slope that is judged is anon's (``--metric`` picks another): Pss divides each
shared library page among every process on the machine that maps it, so it moves whenever
another torch process starts or stops (another sandbox on the same host moved it by 10-20 %),
and VmRSS also follows the page cache (file-backed pages). A leaked allocation is anonymous
memory: it shows in anon once, in one process, whoever else runs; a copy-on-write page that
breaks keeps the anon sum as it was (one page counted twice becomes two pages counted once).

After ``--warmup`` rounds, growth is the least-squares slope per round, in bytes and in % of
the tree's starting Pss. Baseline and ratio (the project's benchmark rule): the budget is
0.05 % of the starting footprint per round, and the ratio is the measured slope over that
budget (< 1 passes). File descriptors and threads must be flat: the floor (minimum) of the
last window of rounds (a tenth of them, at least 3) must not be above the floor of the first
post-warm-up window (``--fd-slack``/``--thread-slack`` to allow some); a leak lifts every
later sample, a socket or handler thread open at the moment of one sample does not. The
maxima's rise is reported beside it.

Threads are judged that way for the Python processes. p2pd is a Go program, and Go's runtime
never ends an OS thread it has made (golang/go#14592): a goroutine that blocks in a system
call long enough (a write delayed by a busy host) gets its processor handed to a new thread,
and that thread is kept, idle, for good. p2pd's count is therefore the high-water mark of
threads needed at once and can step up late in any run; it is not a leak while it stays
under what can be needed at once: one thread per processor (GOMAXPROCS, the CPU count by
default), one per descriptor a system call can block on (p2pd's fds, which are judged flat),
and the runtime's own two (sysmon and the template thread). p2pd's maximum must stay under
that bound; its rise is reported. The sample of the last round is left out (the validator
is shutting down then). Exit status 0 within budget, 1 otherwise, 2 if the sandbox failed or
was interrupted (every neuron is stopped either way, on Ctrl-C and SIGTERM too).

    python benchmarks/soak.py --from-json run.json --warmup 50 --metric pss

re-analyses a document written by ``--samples-out`` without a new run.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import sys
import time
from pathlib import Path

# The /proc readings live in the package (the sandbox's summary uses them too); re-exported here.
from dtrain.procmem import (  # noqa: F401
    KINDS, METRICS, all_processes, classify, open_fd_types, proc_stat, process_sample, process_tree, tree_sample,
)

BUDGET_PCT_PER_ROUND = 0.05
GO_RUNTIME_THREADS = 2  # sysmon and the template thread: Go threads that never run goroutines
MEMORY_METRICS = ("pss", "rss", "anon", "uss")
DEFAULT_METRIC = "anon"


# ---------------------------------------------------------------------------- analysis

def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys on xs (0.0 with fewer than two distinct xs)."""
    n = len(xs)
    if n < 2 or n != len(ys):
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return 0.0
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx


def window(n: int) -> int:
    """Rounds in the first/last comparison windows: a tenth of the series, at least 3 (at most n)."""
    return max(1, min(n, max(3, n // 10)))


def series_growth(rounds: list[int], values: list[float], *, budget_pct: float = BUDGET_PCT_PER_ROUND) -> dict:
    """Slope per round, in units and in % of the first value, and the ratio to the budget."""
    if not values:
        return {"n": 0}
    start = values[0]
    per_round = slope([float(r) for r in rounds], [float(v) for v in values])
    pct = 100.0 * per_round / start if start else 0.0
    w = window(len(values))
    return {"n": len(values), "start": start, "end": values[-1], "min": min(values), "max": max(values),
            "median": statistics.median(values), "slope_per_round": per_round, "pct_per_round": pct,
            "ratio_to_budget": pct / budget_pct if budget_pct else None,
            "first_window_max": max(values[:w]), "last_window_max": max(values[-w:]),
            "window_rise": max(values[-w:]) - max(values[:w]),
            "first_window_min": min(values[:w]), "last_window_min": min(values[-w:]),
            "floor_rise": min(values[-w:]) - min(values[:w])}


def _python_threads(tree: dict) -> int:
    """A tree's threads outside p2pd (the Go daemon is judged against a bound instead)."""
    return tree["threads"] - tree["kinds"].get("p2pd", {}).get("threads", 0)


def go_thread_bound(cpus: int, fds: int) -> int:
    """The most OS threads a Go program with ``fds`` descriptors can ever need at once (module doc)."""
    return cpus + fds + GO_RUNTIME_THREADS


def analyse(samples: list[dict], warmup: int, *, budget_pct: float = BUDGET_PCT_PER_ROUND,
            fd_slack: int = 0, thread_slack: int = 0, metric: str = DEFAULT_METRIC,
            until: int | None = None, cpus: int | None = None) -> dict:
    """Per tree (and per kind within it): growth after warm-up, and the verdict.

    ``samples`` are the per-round samples: {"round": r, "trees": {name: tree_sample or None}}.
    A tree passes if the slope of its ``metric`` memory is under ``budget_pct`` % of its
    post-warm-up start per round and its fds and threads are flat: their floor (the minimum over
    the last window, a tenth of the rounds and at least 3) does not exceed the floor of the first
    post-warm-up window by more than the slack. The floor, not the maximum: a leaked fd or thread
    stays and lifts every later sample, while a sample taken as a request or a p2p stream is open
    shows a transient socket or handler thread that the next sample does not; the maxima's rise
    is reported beside it. Threads: the Python processes' are judged so; p2pd's maximum must stay
    under go_thread_bound for ``cpus`` (default: this machine's) and p2pd's largest fd count.
    Samples from round ``until`` on are left out (the sandbox's validator is shutting down once
    its last round is saved)."""
    cpus = cpus or os.cpu_count() or 1
    after = [s for s in samples if s["round"] > warmup and (until is None or s["round"] < until)]
    names = sorted({name for s in samples for name in s["trees"]})
    trees: dict[str, dict] = {}
    ok = bool(after)
    for name in names:
        rows = [(s["round"], s["trees"][name]) for s in after if s["trees"].get(name)]
        rounds = [r for r, _ in rows]
        entry: dict = {"rounds": len(rows)}
        present = [m for m in METRICS if rows and all(m in t for _, t in rows)]
        for m in present:
            entry[m] = series_growth(rounds, [t[m] for r, t in rows], budget_pct=budget_pct)
        kinds = sorted({k for _, t in rows for k in t["kinds"]})
        entry["kinds"] = {}
        for kind in kinds:
            kr = [(r, t["kinds"][kind]) for r, t in rows if kind in t["kinds"]]
            entry["kinds"][kind] = {m: series_growth([r for r, _ in kr], [k[m] for _, k in kr], budget_pct=budget_pct)
                                    for m in present}
            # what the descriptors point at, first and last sample after warm-up (a rise is traced to a type)
            entry["kinds"][kind]["fd_types"] = {"first": dict(kr[0][1].get("fd_types") or {}),
                                                "last": dict(kr[-1][1].get("fd_types") or {})}
            # A kind's slope in % of the whole tree's starting footprint (Pss), what the budget is of.
            for m in MEMORY_METRICS:
                if m in present:
                    start = (entry["pss"] if "pss" in entry else entry[m]).get("start") or 0
                    g = entry["kinds"][kind][m]
                    g["pct_of_tree_per_round"] = 100.0 * g["slope_per_round"] / start if start else 0.0
        # The judged slope is the metric's; the base is the tree's real footprint at the start
        # (its Pss), so a leak of N bytes a round counts the same whatever the metric.
        if metric in entry:
            base = entry["pss"]["start"] if "pss" in entry else entry[metric]["start"]
            pct = 100.0 * entry[metric]["slope_per_round"] / base if base else 0.0
            entry["budget"] = {"metric": metric, "slope_per_round": entry[metric]["slope_per_round"],
                               "base": base, "pct_per_round": pct, "ratio": pct / budget_pct}
        if rows:
            entry["python_threads"] = series_growth(rounds, [_python_threads(t) for _, t in rows])
        go = entry["kinds"].get("p2pd")
        if go:
            entry["go_threads"] = {"min": go["threads"]["min"], "max": go["threads"]["max"],
                                   "rise": go["threads"]["max"] - go["threads"]["start"],
                                   "bound": go_thread_bound(cpus, int(go["fds"]["max"])), "cpus": cpus}
        mem_ok = bool(rows) and metric in entry and entry["budget"]["ratio"] < 1.0
        fds_ok = bool(rows) and entry["fds"]["floor_rise"] <= fd_slack
        thr_ok = (bool(rows) and entry["python_threads"]["floor_rise"] <= thread_slack
                  and (go is None or entry["go_threads"]["max"] <= entry["go_threads"]["bound"]))
        entry["verdict"] = {"memory": mem_ok, "fds": fds_ok, "threads": thr_ok, "ok": mem_ok and fds_ok and thr_ok}
        ok = ok and entry["verdict"]["ok"]
        trees[name] = entry
    worst = max((t["budget"]["ratio"] for t in trees.values() if "budget" in t), default=None)
    return {"warmup": warmup, "metric": metric, "budget_pct_per_round": budget_pct, "fd_slack": fd_slack,
            "thread_slack": thread_slack, "rounds_after_warmup": len(after), "trees": trees,
            "worst_ratio": worst, "ok": ok}


# ---------------------------------------------------------------------------- the run

def _fmt_bytes(n: float) -> str:
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{sign}{n:.1f} {unit}" if unit != "B" else f"{sign}{n:.0f} B"
        n /= 1024
    return f"{sign}{n:.1f} GB"


def _fd_types_change(types: dict | None) -> str:
    """'  fd types socket 12->14 pipe 6->6 ...' (empty for documents written before types were kept)."""
    if not types or not (types["first"] or types["last"]):
        return ""
    names = sorted(set(types["first"]) | set(types["last"]))
    return "  fd types " + " ".join(f"{n} {types['first'].get(n, 0)}->{types['last'].get(n, 0)}" for n in names)


def _validator_round(root: Path) -> int | None:
    from dtrain.sandbox import layout

    best = None
    for path in layout.validator_state_files(root):
        try:
            counter = int(json.loads(path.read_text()).get("round_counter", 0))
        except (OSError, ValueError, TypeError, AttributeError):
            continue
        best = counter if best is None else min(best, counter)
    return best


def sample_all(children) -> dict[str, dict | None]:
    table = all_processes()
    return {c.member.name: (tree_sample(c.process.pid, table) if c.process.poll() is None else None)
            for c in children}


def run_soak(args, log) -> tuple[list[dict], dict, float]:
    from dtrain.sandbox.orchestrator import Sandbox, SandboxError, SandboxOptions

    options = SandboxOptions(miners=args.miners, rounds=args.rounds,
                             directory=Path(args.dir) if args.dir else None)
    sandbox = Sandbox(options, on_event=lambda message: log(f"sandbox: {message}"))
    samples: list[dict] = []
    info: dict = {"dir": str(sandbox.root)}
    started = time.monotonic()

    def on_term(signum, frame):  # SIGTERM stops the neurons like Ctrl-C does
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        sandbox.setup()
        sandbox.start()
        log(f"sandbox: validator started for {args.rounds} rounds; sampling each round")
        seen = 0
        last_progress = time.monotonic()
        samples.append({"round": 0, "t": round(time.monotonic() - started, 2), "trees": sample_all(sandbox.children)})
        while True:
            counter = _validator_round(sandbox.root) or 0
            done = sandbox.validators_done()
            if counter > seen:
                seen = counter
                last_progress = time.monotonic()
                samples.append({"round": counter, "t": round(time.monotonic() - started, 2),
                                "trees": sample_all(sandbox.children)})
                if counter == 1 or counter % 10 == 0:
                    tot = sum((t or {}).get("pss", 0) for t in samples[-1]["trees"].values())
                    log(f"round {counter}/{args.rounds}: total Pss {_fmt_bytes(tot)}")
            if done is not None:
                info["validator_exit"] = done
                break
            dead = [c.member.name for c in sandbox.children if c.member.role == "miner" and c.process.poll() is not None]
            if dead:
                raise SandboxError(f"miner(s) exited during the soak: {', '.join(dead)}")
            if time.monotonic() - last_progress > args.stall_s:
                raise SandboxError(f"no validator round in {args.stall_s:g} s (stuck at round {seen})")
            time.sleep(0.25)
    except KeyboardInterrupt:
        info["interrupted"] = True
        log("interrupted: stopping every neuron")
    except SandboxError as e:
        info["error"] = str(e)
        log(f"sandbox error: {e}")
    finally:
        try:
            sandbox.stop_all()
            info["exit_codes"] = getattr(sandbox, "exit_codes", {})
            info["stop_notes"] = getattr(sandbox, "stop_notes", {})
        finally:
            if not args.dir:
                sandbox.cleanup()
            signal.signal(signal.SIGTERM, previous)
    return samples, info, time.monotonic() - started


def render(result: dict) -> str:
    from dtrain.ui.sparkline import sparkline

    a = result["analysis"]
    m = a["metric"]
    label = {"pss": "Pss", "rss": "VmRSS", "anon": "RssAnon+RssShmem", "uss": "USS"}[m]
    out = [f"command: {result['command']}",
           (f"{result['rounds_sampled']} rounds sampled in {result['wall_s']:.0f} s; warm-up {a['warmup']} rounds; "
            f"memory judged = slope of the sum of {label} over each neuron's process tree, in % of the tree's "
            f"Pss at the first post-warm-up round (the other sums' slopes beside it)"),
           ""]
    others = [x for x in MEMORY_METRICS if x != m]
    head = (f"{'tree':<10} {'Pss start':>10} {label + ' slope/round':>{max(12, len(label) + 12)}} {'%/round':>9} "
            f"{'ratio':>6} " + " ".join(f"{x + ' slope':>11}" for x in others)
            + f" {'fds':>9} {'Δfd':>7} {'threads':>9} {'Δthr':>7} {'procs':>5}  verdict")
    out.append(head)
    out.append("-" * len(head))
    for name, t in a["trees"].items():
        if "budget" not in t:
            out.append(f"{name:<10} (no samples after warm-up)")
            continue
        b, f, th, py = t["budget"], t["fds"], t["threads"], t["python_threads"]
        v = t["verdict"]
        verdict = "ok" if v["ok"] else "FAIL(" + ",".join(k for k in ("memory", "fds", "threads") if not v[k]) + ")"
        out.append(f"{name:<10} {_fmt_bytes(b['base']):>10} {_fmt_bytes(b['slope_per_round']):>{max(12, len(label) + 12)}} "
                   f"{b['pct_per_round']:>8.4f}% {b['ratio']:>6.2f} "
                   + " ".join(f"{_fmt_bytes(t[x]['slope_per_round']) if x in t else '-':>11}" for x in others)
                   + f" {f['min']:>4.0f}-{f['max']:<4.0f} {f['floor_rise']:>3.0f}/{f['window_rise']:<3.0f} "
                   f"{th['min']:>4.0f}-{th['max']:<4.0f} {py['floor_rise']:>3.0f}/{py['window_rise']:<3.0f} "
                   f"{t['procs']['max']:>5.0f}  {verdict}")
    out.append("")
    out.append(f"per kind ({label} start -> end, slope/round and % of the tree's starting Pss; Pss slope; "
               "fds and threads min-max):")
    for name, t in a["trees"].items():
        for kind, k in t.get("kinds", {}).items():
            p = k.get(m, {})
            if not p.get("n"):
                continue
            out.append(f"  {name:<10} {kind:<9} {_fmt_bytes(p['start']):>9} -> {_fmt_bytes(p['end']):>9}  "
                       f"{_fmt_bytes(p['slope_per_round']):>10}/round {p['pct_of_tree_per_round']:>8.4f}%  "
                       f"Pss {_fmt_bytes(k['pss']['slope_per_round']):>10}/round  "
                       f"fds {k['fds']['min']:.0f}-{k['fds']['max']:.0f}  threads {k['threads']['min']:.0f}-"
                       f"{k['threads']['max']:.0f}{_fd_types_change(k.get('fd_types'))}")
    out.append("")
    out.append(f"{label} per round, whole run (warm-up included):")
    for name in a["trees"]:
        values = [s["trees"][name][m] for s in result["samples"] if s["trees"].get(name) and m in s["trees"][name]]
        if values:
            out.append(f"  {name:<10} {sparkline(values, 60)}  {_fmt_bytes(min(values))} .. {_fmt_bytes(max(values))}")
    out.append("")
    worst = a["worst_ratio"]
    out.append(f"baseline: budget {a['budget_pct_per_round']} % of the tree's starting Pss per round for the {label} slope; "
               f"worst ratio measured/budget = {worst:.2f}" if worst is not None else "no samples after warm-up")
    out.append(f"fds and threads (Δ = rise of the minimum / of the maximum from the first post-warm-up window "
               f"to the last; Δthr counts the Python processes): the minimum's rise must be <= "
               f"{a['fd_slack']} / {a['thread_slack']}")
    for name, t in a["trees"].items():
        go = t.get("go_threads")
        if go:
            out.append(f"  {name:<10} p2pd (Go) threads {go['min']:.0f}-{go['max']:.0f} (rose {go['rise']:.0f}), "
                       f"bound {go['bound']} = {go['cpus']} CPUs + its {go['bound'] - go['cpus'] - GO_RUNTIME_THREADS} "
                       f"fds + {GO_RUNTIME_THREADS}: Go keeps every thread it made (golang/go#14592)")
    if result.get("error"):
        out.append(f"sandbox error: {result['error']}")
    out.append("PASS" if result["ok"] else "FAIL")
    return "\n".join(out)


def report_from_file(path: str, *, warmup: int | None, metric: str, fd_slack: int, thread_slack: int) -> dict:
    """Re-analyse a document written by --samples-out (another warm-up or metric; no new run)."""
    result = json.loads(Path(path).read_text())
    w = result["warmup"] if warmup is None else warmup
    result["analysis"] = analyse(result["samples"], w, metric=metric, fd_slack=fd_slack, thread_slack=thread_slack,
                                 cpus=result.get("cpus"),
                                 until=result.get("rounds"))
    result["warmup"] = w
    complete = not result.get("error") and not result.get("interrupted") and result.get("validator_exit") == 0
    result["ok"] = bool(result["analysis"]["ok"] and complete)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--miners", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=None, help="rounds left out of the fit (default 20)")
    parser.add_argument("--dir", default=None, help="keep the sandbox here (an empty directory)")
    parser.add_argument("--json", action="store_true", help="one JSON document on stdout")
    parser.add_argument("--samples-out", default=None, help="also write the full JSON document to this file")
    parser.add_argument("--fd-slack", type=int, default=0)
    parser.add_argument("--thread-slack", type=int, default=0)
    parser.add_argument("--metric", choices=MEMORY_METRICS, default=DEFAULT_METRIC,
                        help=f"memory sum judged against the budget (default {DEFAULT_METRIC})")
    parser.add_argument("--from-json", default=None, metavar="FILE",
                        help="no run: re-analyse a --samples-out document (e.g. with another --warmup)")
    parser.add_argument("--stall-s", type=float, default=600.0, help="give up after this long without a round")
    args = parser.parse_args(argv)
    if args.from_json:
        result = report_from_file(args.from_json, warmup=args.warmup, metric=args.metric, fd_slack=args.fd_slack,
                                  thread_slack=args.thread_slack)
        print(json.dumps(result) if args.json else render(result))
        return 0 if result["ok"] else 1
    if args.warmup is None:
        args.warmup = 20
    if args.rounds <= args.warmup + 2:
        parser.error("--rounds must exceed --warmup by at least 3 for a slope")
    command = " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]) if argv is None else \
        " ".join(shlex.quote(a) for a in [sys.executable, "benchmarks/soak.py", *argv])

    def log(message: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)

    samples, info, wall = run_soak(args, log)
    cpus = len(os.sched_getaffinity(0))  # what Go's GOMAXPROCS defaults to for p2pd, started from here
    analysis = analyse(samples, args.warmup, fd_slack=args.fd_slack, thread_slack=args.thread_slack, cpus=cpus,
                       metric=args.metric, until=args.rounds)
    complete = not info.get("error") and not info.get("interrupted") and info.get("validator_exit") == 0
    result = {"command": command, "miners": args.miners, "rounds": args.rounds, "warmup": args.warmup,
              "rounds_sampled": max((s["round"] for s in samples), default=0), "wall_s": round(wall, 1),
              "memory_metric": args.metric, "cpus": cpus, **info, "analysis": analysis,
              "ok": bool(analysis["ok"] and complete), "samples": samples}
    if args.samples_out:
        Path(args.samples_out).write_text(json.dumps(result))
    if args.json:
        print(json.dumps(result))
    else:
        print(render(result))
    if not complete:
        return 2
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
