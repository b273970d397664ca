#!/usr/bin/env python3
"""Robust aggregation: how much of the training progress survives one sign-flipping miner.

Four simulated miners train the sandbox model together, round after round: each computes
its real mean gradient on its own assigned pages, the contributions are aggregated part by
part exactly as dtrain's reducers do (hivemind's part layout, ``dtrain.swarm.averaging.centered_clip``), and
every replica takes the same AdamW step. One miner sends ``-s x`` its gradient, with ``s``
up to 9.9: inside the out-of-scale rule, which refuses only norms above 10x the median.
Such a contribution is caught by the work commitments when it is sent naively; this
measures what is left when it is not caught at all.

Set-ups, each from the same initial weights over the same pages:

- ``honest/mean``: four honest miners, plain weighted mean (the baseline);
- ``honest/centered_clip``: four honest miners, CenteredClip (what clipping costs honest training);
- ``attacked-s/mean``: one attacker, plain mean (what the attack does unbounded);
- ``attacked-s/centered_clip``: one attacker, CenteredClip (dtrain's rule);
- ``attacker-removed/mean``: the three honest miners alone, the bound for any rule (the
  attacker's pages are lost whatever the rule does with its contribution).

Prints the drop of the held-out loss over the rounds for each, and ``ratio`` = drop of the
worst attacked CenteredClip run / drop of ``honest/mean`` (target >= 0.9).

    python benchmarks/robust_aggregation.py --json
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--miners", type=int, default=4)
    ap.add_argument("--local-batch", type=int, default=16, help="sequences per miner per round")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--scales", type=float, nargs="+", default=[1.0, 3.0, 9.9])
    ap.add_argument("--part-size-bytes", type=int, default=2**17)
    ap.add_argument("--tau-scale", type=float, default=None,
                    help="override dtrain.swarm.averaging.centered_clip.TAU_SCALE")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    import torch

    from dtrain.swarm import wire
    from dtrain.swarm.averaging.centered_clip import TAU_SCALE, centered_clip, weighted_mean
    from dtrain.swarm.averaging.contribution import PartLayout

    tau_scale = args.tau_scale if args.tau_scale is not None else TAU_SCALE
    from dtrain.training.data import DataSource, PageReader, PageSpec, assign_pages
    from dtrain.training.models import create_model
    from dtrain.training.tokenizer import load_fallback_tokenizer
    from dtrain.training.trainer import Trainer, TrainerConfig, microbatch_loss

    torch.set_num_threads(max(1, torch.get_num_threads()))
    tok = load_fallback_tokenizer()
    spec = PageSpec(seq_len=args.seq_len, page_sequences=args.local_batch)
    reader = PageReader(DataSource.shipped(), tok, spec)
    eval_pages = assign_pages(run_id="robust", uid=0, epoch=0, page_counter=0, count=2, num_pages=reader.num_pages,
                              nonce="eval", max_uids=1)
    eval_tokens = reader.read_pages(eval_pages)
    # each miner's page per round, fixed up front so every set-up sees the same data
    batches = [[reader.read_page(assign_pages(run_id="robust", uid=m, epoch=r, page_counter=0, count=1,
                                              num_pages=reader.num_pages, max_uids=args.miners)[0])
                for m in range(args.miners)] for r in range(args.rounds)]
    base = create_model("tiny", vocab_size=len(tok), n_positions=args.seq_len, seed=0)
    layout = None

    def eval_loss(model) -> float:
        with torch.no_grad():
            return float(microbatch_loss(model, eval_tokens, "fp32"))

    def run(rule: str, scale: float | None, *, without_last: bool = False) -> dict:
        nonlocal layout
        trainer = Trainer(copy.deepcopy(base), TrainerConfig(micro_batch_size=8, local_batch_size=args.local_batch,
                                                             lr=args.lr, warmup_steps=0, total_steps=1000))
        if layout is None:
            layout = PartLayout.of([p.detach() for p in trainer.params], wire.make_compression("none"),
                                   args.part_size_bytes)
        start = eval_loss(trainer.model)
        curve = [start]
        t0 = time.perf_counter()
        for r in range(args.rounds):
            contributions = []
            for m in range(args.miners - 1 if without_last else args.miners):
                trainer.zero_grad()
                trainer.accumulate(batches[r][m])
                mean = [g.detach().clone() / args.local_batch for g in trainer.gradients()]
                if scale is not None and m == args.miners - 1:
                    mean = [-scale * t for t in mean]
                contributions.append(mean)
            weights = [float(args.local_batch)] * len(contributions)
            averaged = [torch.empty_like(t) for t in contributions[0]]
            for i, begin, length in layout.parts:
                parts = [c[i].reshape(-1)[begin:begin + length] for c in contributions]
                agg = centered_clip(parts, weights, tau_scale=tau_scale) if rule == "centered_clip" else weighted_mean(parts, weights)
                averaged[i].reshape(-1)[begin:begin + length] = agg
            trainer.set_gradients(averaged, num_samples=1)
            trainer.step()
            curve.append(eval_loss(trainer.model))
        return {"rule": rule, "attacker_scale": scale, "loss_start": start, "loss_end": curve[-1],
                "drop": start - curve[-1], "seconds": round(time.perf_counter() - t0, 2),
                "curve": [round(x, 4) for x in curve]}

    runs = {"honest/mean": run("mean", None), "honest/centered_clip": run("centered_clip", None),
            # the best any rule can do against an attacker: its data is simply missing
            "attacker-removed/mean": run("mean", None, without_last=True)}
    for s in args.scales:
        runs[f"attacked-{s:g}/mean"] = run("mean", s)
        runs[f"attacked-{s:g}/centered_clip"] = run("centered_clip", s)
    baseline = runs["honest/mean"]["drop"]
    for r in runs.values():
        r["ratio_vs_honest_mean"] = r["drop"] / baseline if baseline > 0 else float("nan")
    worst = min((k for k in runs if k.endswith("/centered_clip") and k.startswith("attacked")),
                key=lambda k: runs[k]["drop"])
    out = {"rounds": args.rounds, "tau_scale": tau_scale, "miners": args.miners, "local_batch": args.local_batch, "runs": runs,
           "worst_attacked": worst, "ratio": runs[worst]["ratio_vs_honest_mean"],
           "honest_clip_ratio": runs["honest/centered_clip"]["ratio_vs_honest_mean"]}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for name, r in runs.items():
            print(f"{name:28s} loss {r['loss_start']:.3f} -> {r['loss_end']:.3f}  drop {r['drop']:+.3f}  "
                  f"x{r['ratio_vs_honest_mean']:.2f} of honest/mean")
        print(f"ratio (worst attacked centered_clip / honest mean) = {out['ratio']:.3f}  (target >= 0.9)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
