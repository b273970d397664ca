"""Does training through the swarm match training alone? (and what DiLoCo costs/saves)

Same model init, same data, same global batch, same number of optimizer steps:

1. ``distributed``: 4 swarm peers (real DHTs, real butterfly all-reduce on loopback); each
   takes a quarter of every global batch, averages its per-sample-mean gradient with weight
   = its samples, then every peer takes the same AdamW step.
2. ``reference``: one process takes the whole global batch per step.
3. ``diloco``: the same 4 peers, each running H local AdamW steps on its quarter, then one
   averaged pseudo-gradient and an outer Nesterov step (lr 0.7, momentum 0.9).

Prints final held-out losses, the relative gap of (1) vs (2) (target |gap| <= 2%), and
bytes exchanged per token trained for per-step averaging vs DiLoCo.

    python benchmarks/convergence.py --json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch


def _data(seq_len: int, page_sequences: int):
    from dtrain.training.data import DataSource, PageReader, PageSpec
    from dtrain.training.tokenizer import load_fallback_tokenizer

    tok = load_fallback_tokenizer()
    reader = PageReader(DataSource.shipped(), tok, PageSpec(seq_len=seq_len, page_sequences=page_sequences))
    return tok, reader


def _trainer(vocab: int, eos: int, seq_len: int, steps: int, lr: float, micro: int):
    from dtrain.training.models import create_model
    from dtrain.training.trainer import Trainer, TrainerConfig

    model = create_model("tiny", vocab_size=vocab, n_positions=seq_len, eos_token_id=eos, seed=0)
    cfg = TrainerConfig(
        micro_batch_size=micro, local_batch_size=micro, optimizer="adamw", lr=lr, warmup_steps=2,
        total_steps=steps, grad_clip=1.0, precision="fp32",
    )
    return Trainer(model, cfg)


@torch.no_grad()
def _eval_loss(trainer, batch: torch.Tensor) -> float:
    from dtrain.training.trainer import microbatch_loss

    trainer.model.eval()
    loss = float(microbatch_loss(trainer.model, batch, "fp32"))
    trainer.model.train()
    return loss


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--page-sequences", type=int, default=8, help="sequences per page = per peer per step")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--diloco-h", type=int, default=5, help="DiLoCo inner steps per outer step")
    ap.add_argument("--skip-diloco", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))

    from dtrain.swarm.averaging import AveragingConfig, GradientSwarm
    from dtrain.swarm.diloco import DiLoCo, DiLoCoConfig, bytes_per_token
    from dtrain.swarm.testing import local_nodes, run_concurrently

    tok, reader = _data(args.seq_len, args.page_sequences)
    vocab, eos = len(tok), int(tok.eos_token_id)
    n, steps = args.peers, args.steps
    need_pages = n * steps + 4
    if reader.num_pages < need_pages:
        raise SystemExit(f"corpus has {reader.num_pages} pages, need {need_pages}; lower --steps or --seq-len")
    pages = {p: reader.read_page(p) for p in range(need_pages)}
    eval_batch = torch.cat([pages[n * steps + k] for k in range(4)])  # held out: never trained on

    def peer_batch(step: int, i: int) -> torch.Tensor:
        return pages[n * step + i]

    t0 = time.monotonic()
    # ---- (2) reference: one process, whole global batch ----
    ref = _trainer(vocab, eos, args.seq_len, steps, args.lr, args.page_sequences)
    ref_train_losses = []
    for s in range(steps):
        ref_train_losses.append(ref.train_step(torch.cat([peer_batch(s, i) for i in range(n)])).loss)
    reference_loss = _eval_loss(ref, eval_batch)
    t_ref = time.monotonic() - t0

    result: dict = dict(
        peers=n, steps=steps, global_batch_sequences=n * args.page_sequences, seq_len=args.seq_len,
        model="tiny preset (dtrain.training), shipped BPE tokenizer, shipped corpus", reference_loss=reference_loss,
        reference_seconds=t_ref,
    )
    with local_nodes(n) as nodes:
        # ---- (1) distributed per-step gradient averaging ----
        t1 = time.monotonic()
        trainers = [_trainer(vocab, eos, args.seq_len, steps, args.lr, args.page_sequences) for _ in range(n)]
        cfg = AveragingConfig(
            prefix="conv", min_group_size=n, target_group_size=n, min_matchmaking_time_s=1.0,
            request_timeout_s=0.5, matchmaking_timeout_s=60, allreduce_timeout_s=60, allow_state_sharing=False,
        )
        swarms = [GradientSwarm(nd.dht, tr.gradients(), "conv-tiny", cfg) for nd, tr in zip(nodes, trainers)]
        records: list[list] = [[] for _ in range(n)]
        failures = []

        def dist_peer(i: int):
            tr = trainers[i]
            for s in range(steps):
                tr.accumulate(peer_batch(s, i))
                samples = tr.accumulated_samples
                tokens = tr.accumulated_tokens
                # per-sample mean with weight = samples -> the swarm returns the global per-sample mean
                grads = [g / samples for g in tr.gradients()]
                rec = swarms[i].run_round(grads, weight=samples, cap=args.page_sequences, tokens=tokens)
                if rec.error or rec.fraction_averaged < 1.0 or any(p.outcome.value != "SUCCESS" for p in rec.peers):
                    failures.append((i, s, rec.error, rec.fraction_averaged))
                records[i].append(rec)
                tr.set_gradients(grads, num_samples=1)
                tr.step()

        try:
            run_concurrently([lambda i=i: dist_peer(i) for i in range(n)], timeout_s=1200)
        finally:
            for sw in swarms:
                sw.shutdown()
        identical = all(
            torch.equal(a, b)
            for tr in trainers[1:]
            for a, b in zip(trainers[0].model.parameters(), tr.model.parameters())
        )
        distributed_loss = _eval_loss(trainers[0], eval_batch)
        gap = (distributed_loss - reference_loss) / reference_loss
        per_step_bpt = bytes_per_token(records[0])
        result.update(
            distributed_loss=distributed_loss,
            gap=gap,
            gap_ok=abs(gap) <= 0.02,
            replicas_identical=identical,
            failed_rounds=len(failures),
            distributed_seconds=time.monotonic() - t1,
            per_step_bytes_per_token=per_step_bpt,
            per_step_rounds=len(records[0]),
            mean_allreduce_s=sum(r.allreduce_s for r in records[0]) / max(len(records[0]), 1),
        )

        # ---- (3) DiLoCo: H local steps on each quarter, then the outer step ----
        if not args.skip_diloco:
            t2 = time.monotonic()
            inner = [_trainer(vocab, eos, args.seq_len, steps, args.lr, args.page_sequences) for _ in range(n)]
            dcfg = AveragingConfig(
                prefix="conv_diloco", min_group_size=n, target_group_size=n, min_matchmaking_time_s=1.0,
                request_timeout_s=0.5, matchmaking_timeout_s=60, allreduce_timeout_s=60, allow_state_sharing=False,
            )
            dswarms = [
                GradientSwarm(nd.dht, [torch.zeros_like(p) for p in tr.params], "conv-tiny", dcfg, mode="diloco")
                for nd, tr in zip(nodes, inner)
            ]
            outers = [
                DiLoCo(tr.params, sw, DiLoCoConfig(inner_steps=args.diloco_h)) for tr, sw in zip(inner, dswarms)
            ]
            drecords: list[list] = [[] for _ in range(n)]

            def diloco_peer(i: int):
                tr = inner[i]
                for s in range(steps):
                    tr.accumulate(peer_batch(s, i))
                    samples, tokens = tr.accumulated_samples, tr.accumulated_tokens
                    tr.step()
                    rec = outers[i].inner_step_done(samples=samples, tokens=tokens, cap=args.page_sequences * 10**6)
                    if rec is not None:
                        drecords[i].append(rec)
                if outers[i].inner_steps_since_sync:
                    drecords[i].append(outers[i].sync(cap=args.page_sequences * 10**6))

            try:
                run_concurrently([lambda i=i: diloco_peer(i) for i in range(n)], timeout_s=1200)
            finally:
                for sw in dswarms:
                    sw.shutdown()
            diloco_loss = _eval_loss(inner[0], eval_batch)
            result.update(
                diloco_h=args.diloco_h,
                diloco_loss=diloco_loss,
                diloco_gap=(diloco_loss - reference_loss) / reference_loss,
                diloco_outer_steps=len(drecords[0]),
                diloco_failed_rounds=sum(
                    1 for recs in drecords for r in recs
                    if r.error or r.fraction_averaged < 1.0 or any(p.outcome.value != "SUCCESS" for p in r.peers)
                ),
                diloco_round_errors=sorted({r.error for recs in drecords for r in recs if r.error})[:3],
                diloco_bytes_per_token=bytes_per_token(drecords[0]),
                diloco_replicas_identical=all(
                    torch.equal(a, b) for tr in inner[1:] for a, b in zip(inner[0].params, tr.params)
                ),
                diloco_seconds=time.monotonic() - t2,
            )
            if per_step_bpt and not math.isnan(result["diloco_bytes_per_token"]):
                result["bytes_per_token_ratio"] = per_step_bpt / result["diloco_bytes_per_token"]

    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
    else:
        for k, v in sorted(result.items()):
            print(f"{k:32s} {v}")
    return 0 if result["gap_ok"] and result["replicas_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
