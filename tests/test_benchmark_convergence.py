"""The pure parts of benchmarks/convergence.py: which DiLoCo set-up is headlined, the summary
keys, the table and the data order every set-up shares (the training itself is the benchmark)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import load_benchmark


@pytest.fixture(scope="module")
def conv():
    return load_benchmark("convergence")


def _setups(d_gap=0.01, q_gap=0.02, d_bpt=160.0, q_bpt=45.0):
    common = dict(rounds=6, failed_rounds=0, replicas_identical=True, seconds=1.0)
    return {
        "reference": dict(loss=4.0, gap=0.0, seconds=1.0),
        "per_step": dict(loss=4.0, gap=0.0, bytes_per_token=16000.0, **common),
        "diloco": dict(loss=4.0 * (1 + d_gap), gap=d_gap, bytes_per_token=d_bpt, **common),
        "diloco_8bit": dict(loss=4.0 * (1 + q_gap), gap=q_gap, bytes_per_token=q_bpt, **common),
    }


def test_relative_gap_is_signed(conv):
    assert conv.relative_gap(4.12, 4.0) == pytest.approx(0.03)
    assert conv.relative_gap(3.88, 4.0) == pytest.approx(-0.03)


def test_summary_headlines_the_cheapest_setup_within_the_gap(conv):
    setups = _setups()
    out = conv.summarize(setups)
    assert setups["diloco"]["bytes_reduction"] == pytest.approx(100.0)
    assert setups["diloco_8bit"]["bytes_reduction"] == pytest.approx(16000 / 45)
    assert setups["reference"]["bytes_reduction"] is None
    assert out["diloco_best"] == "diloco_8bit"
    assert out["diloco_bytes_reduction"] == pytest.approx(16000 / 45)
    assert out["bytes_per_token_ratio"] == out["diloco_bytes_reduction"]
    assert out["diloco_gap"] == pytest.approx(0.02)
    assert out["target_met"] is True
    json.dumps(out)


def test_summary_skips_a_setup_over_the_gap_target(conv):
    # 8-bit compression that costs too much loss is not the headline, however cheap
    out = conv.summarize(_setups(q_gap=0.05))
    assert out["diloco_best"] == "diloco" and out["diloco_gap"] == pytest.approx(0.01)
    # ... and fp32's 100x fewer bytes alone is under the 300x target
    assert out["target_met"] is False


def test_summary_reports_a_miss(conv):
    # nothing within the gap: the smallest gap is shown, and the target is not met
    out = conv.summarize(_setups(d_gap=0.06, q_gap=0.04))
    assert out["diloco_best"] == "diloco_8bit" and out["target_met"] is False
    # within the gap but too few bytes saved
    out = conv.summarize(_setups(d_bpt=1600.0, q_bpt=400.0))
    assert out["diloco_bytes_reduction"] == pytest.approx(40.0) and out["target_met"] is False
    # a failed outer round does not count as a met target
    setups = _setups()
    setups["diloco_8bit"]["failed_rounds"] = 1
    assert conv.summarize(setups)["target_met"] is False


def test_summary_without_measured_bytes(conv):
    # --in-process: no bytes anywhere, the gap is still reported
    setups = _setups()
    for s in setups.values():
        s.pop("bytes_per_token", None)
    del setups["per_step"]
    out = conv.summarize(setups)
    assert out["diloco_best"] == "diloco" and out["diloco_bytes_reduction"] is None
    assert out["target_met"] is False
    assert conv.summarize({"reference": dict(loss=4.0, gap=0.0)}) == {"diloco_best": None}


def test_table_lists_every_setup(conv):
    setups = _setups()
    result = dict(peers=4, steps=600, global_batch_sequences=16, seq_len=64, tokens_trained=614400, epochs=1.48,
                  eval_tokens=14336, setups=setups, wall_seconds=300.0)
    setups["per_step"]["bytes_source"] = "measured over 10 real rounds"
    result.update(conv.summarize(setups))
    text = conv.format_table(result)
    for name in ("reference", "per_step", "diloco ", "diloco_8bit", "measured over 10 real rounds", "met"):
        assert name in text
    assert "355.6x" in text and "+2.00%" in text


def test_global_batch_same_tokens_for_every_setup(conv):
    pool = torch.arange(50).view(50, 1)
    seen = torch.cat([conv.global_batch(pool, s, 16, seed=3) for s in range(6)]).view(-1).tolist()
    # an epoch is a permutation of the pool; the next one starts where it ends
    assert sorted(seen[:50]) == list(range(50)) and sorted(seen[50:96]) != list(range(50))
    assert seen[50:96] != seen[:46]
    assert torch.equal(conv.global_batch(pool, 4, 16, seed=3), conv.global_batch(pool, 4, 16, seed=3))
    assert not torch.equal(conv.global_batch(pool, 0, 16, seed=3), conv.global_batch(pool, 0, 16, seed=4))


def test_parser_defaults_are_the_documented_run(conv):
    args = conv.build_parser().parse_args([])
    assert args.diloco_h >= 100 and args.steps % args.diloco_h == 0 and args.steps // args.diloco_h >= 5
    assert (args.outer_lr, args.outer_momentum, args.inner_warmup) == (None, None, None)
    assert not hasattr(args, "inner_state")  # the moments are carried as `dtrain mine` carries them: no variant
    assert conv.production_diloco(args)


def test_diloco_runs_the_schemas_settings_unless_overridden(conv):
    from dtrain.config import Config

    schema = Config().allreduce
    args = conv.build_parser().parse_args([])
    cfg = conv.bench_config(args, "diloco", lr=args.inner_lr, compression="8bit")
    a = cfg.allreduce
    assert (a.mode, a.compression, a.diloco_inner_steps) == ("diloco", "8bit", args.diloco_h)
    assert (a.outer_lr, a.outer_momentum, a.diloco_inner_warmup, a.diloco_snapshot_every, a.aggregation) == (
        schema.outer_lr, schema.outer_momentum, schema.diloco_inner_warmup, schema.diloco_snapshot_every,
        schema.aggregation)
    assert a.aggregation == "centered_clip"
    assert (cfg.training.lr, cfg.training.local_batch_size, cfg.training.total_steps) == (
        args.inner_lr, args.batch, args.steps)
    tuned = conv.build_parser().parse_args(["--outer-momentum", "0.7", "--inner-warmup", "10"])
    assert not conv.production_diloco(tuned)
    a = conv.bench_config(tuned, "diloco", lr=tuned.inner_lr).allreduce
    assert (a.outer_lr, a.outer_momentum, a.diloco_inner_warmup) == (schema.outer_lr, 0.7, 10)


def _rec(sent=100, received=60, tokens=10, fraction=1.0, error="", outcome="SUCCESS"):
    from dtrain.swarm.records import Outcome, PeerResult, RoundRecord

    return RoundRecord(round_id="r", local_peer_id="a", started_at=0.0, duration_s=1.0, bytes_sent=sent,
                       bytes_received=received, tokens=tokens, fraction_averaged=fraction, error=error,
                       peers=[PeerResult(peer_id="a", outcome=Outcome(outcome))])


def test_bytes_per_token_and_failed_rounds(conv):
    import math

    assert conv.bytes_per_token([_rec(), _rec(sent=40, received=0)]) == pytest.approx(200 / 20)
    assert conv.bytes_per_token([_rec()], tokens=4) == pytest.approx(40.0)
    assert math.isnan(conv.bytes_per_token([]))
    assert not conv.round_failed(_rec())
    assert conv.round_failed(_rec(error="no group formed"))
    assert conv.round_failed(_rec(fraction=0.75))
    assert conv.round_failed(_rec(outcome="FAIL"))


def test_round_log_counts_retries(conv):
    log = conv.RoundLog()
    log.attempts += [1, 1]
    log.records += [_rec(), _rec()]
    assert log.summary() == dict(rounds=2, retried_rounds=0, attempts=2, failed_rounds=0, first_attempt_ok=True,
                                 mean_round_s=1.0, max_round_s=1.0)
    log.attempts.append(3)
    log.failed = 1
    summary = log.summary()
    assert (summary["rounds"], summary["retried_rounds"], summary["attempts"]) == (3, 1, 5)
    assert summary["failed_rounds"] == 1 and summary["first_attempt_ok"] is False
