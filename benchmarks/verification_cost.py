#!/usr/bin/env python3
"""The validator's cost: its verification time per miner ÷ that miner's training time per round.

One round of the sandbox's protocol, on the sandbox's settings (tiny model, 128-token
sequences, 4-sequence pages, micro-batches of 4, a local batch of 64, one Train page of
which half the micro-batches are recomputed, one audited page), on this machine:

- baseline, the miner: train its local batch page by page and record its work report
  (``Trainer.accumulate`` + ``WorkLog.record``, exactly what ``Miner._train_own_page`` does);
- the validator, per miner: recompute the chosen Train micro-batches, check the committed
  page ids, recompute the audited pages, and compare a state slice with its replica;
- the secret-seed round audit (docs/scoring.md, "Round audit"), timed apart: the validator's
  check of the parts the miner sent (sketching them under a fresh seed and weighing them against
  the result, ``audit_round``; a dispute-free round), the miner's answer (its parts' sketches,
  ``SentContribution.sketches``; the miner's cost, per validator), and the batch audit
  (recomputing the whole committed batch and ``batch_problem``), which a validator runs with
  ``--batch-audit-probability`` (the default, 0.25).

All are timed in alternation, ``--repeats`` times; prints the median of each, the spread,
``ratio`` = validator / miner without the round audit (target <= 0.15), and
``ratio_with_round_audit`` = (validator + round-audit check + probability x batch audit) / miner. Single-threaded torch, so the figure is
per-core and comparable between machines of one kind; a GPU miner on a CPU validator is not
what this measures.

    python benchmarks/verification_cost.py --json
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--page-sequences", type=int, default=4)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--local-batch", type=int, default=64)
    ap.add_argument("--pages-per-query", type=int, default=1)
    ap.add_argument("--recompute-fraction", type=float, default=0.5)
    ap.add_argument("--audit-pages", type=int, default=1)
    ap.add_argument("--slice-bytes", type=int, default=1 << 20)
    ap.add_argument("--batch-audit-probability", type=float, default=0.25)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    import torch

    from dtrain.neurons.sync import state_slice
    from dtrain.training.data import DataSource, PageReader, PageSpec, assign_pages
    from dtrain.training.fingerprint import Fingerprint, compare_fingerprints
    from dtrain.training.models import create_model
    from dtrain.training.replica import params_rms, slice_distance
    from dtrain.training.tokenizer import load_fallback_tokenizer
    from dtrain.training.trainer import Trainer, TrainerConfig, recompute_fingerprints
    from dtrain.training.work_audit import recompute_page_work
    from dtrain.sketch import WORK_SKETCH_K
    from dtrain.training.work import WorkLog, work_nonce
    from dtrain.validation.verification import check_page_ids, choose_audit_pages
    from dtrain.swarm.averaging.audit import (
        ReducedPart, RoundEvidence, SenderAudit, audit_nonce, audit_round, batch_problem, draw_seed,
    )
    from dtrain.swarm.averaging.contribution import PartLayout, binding_rtol
    from dtrain.swarm.averaging.kept import SentContribution
    from dtrain.swarm.averaging.settings import AveragingConfig, part_size_for
    from dtrain.swarm.wire import make_compression, wire_form
    from dtrain.training.work_audit import summed_gradients

    torch.set_num_threads(args.threads)
    tok = load_fallback_tokenizer()
    reader = PageReader(DataSource.shipped(), tok, PageSpec(seq_len=args.seq_len, page_sequences=args.page_sequences))
    model = create_model("tiny", vocab_size=len(tok), n_positions=args.seq_len, seed=0)
    trainer = Trainer(model, TrainerConfig(micro_batch_size=args.micro_batch, local_batch_size=args.local_batch))
    run_id, uid, epoch = "bench", 1, 0
    n_pages = args.local_batch // args.page_sequences
    own = assign_pages(run_id=run_id, uid=uid, epoch=epoch, page_counter=0, count=n_pages, num_pages=reader.num_pages)
    own_tokens = [reader.read_page(p) for p in own]
    nonce = "ab" * 16
    challenge = reader.read_pages(assign_pages(run_id=run_id, uid=uid, epoch=epoch, page_counter=0,
                                               count=args.pages_per_query, num_pages=reader.num_pages, nonce=nonce))
    work_seed = work_nonce(run_id, epoch)

    def miner_round():
        trainer.zero_grad()
        log = WorkLog(run_id)
        log.reset(epoch)
        for counter, (page, tokens) in enumerate(zip(own, own_tokens)):
            results = trainer.accumulate(tokens)
            log.record(page=page, counter=counter, samples=tokens.shape[0], loss=results[0].loss,
                       gradients=trainer.gradients())
        return log.report()

    report = miner_round()
    answer = recompute_fingerprints(model, challenge, nonce=nonce, micro_batch_size=args.micro_batch)
    rng = random.Random(0)

    def validator_round():
        expected = len(answer)
        count = max(1, math.ceil(args.recompute_fraction * expected))
        for index in sorted(rng.sample(range(expected), count)):
            x = challenge[index * args.micro_batch:(index + 1) * args.micro_batch]
            ref = recompute_fingerprints(model, x, nonce=nonce, micro_batch_size=args.micro_batch)[0]
            assert compare_fingerprints(answer[index], ref).passed, compare_fingerprints(answer[index], ref).reasons
        assert not check_page_ids(report.pages, lambda c: assign_pages(
            run_id=run_id, uid=uid, epoch=epoch, page_counter=c, count=1, num_pages=reader.num_pages)[0])
        for index in choose_audit_pages(len(report.pages), args.audit_pages, rng):
            entry = report.pages[index]
            ref = recompute_page_work(model, reader.read_pages([entry.page]), nonce=work_seed,
                                      micro_batch_size=args.micro_batch, k=WORK_SKETCH_K)
            claimed = Fingerprint(loss=entry.loss, sketch=entry.sketch, samples=entry.samples)
            assert compare_fingerprints(claimed, ref).passed, compare_fingerprints(claimed, ref).reasons
        offset = 4 * rng.randrange(sum(p.numel() for p in trainer.params))
        mine = state_slice(trainer, offset, args.slice_bytes)
        slice_distance(mine, mine, params_rms(trainer.params))

    # The miner's contribution as `mine` sends it (the mean gradient, the production codec and part
    # size), in a round where it alone is in every part's combination: what the validator's round
    # audit weighs per miner.
    wire = AveragingConfig()
    compression = make_compression(wire.compression)
    mean = [g.detach().float().div(report.samples).cpu().clone() for g in trainer.gradients()]
    layout = PartLayout.of(mean, compression, part_size_for(sum(4 * t.numel() for t in mean)))
    sent = SentContribution(mean, layout, compression, round_id="bench")
    evidence = RoundEvidence(senders=["miner"], layout=layout, compression=wire.compression,
                             parts={g: ReducedPart("reducer", (1.0,), (None,)) for g in range(len(layout))})
    result = [t.clone() for t in mean]
    for i, start, length in layout.parts:  # what a receiver decodes of the miner's parts
        result[i].reshape(-1)[start:start + length] = wire_form(mean[i].reshape(-1)[start:start + length],
                                                                compression)[1]
    rtol = binding_rtol(wire.compression)

    def round_audit_check(sketches, secret):
        found = audit_round(evidence, result, {"miner": sketches}, secret, rtol, lambda peer, part: None)
        assert not found.problems and found.parts_checked == len(layout), found
        return found

    def batch_audit(sketches, secret, found):
        total, samples = [None] * len(trainer.params), 0
        for entry in report.pages:
            _, _, n = summed_gradients(model, reader.read_pages([entry.page]), micro_batch_size=args.micro_batch,
                                       into=total)
            samples += n
        work_mean = [None if g is None else g.float().div(samples) for g in total]
        claim = SenderAudit(nonce=secret, sketches=sketches, confirmed=frozenset(found.confirmed["miner"]),
                             layout=layout, rtol=rtol)
        assert batch_problem(work_mean, claim) == ""

    miner_s, validator_s, answer_s, check_s, batch_s = [], [], [], [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        miner_round()
        miner_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        validator_round()
        validator_s.append(time.perf_counter() - t0)
        secret = audit_nonce(draw_seed())
        t0 = time.perf_counter()
        sketches = sent.sketches(secret)
        answer_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        found = round_audit_check(sketches, secret)
        check_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        batch_audit(sketches, secret, found)
        batch_s.append(time.perf_counter() - t0)
    ratios = [v / m for v, m in zip(validator_s, miner_s)]
    p = args.batch_audit_probability
    with_audit = [(v + c + p * b) / m for v, c, b, m in zip(validator_s, check_s, batch_s, miner_s)]
    out = {"miner_train_s": statistics.median(miner_s), "validator_verify_s": statistics.median(validator_s),
           "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
           "round_audit_check_s": statistics.median(check_s), "round_audit_answer_s": statistics.median(answer_s),
           "batch_audit_s": statistics.median(batch_s),
           "ratio_with_round_audit": statistics.median(with_audit), "ratio_with_round_audit_min": min(with_audit),
           "ratio_with_round_audit_max": max(with_audit),
           "miner_answer_ratio": statistics.median([a / m for a, m in zip(answer_s, miner_s)]),
           "parts": len(layout), "repeats": args.repeats, "threads": args.threads,
           "settings": {k: getattr(args, k) for k in ("seq_len", "page_sequences", "micro_batch", "local_batch",
                                                      "pages_per_query", "recompute_fraction", "audit_pages",
                                                      "batch_audit_probability")}}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"miner trains its local batch: {out['miner_train_s']:.3f} s (median of {args.repeats})")
        print(f"validator verifies that miner: {out['validator_verify_s']:.3f} s")
        print(f"ratio {out['ratio']:.3f} (range {out['ratio_min']:.3f}-{out['ratio_max']:.3f}; target <= 0.15)")
        print(f"round audit: check {out['round_audit_check_s']:.3f} s, the miner's answer "
              f"{out['round_audit_answer_s']:.3f} s, batch audit {out['batch_audit_s']:.3f} s")
        print(f"ratio with the round audit (batch audit at p={p:g}): {out['ratio_with_round_audit']:.3f} "
              f"(range {out['ratio_with_round_audit_min']:.3f}-{out['ratio_with_round_audit_max']:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
