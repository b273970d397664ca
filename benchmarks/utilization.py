"""Utilisation: how much of each miner's wall time goes to training, against the previous
release's per-round cap, in the real sandbox.

    python benchmarks/utilization.py [--miners 3] [--rounds 3] [--round-interval 60]
                                     [--modes gradient,diloco] [--alone-s 20] [--json]

Each mode runs two arms of the real sandbox (``dtrain.sandbox.orchestrator.Sandbox``: embedded
chain, real wallets, real hivemind peers on loopback, one validator), every neuron at the
sandbox's tiny model and otherwise the shipped settings (``SHIPPED``: pages, batches, DiLoCo's
H, the validator's checks and ``validator.round_interval_s``, 60 s unless ``--round-interval``
says otherwise):

- ``release``: the shipped ``allreduce.target_batch_size`` (gradient mode trains continuously
  until its round, up to it);
- ``previous``: ``target_batch_size = training.local_batch_size``, which is exactly the
  previous release's rule (stop at one local batch and wait for the round).

After the first round (the warm-up: start-up and the first matchmaking), each miner's
``train_busy_s`` and ``tokens`` are read from its status.json when the validator has persisted
each further round. Per miner: ``busy_fraction`` = seconds in training steps of its own pages
÷ wall seconds, and its tokens per second. ``scaling`` is the swarm's tokens per second ÷ the
sum of what each miner trains alone (one thread, measured in this process first, the sandbox's
``OMP_NUM_THREADS=1``). The ratio printed is the release's median busy fraction over the
previous release's.

What this does not yet measure: the links are loopback (not the netns lab's rate-limited
ones), and a round runs on each miner's training thread, so nothing of the all-reduce is
hidden; ``allreduce_share`` is the validator's all-reduce seconds ÷ the window's wall seconds.
On a machine with fewer cores than miners, ``scaling`` is bounded by cores ÷ miners: say so
with the figure (the summary prints the core count).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def busy_window(first: dict, last: dict) -> dict:
    """A miner's figures between two reads of its status (``t`` seconds, ``train_busy_s``,
    ``tokens``): busy fraction and tokens per second over the wall time between them."""
    wall = last["t"] - first["t"]
    if wall <= 0:
        raise ValueError("the second read must come after the first")
    busy = (last["train_busy_s"] - first["train_busy_s"]) / wall
    return {"wall_s": round(wall, 2), "busy_fraction": round(min(1.0, max(0.0, busy)), 4),
            "tokens_per_s": round((last["tokens"] - first["tokens"]) / wall, 1)}


def scaling(swarm_tokens_per_s: float, alone_tokens_per_s: float, miners: int) -> float:
    """The swarm's tokens per second over what its miners train alone, summed."""
    return swarm_tokens_per_s / max(alone_tokens_per_s * miners, 1e-9)


# What a miner trains per round and what a validator checks: the shipped values, not the sandbox's
# (the sandbox shrinks them so that its rounds take seconds). The model stays the sandbox's.
SHIPPED = ("data.page_sequences", "training.micro_batch_size", "training.local_batch_size",
           "allreduce.target_batch_size", "allreduce.diloco_inner_steps", "allreduce.diloco_inner_warmup",
           "allreduce.diloco_snapshot_every", "validator.pages_per_query", "validator.recompute_fraction",
           "validator.audit_pages", "validator.batch_audit_probability", "validator.round_interval_s")


def _configure(root: Path, members, *, round_interval: float, capped: bool) -> None:
    """Rewrite every neuron's config: the SHIPPED values, ``round_interval``, and for the previous
    release's arm (``capped``) a target global batch of one local batch (its rule)."""
    from dtrain.config.files import save_config
    from dtrain.config.loading import load_config
    from dtrain.sandbox import layout

    for member in members:
        path = layout.neuron_dir(root, member.name) / "config.toml"
        cfg, _ = load_config(path, env={})
        save_config(shipped_settings(cfg, round_interval=round_interval, capped=capped), path, overwrite=True)


def shipped_settings(cfg, *, round_interval: float, capped: bool = False):
    """``cfg`` (a sandbox neuron's) with the SHIPPED values, ``round_interval``, and the previous
    release's cap when ``capped``."""
    from dtrain.config import Config

    shipped = Config()
    for dotted in SHIPPED:
        section, key = dotted.split(".")
        setattr(getattr(cfg, section), key, getattr(getattr(shipped, section), key))
    cfg.validator.round_interval_s = round_interval
    if capped:
        cfg.allreduce.target_batch_size = cfg.training.local_batch_size
    return cfg


def _miner_reads(root: Path, miners: list[str]) -> dict[str, dict] | None:
    from dtrain.sandbox import layout

    files = layout.status_files(root)
    reads = {}
    for name in miners:
        try:
            doc = json.loads(files[name].read_text())
        except (KeyError, OSError, ValueError):
            return None
        reads[name] = {"t": time.time(), "train_busy_s": float(doc.get("train_busy_s", 0.0)),
                       "tokens": int(doc.get("tokens", 0))}
    return reads


def _validator_state(root: Path) -> dict:
    from dtrain.sandbox import layout

    for path in layout.validator_state_files(root):
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            pass
    return {}


