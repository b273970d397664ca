#!/usr/bin/env python3
"""Honest replica drift: how far two replicas that apply the *same* averaged gradients
drift apart when their optimizer implementations differ (plain vs fused AdamW).

In a dtrain round every peer receives the same averaged bits and takes the same step; the
only thing that separates honest replicas is floating-point arithmetic (fused vs plain
AdamW, CPU vs CUDA). This measures that drift per step on the sandbox model, against the
baseline of two identical plain-AdamW replicas (which must stay bit-identical: drift 0),
and prints the ratio of the replica tolerance (``dtrain.training.replica.REPLICA_RTOL``) to the
drift after the longest run, i.e. how many steps of honest drift the tolerance absorbs
before a resync.

    python benchmarks/replica_drift.py --steps 200 --json
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    import copy

    import torch

    from dtrain.training.data import DataSource, PageReader, PageSpec, assign_pages
    from dtrain.training.models import create_model
    from dtrain.training.replica import REPLICA_RTOL, params_distance
    from dtrain.training.tokenizer import load_fallback_tokenizer
    from dtrain.training.trainer import Trainer, TrainerConfig

    tok = load_fallback_tokenizer()
    reader = PageReader(DataSource.shipped(), tok, PageSpec(seq_len=args.seq_len, page_sequences=args.batch))
    pages = assign_pages(run_id="drift", uid=0, epoch=0, page_counter=0, num_pages=reader.num_pages,
                         count=args.steps, max_uids=1)
    torch.manual_seed(0)
    base = create_model(args.preset, vocab_size=len(tok), n_positions=args.seq_len, seed=0)

    def trainer(fused: bool) -> Trainer:
        return Trainer(copy.deepcopy(base), TrainerConfig(micro_batch_size=args.batch, local_batch_size=args.batch,
                                                          fused=fused, warmup_steps=10, total_steps=args.steps))

    ref, same, fused = trainer(False), trainer(False), trainer(True)
    marks = sorted({1, 5, 10, 20, 50, 100, 200, 500, 1000, args.steps} & set(range(1, args.steps + 1)))
    rows = []
    step_sizes = []
    for step, page in enumerate(pages, 1):
        ref.accumulate(reader.read_page(page))
        grads = [g.clone() for g in ref.gradients()]
        before = [p.detach().clone() for p in ref.params]
        ref.step()
        step_sizes.append(params_distance(ref.params, before))
        for t in (same, fused):
            t.set_gradients(grads, num_samples=args.batch)
            t.step()
        if step in marks:
            rows.append({"step": step, "fused_vs_plain": params_distance(fused.params, ref.params),
                         "plain_vs_plain": params_distance(same.params, ref.params)})
    last = rows[-1]["fused_vs_plain"]
    out = {"preset": args.preset, "steps": args.steps, "rows": rows, "tolerance": REPLICA_RTOL,
           "drift_per_step": last / args.steps,
           # one optimizer step, as a distance: what a replica that skipped or altered a step is off by
           "smallest_step": min(step_sizes), "median_step": sorted(step_sizes)[len(step_sizes) // 2],
           "ratio": REPLICA_RTOL / last if last > 0 else float("inf")}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for r in rows:
            print(f"step {r['step']:>5}: fused vs plain {r['fused_vs_plain']:.3e}   plain vs plain {r['plain_vs_plain']:.1e}")
        print(f"one optimizer step moves the parameters by {out['smallest_step']:.2e} (smallest) to "
              f"{out['median_step']:.2e} (median) of their norm")
        print(f"tolerance {REPLICA_RTOL:.1e} = {out['ratio']:.1f} x the drift after {args.steps} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
