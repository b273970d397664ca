#!/usr/bin/env python3
"""Training throughput: dtrain's Trainer against a bare hand-written PyTorch loop.

Both train the same model (same preset, same init seed) on the same batches from
the shipped corpus, with the same micro-batching, AdamW, clipping and precision.
The two loops advance step by step in alternation (bare, dtrain, dtrain, bare,
...) and each step is timed, so a noisy shared machine penalises both alike.

    python benchmarks/train_throughput.py --json
    python benchmarks/train_throughput.py --preset gpt2-124m --device cuda --json

Prints tokens/s for both (from the median step time) and ratio = dtrain / bare
throughput, the median over steps of paired step-time ratios (target >= 0.95). On CUDA it
also reports MFU = 6 * N * tokens/s / peak FLOP/s (--peak-flops, default H100 bf16
dense 989e12).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def build_batches(args, vocab_tokenizer):
    from dtrain.training.data import DataSource, PageReader, PageSpec, assign_pages

    spec = PageSpec(seq_len=args.seq_len, page_sequences=args.batch, docs_per_page=args.docs_per_page)
    reader = PageReader(DataSource.shipped(), vocab_tokenizer, spec)
    n = args.steps + args.warmup
    pages = assign_pages(run_id="bench", uid=0, epoch=0, page_counter=0, num_pages=reader.num_pages,
                         count=n, max_uids=1)
    return [reader.read_page(p) for p in pages]


def sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def make_dtrain(model, args, total, device):
    from dtrain.training.trainer import Trainer, TrainerConfig

    cfg = TrainerConfig(micro_batch_size=args.micro_batch, local_batch_size=args.batch, optimizer="adamw",
                        lr=args.lr, warmup_steps=args.warmup, total_steps=total, grad_clip=1.0,
                        precision=args.precision, device=str(device))
    tr = Trainer(model, cfg)
    return lambda x: tr.train_step(x).loss


def make_bare(model, args, total, device):
    """The loop one would write by hand with torch and transformers."""
    import contextlib
    import math

    import torch

    from dtrain.training.precision import resolve_precision

    model.to(device).train()
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    other = [p for p in params if p.dim() < 2]
    fused = {"fused": True} if device.type == "cuda" else {}
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, **fused)

    def factor(s):
        if s < args.warmup:
            return (s + 1) / args.warmup
        p = min(1.0, (s - args.warmup) / max(1, total - args.warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    bf16 = resolve_precision(args.precision, device) == "bf16"
    ctx = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext

    def step(x):
        x = x.to(device)
        losses = []
        for i in range(0, x.shape[0], args.micro_batch):
            mb = x[i : i + args.micro_batch]
            with ctx():
                loss = model(input_ids=mb, labels=mb, use_cache=False).loss.float()
            (loss * (mb.shape[0] / x.shape[0])).backward()
            losses.append(loss.detach())
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        return torch.stack(losses).mean().item()  # a real loop logs its loss

    return step


def measure(args, fresh, batches, device):
    """Step both loops alternately on the same batches; return per-step seconds per side.

    Alternating step by step (and swapping who goes first) exposes both sides to
    the same machine load, which matters on a shared CPU.
    """
    total = len(batches)
    steppers = {"bare": make_bare(fresh(), args, total, device), "dtrain": make_dtrain(fresh(), args, total, device)}
    seconds: dict[str, list[float]] = {"bare": [], "dtrain": []}
    losses = {"bare": [], "dtrain": []}
    tokens = 0
    for i, x in enumerate(batches):
        order = ("bare", "dtrain") if i % 2 == 0 else ("dtrain", "bare")
        for name in order:
            sync(device)
            t0 = time.perf_counter()
            losses[name].append(steppers[name](x))
            sync(device)
            if i >= args.warmup:
                seconds[name].append(time.perf_counter() - t0)
        if i >= args.warmup:
            tokens += x.numel()
    return tokens, seconds, losses


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"])
    ap.add_argument("--steps", type=int, default=30, help="timed optimizer steps")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps before timing")
    ap.add_argument("--batch", type=int, default=16, help="samples per optimizer step")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--docs-per-page", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--tokenizer", default="distilgpt2")
    ap.add_argument("--peak-flops", type=float, default=989e12, help="accelerator peak FLOP/s for MFU")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)

    import torch

    from dtrain.training.models import count_parameters, create_model
    from dtrain.training.tokenizer import load_tokenizer
    from dtrain.training.precision import resolve_precision

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    tok, info = load_tokenizer(args.tokenizer, allow_fallback=True, local_files_only=True)
    batches = build_batches(args, tok)

    def fresh():
        return create_model(args.preset, vocab_size=len(tok), n_positions=max(args.seq_len, 128), seed=0)

    n_params = count_parameters(fresh())
    tokens, seconds, losses = measure(args, fresh, batches, device)
    # Medians, and the median of paired per-step ratios: a load spike from another
    # process hits one step of one side, and the median discards it.
    batch_tokens = batches[0].numel()
    bare = batch_tokens / statistics.median(seconds["bare"])
    dt = batch_tokens / statistics.median(seconds["dtrain"])
    ratio = statistics.median(b / d for b, d in zip(seconds["bare"], seconds["dtrain"]))
    mean_ratio = sum(seconds["bare"]) / sum(seconds["dtrain"])
    out = {
        "preset": args.preset,
        "params": n_params,
        "tokenizer": info.name,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "precision": resolve_precision(args.precision, device),
        "threads": args.threads,
        "batch": args.batch,
        "micro_batch": args.micro_batch,
        "seq_len": args.seq_len,
        "steps": args.steps,
        "timed_tokens": tokens,
        "bare_tokens_per_s": round(bare, 1),
        "dtrain_tokens_per_s": round(dt, 1),
        "ratio": round(ratio, 4),
        "ratio_of_totals": round(mean_ratio, 4),
        # same init, data and maths: the two loss curves should agree closely
        "final_loss_bare": round(losses["bare"][-1], 4),
        "final_loss_dtrain": round(losses["dtrain"][-1], 4),
    }
    if device.type == "cuda":
        out["peak_flops"] = args.peak_flops
        out["mfu_dtrain"] = round(6 * n_params * dt / args.peak_flops, 4)
        out["mfu_bare"] = round(6 * n_params * bare / args.peak_flops, 4)
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:>20}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