def run_arm(args, mode: str, capped: bool, log) -> dict:
    """One sandbox run: per-miner busy fraction and tokens/s over rounds 2..N."""
    from dtrain.sandbox.orchestrator import Sandbox, SandboxOptions

    rounds = args.rounds
    options = SandboxOptions(miners=args.miners, rounds=rounds, mode=mode, batch_audit=0.25,
                             round_timeout_s=3 * args.round_interval + 240)
    sandbox = Sandbox(options, on_event=lambda m: log(f"  sandbox: {m}"))
    try:
        members = sandbox.setup()
        _configure(sandbox.root, members, round_interval=args.round_interval, capped=capped)
        miners = [m.name for m in members if m.role == "miner"]
        sandbox.start()
        marks: dict[int, dict] = {}
        deadline = time.monotonic() + options.round_timeout * (rounds + 1)
        while sandbox.validators_done() is None and time.monotonic() < deadline:
            counter = int(_validator_state(sandbox.root).get("round_counter", 0) or 0)
            if counter >= 1 and counter not in marks:
                reads = _miner_reads(sandbox.root, miners)
                if reads is not None:
                    marks[counter] = reads
            time.sleep(0.2)
        state = _validator_state(sandbox.root)
    finally:
        sandbox.stop_all()
        sandbox.cleanup()
    if len(marks) < 2:
        raise RuntimeError(f"{mode}: fewer than two rounds were read ({sorted(marks)})")
    first, last = marks[min(marks)], marks[max(marks)]
    per_miner = {name: busy_window(first[name], last[name]) for name in first}
    recent = [r for r in state.get("recent_rounds", []) if min(marks) < int(r.get("round", 0)) <= max(marks)]
    wall = statistics.median(m["wall_s"] for m in per_miner.values())
    allreduce = sum(float(r.get("allreduce_s") or 0.0) for r in recent)
    return {"miners": per_miner, "rounds_measured": max(marks) - min(marks), "wall_s": wall,
            "allreduce_share": round(allreduce / wall, 4) if wall else None,
            "swarm_tokens_per_s": round(sum(m["tokens_per_s"] for m in per_miner.values()), 1)}


def alone_tokens_per_s(mode: str, seconds: float) -> float:
    """What one sandbox miner trains alone, one thread: its own pages, as ``Miner`` trains them."""
    import torch

    from dtrain.neurons.runtime import build_workbench
    from dtrain.sandbox.layout import Member
    from dtrain.sandbox.settings import neuron_config
    from dtrain.training.data import assign_pages

    torch.set_num_threads(1)
    cfg = shipped_settings(neuron_config(Path("/tmp/dtrain-utilization"), Member("m", "miner", "honest", 1, ""), 3,
                                         mode=mode), round_interval=60.0)
    bench = build_workbench(cfg)
    bench.reader.open()
    bench.mode.start_epoch(0)
    tokens, counter, t0 = 0, 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        if not bench.mode.wants_data:
            bench.mode.start_epoch(0)  # DiLoCo's H steps done: begin again, as after a round
        page = assign_pages(run_id=bench.run_id, uid=1, epoch=0, page_counter=counter, count=1,
                            num_pages=bench.reader.num_pages)
        trained = bench.mode.train_page(bench.reader.read_pages(page), page=page[0], counter=counter, epoch=0)
        tokens += trained.samples * cfg.model.seq_len
        counter += 1
    return tokens / (time.perf_counter() - t0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--miners", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3, help="validator rounds; the first is the warm-up")
    ap.add_argument("--round-interval", type=float, default=60.0, help="validator.round_interval_s (shipped: 60)")
    ap.add_argument("--modes", default="gradient,diloco")
    ap.add_argument("--alone-s", type=float, default=20.0, help="seconds of training alone per mode")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.rounds < 3:
        ap.error("--rounds must be at least 3 (one warm-up, then at least two measured)")

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    result = {"command": "python benchmarks/utilization.py " + " ".join(argv or sys.argv[1:]),
              "cores": os.cpu_count(), "modes": {}}
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        log(f"{mode}: training alone for {args.alone_s:g} s")
        alone = alone_tokens_per_s(mode, args.alone_s)
        arms = {}
        for arm, capped in (("release", False), ("previous", True)):
            log(f"{mode}, {arm}: {args.miners} miners, {args.rounds} rounds of {args.round_interval:g} s")
            arms[arm] = run_arm(args, mode, capped, log)
            arms[arm]["scaling"] = round(scaling(arms[arm]["swarm_tokens_per_s"], alone, args.miners), 4)
            arms[arm]["busy_fraction_median"] = statistics.median(
                m["busy_fraction"] for m in arms[arm]["miners"].values())
        ratio = arms["release"]["busy_fraction_median"] / max(arms["previous"]["busy_fraction_median"], 1e-9)
        result["modes"][mode] = {"alone_tokens_per_s": round(alone, 1), **arms, "busy_ratio": round(ratio, 2)}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(render(result))
    return 0


def render(result: dict) -> str:
    out = [f"command: {result['command']}  ({result['cores']} cores)"]
    for mode, r in result["modes"].items():
        out.append(f"{mode}: alone {r['alone_tokens_per_s']:.0f} tokens/s per miner")
        for arm in ("release", "previous"):
            a = r[arm]
            busy = ", ".join(f"{n} {m['busy_fraction']:.3f}" for n, m in sorted(a["miners"].items()))
            out.append(f"  {arm:<8} busy {busy}; scaling {a['scaling']:.3f}; all-reduce {a['allreduce_share']:.3f} "
                       f"of wall over {a['rounds_measured']} rounds")
        out.append(f"  busy fraction, release / previous: {r['busy_ratio']:.2f}x")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
