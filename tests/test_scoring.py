"""Scoring formulas, EMA, weights and the weight-setting policy (pure, no network)."""

from __future__ import annotations

import math
import random

import pytest

from dtrain.swarm.records import Outcome
from dtrain.validation.scoring import (
    GATE_INFLATED_CLAIM,
    GATE_NO_CHECKS,
    GATE_NO_PARTICIPATION,
    GATE_VERIFY_FAILED,
    GATE_WRONG_MODEL,
    EmaState,
    MicroBatchCheck,
    MinerRoundInput,
    ScoringConfig,
    TrainCheck,
    check_from_comparison,
    combine,
    combined_scores,
    gradient_score,
    log_throughput_score,
    score_round,
    update_ema,
)
from dtrain.validation.weights import (
    U16_MAX,
    WeightSetPolicy,
    WeightSetState,
    blocks_until_due,
    compute_weights,
    from_u16,
    record_failure,
    record_success,
    should_set,
    to_u16,
)

OK = MicroBatchCheck(passed=True, similarity=0.999, loss_rel_err=0.001)
BAD = MicroBatchCheck(passed=False, similarity=0.1, loss_rel_err=0.4)


def train(n_ok=4, n_bad=0, samples=1000, claimed=None):
    checks = [OK] * n_ok + [BAD] * n_bad
    return TrainCheck(checks=checks, claimed_samples=samples if claimed is None else claimed, verified_samples=samples)


# ---------------------------------------------------------------- components


def test_gradient_score_all_pass_near_one():
    assert gradient_score(train()) == pytest.approx(0.999 * math.exp(-0.01), rel=1e-9)


def test_gradient_score_one_mismatch_is_zero():
    assert gradient_score(train(n_ok=9, n_bad=1)) == 0.0


def test_gradient_score_no_checks_is_zero():
    assert gradient_score(TrainCheck(checks=[], claimed_samples=10, verified_samples=10)) == 0.0


def test_gradient_score_non_finite_is_zero():
    t = TrainCheck([MicroBatchCheck(True, float("nan"), 0.0)], 10, 10)
    assert gradient_score(t) == 0.0


def test_gradient_negative_similarity_clamped():
    t = TrainCheck([MicroBatchCheck(True, -0.5, 0.0)], 10, 10)
    assert gradient_score(t) == 0.0


def test_log_throughput():
    floor = 1e5
    assert log_throughput_score(None, 1e7, floor) == 0.0
    assert log_throughput_score(0.0, 1e7, floor) == 0.0
    assert log_throughput_score(floor, 1e7, floor) == 0.0
    assert log_throughput_score(1e7, 1e7, floor) == 1.0
    assert log_throughput_score(1e6, 1e7, floor) == pytest.approx(0.5)
    # above the recorded best (should not happen) still clamps to 1
    assert log_throughput_score(2e7, 1e7, floor) == 1.0


def test_combine_renormalises_over_present():
    cfg = ScoringConfig()
    assert combine(1.0, None, None, None, cfg) == 1.0
    assert combine(None, None, None, None, cfg) == 0.0
    v = combine(1.0, 0.5, 0.0, 1.0, cfg)
    assert v == pytest.approx(cfg.w_gradient + 0.5 * cfg.w_steps + cfg.w_participation)


def test_default_weights_sum_to_one():
    c = ScoringConfig()
    assert c.w_gradient + c.w_steps + c.w_bandwidth + c.w_participation == pytest.approx(1.0)


def test_config_validation():
    with pytest.raises(ValueError):
        ScoringConfig(w_gradient=-1)
    with pytest.raises(ValueError):
        ScoringConfig(ema_alpha=0)


def test_outcomes_are_the_swarms_and_strings_are_read_as_them():
    assert Outcome.parse("success") is Outcome.SUCCESS
    assert MinerRoundInput(outcome="wrong_model").outcome is Outcome.WRONG_MODEL
    with pytest.raises(ValueError, match="unknown round outcome 'MAYBE'; expected one of SUCCESS, FAIL"):
        MinerRoundInput(outcome="MAYBE")


# ---------------------------------------------------------------- gates


def _honest(samples=1000, bps=1e7):
    return MinerRoundInput(
        train=train(samples=samples),
        outcome=Outcome.SUCCESS,
        state_slice_bps=bps,
    )


def test_gates():
    inputs = {
        0: _honest(),
        1: MinerRoundInput(train=train(n_bad=1), outcome="SUCCESS", state_slice_bps=1e8),
        2: MinerRoundInput(train=train(), outcome="WRONG_MODEL", state_slice_bps=1e7),
        3: MinerRoundInput(train=train(), outcome="NON_PARTICIPATING", state_slice_bps=1e7),
        4: MinerRoundInput(train=train(claimed=100_000), outcome="SUCCESS"),
        5: MinerRoundInput(train=TrainCheck([], 0, 0), outcome="SUCCESS"),
        6: MinerRoundInput(outcome="NOT_ALIVE"),
        7: MinerRoundInput(outcome="SUCCESS", state_slice_bps=1e7),
    }
    s = score_round(inputs)
    assert s[0].combined > 0.9 and s[0].gated == ()
    assert s[1].combined == 0 and GATE_VERIFY_FAILED in s[1].gated
    assert s[2].combined == 0 and GATE_WRONG_MODEL in s[2].gated and s[2].gradient == 0.0
    assert s[3].combined == 0 and GATE_NO_PARTICIPATION in s[3].gated
    assert s[4].combined == 0 and GATE_INFLATED_CLAIM in s[4].gated and s[4].credited_samples == 0
    assert s[5].combined == 0 and GATE_NO_CHECKS in s[5].gated
    assert s[6].combined == 0 and GATE_NO_PARTICIPATION in s[6].gated
    # No Train check and nothing wrong seen: no update either way.
    assert s[7].combined is None
    assert 7 not in combined_scores(s)
    # Gated miners earn no steps credit, so they do not shrink the honest steps score.
    assert s[0].steps == 1.0


def test_bandwidth_is_the_timed_state_slice_alone():
    s = score_round({
        0: MinerRoundInput(train=train(), outcome="SUCCESS", state_slice_bps=1e7),
        1: MinerRoundInput(train=train(), outcome="SUCCESS", state_slice_bps=1e6),
        2: MinerRoundInput(train=train(), outcome="SUCCESS"),  # not measured: left out, not 0
    })
    assert s[0].bandwidth == 1.0 and s[1].bandwidth == pytest.approx(math.log(8) / math.log(80))  # floor 1 Mbit/s
    assert s[2].bandwidth is None and s[2].combined == pytest.approx(combine(s[2].gradient, s[2].steps, None, 1.0))


def test_claim_within_tolerance_is_fine():
    s = score_round({0: MinerRoundInput(train=train(samples=1000, claimed=1050))})
    assert s[0].combined > 0 and s[0].gated == ()


def test_steps_reference_caps_lone_miner():
    cfg = ScoringConfig(steps_reference=4000)
    s = score_round({0: MinerRoundInput(train=train(samples=1000))}, cfg)
    assert s[0].steps == pytest.approx(0.25)


# ---------------------------------------------------------------- EMA


def test_ema_new_uid_starts_at_zero_and_converges():
    st = EmaState()
    for _ in range(60):
        st = update_ema(st, {1: 1.0}, {1: "hk1"}, alpha=0.1)
    assert st.scores[1] == pytest.approx(1 - 0.9**60)


def test_ema_hotkey_change_resets():
    st = EmaState(scores={1: 0.9}, hotkeys={1: "old"})
    st2 = update_ema(st, {1: 0.5}, {1: "new"}, alpha=0.1)
    assert st2.scores[1] == pytest.approx(0.05)
    assert st2.hotkeys[1] == "new"
    # even without a score this round, the new owner does not inherit
    st3 = update_ema(st, {}, {1: "new"}, alpha=0.1)
    assert st3.scores[1] == 0.0


def test_ema_missing_uid_kept_deregistered_dropped():
    st = EmaState(scores={1: 0.5, 2: 0.7}, hotkeys={1: "a", 2: "b"})
    st2 = update_ema(st, {}, {1: "a"}, alpha=0.5)
    assert st2.scores == {1: 0.5}
    assert st is not st2 and st.scores[2] == 0.7  # input untouched


def test_ema_clamps_bad_inputs():
    st = update_ema(EmaState(), {1: float("nan"), 2: 7.0}, {1: "a", 2: "b"}, alpha=1.0)
    assert st.scores == {1: 0.0, 2: 1.0}


# ---------------------------------------------------------------- weights


def test_compute_weights_normalises_and_excludes_non_miners():
    w = compute_weights({0: 2.0, 1: 1.0, 2: 1.0, 9: 5.0}, miner_uids=[0, 1, 2, 3])
    assert sum(w.values()) == pytest.approx(1.0)
    assert w[0] == pytest.approx(0.5) and w[3] == 0.0 and 9 not in w


@pytest.mark.parametrize("scores", [
    {0: 1e308, 1: 1e308, 2: 5e307},  # the plain sum overflows to inf
    {0: 5e-324, 1: 5e-324},  # the smallest subnormals
    {0: 1e308, 1: 5e-324, 2: 1.0},
])
def test_compute_weights_is_total_for_any_finite_scores(scores):
    w = compute_weights(scores)
    assert sum(w.values()) == pytest.approx(1.0)
    assert all(math.isfinite(v) and 0.0 <= v <= 1.0 for v in w.values())
    top = max(scores, key=scores.get)
    assert w[top] == max(w.values()) > 0


def test_compute_weights_nothing_positive():
    assert compute_weights({0: 0.0, 1: float("nan")}) == {}


def test_u16_roundtrip():
    uids, vals = to_u16({3: 0.5, 1: 0.25, 2: 0.25, 4: 0.0})
    assert uids == [1, 2, 3] and vals == [U16_MAX // 2 + 1, U16_MAX // 2 + 1, U16_MAX]
    back = from_u16(uids, vals)
    assert back[3] == pytest.approx(0.5, abs=1e-4)
    assert to_u16({}) == ([], [])


# ---------------------------------------------------------------- rate-limit policy


def test_should_set_rate_limit_and_backoff():
    pol = WeightSetPolicy(rate_limit_blocks=100, retry_base_blocks=2, retry_max_blocks=10)
    st = WeightSetState()
    assert should_set(pol, st, 5)
    st = record_success(st, 5)
    assert not should_set(pol, st, 105)
    assert blocks_until_due(pol, st, 105) == 1
    assert should_set(pol, st, 106)
    st = record_failure(pol, st, 106, "timeout")
    assert st.failures == 1 and st.next_retry_block == 108 and st.last_error == "timeout"
    assert not should_set(pol, st, 107)
    assert should_set(pol, st, 108)
    st = record_failure(pol, st, 108)
    assert st.next_retry_block == 112
    for b in (112, 120, 140):
        st = record_failure(pol, st, b)
    assert st.next_retry_block == 150  # capped at retry_max_blocks
    st = record_success(st, 150)
    assert st.failures == 0 and st.next_retry_block is None
    assert WeightSetState.from_dict(st.as_dict()) == st


def test_min_interval_overrides_lower_rate_limit():
    pol = WeightSetPolicy(rate_limit_blocks=10, min_interval_blocks=360)
    st = record_success(WeightSetState(), 0)
    assert not should_set(pol, st, 300) and should_set(pol, st, 361)


# ---------------------------------------------------------------- adversary simulation

ADVERSARIES = ("lazy", "wrong-model", "copycat", "freeloader", "inflated-weight", "poisoner")


def _adversary_input(kind: str, rng: random.Random) -> MinerRoundInput:
    """Characteristic per-round observations of each cheating strategy.

    Each adversary is given the best-looking figures it could plausibly show elsewhere
    (fast link, large claims), so the test checks the gates rather than luck.
    """
    fast = 5e8
    if kind == "lazy":
        # Does not train: returns made-up fingerprints that fail recomputation, but
        # shares state quickly and joins all-reduce.
        checks = [MicroBatchCheck(True, 0.99, 0.0)] * 3 + [MicroBatchCheck(False, 0.02, 0.8)]
        return MinerRoundInput(
            TrainCheck(checks, claimed_samples=4000, verified_samples=4000),
            "SUCCESS",
            fast,
        )
    if kind == "wrong-model":
        return MinerRoundInput(
            TrainCheck([OK] * 4, 3000, 3000), "WRONG_MODEL", fast
        )
    if kind == "copycat":
        # Replays another miner's fingerprints: they do not match its own assigned pages.
        checks = [MicroBatchCheck(False, rng.uniform(-0.1, 0.3), rng.uniform(0.05, 0.5)) for _ in range(4)]
        return MinerRoundInput(TrainCheck(checks, 3000, 3000), "SUCCESS", fast)
    if kind == "freeloader":
        # Trains honestly (or pretends well) but never contributes to averaging.
        return MinerRoundInput(
            TrainCheck([OK] * 4, 3000, 3000), "NON_PARTICIPATING", fast
        )
    if kind == "inflated-weight":
        # Real work, but claims 50x the samples to dominate the average.
        return MinerRoundInput(
            TrainCheck([OK] * 4, claimed_samples=150_000, verified_samples=3000),
            "SUCCESS",
            fast,
        )
    if kind == "poisoner":
        # Sends out-of-scale contributions: rejected in the round, and its reported
        # gradients disagree with recomputation.
        checks = [MicroBatchCheck(False, rng.uniform(-1, 0), 10.0) for _ in range(4)]
        return MinerRoundInput(TrainCheck(checks, 3000, 3000), "FAIL", fast)
    raise AssertionError(kind)


def _simulate(rounds: int, seed: int, n_honest: int = 5):
    rng = random.Random(seed)
    hotkeys = {}
    # Honest miners of varying strength: samples per round and link speed differ ~8x.
    strengths = {uid: (500 + 900 * uid, 2e6 * (2**uid)) for uid in range(n_honest)}
    adv_uids = {n_honest + i: k for i, k in enumerate(ADVERSARIES)}
    for uid in list(strengths) + list(adv_uids):
        hotkeys[uid] = f"hk{uid}"
    ema = EmaState()
    cfg = ScoringConfig()
    for _ in range(rounds):
        inputs = {}
        for uid, (samples, bps) in strengths.items():
            jitter = rng.uniform(0.8, 1.2)
            # Honest miners sometimes fail a round (slow link, restart): 10% of rounds.
            status = "SUCCESS" if rng.random() > 0.1 else rng.choice(["FAIL", "NOT_ALIVE"])
            checks = [MicroBatchCheck(True, rng.uniform(0.97, 1.0), rng.uniform(0, 0.02)) for _ in range(4)]
            n = int(samples * jitter)
            inputs[uid] = MinerRoundInput(
                TrainCheck(checks, claimed_samples=n, verified_samples=n),
                status,
                bps * rng.uniform(0.8, 1.2),
            )
        for uid, kind in adv_uids.items():
            inputs[uid] = _adversary_input(kind, rng)
        ema = update_ema(ema, combined_scores(score_round(inputs, cfg)), hotkeys, cfg.ema_alpha)
    return compute_weights(ema.scores, list(hotkeys)), strengths, adv_uids


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_adversary_at_most_quarter_of_weakest_honest(seed):
    weights, honest, adv = _simulate(rounds=40, seed=seed)
    weakest = min(weights[u] for u in honest)
    assert weakest > 0
    for uid, kind in adv.items():
        assert weights[uid] <= 0.25 * weakest, (kind, weights[uid], weakest)
    # stronger honest miners earn more than weaker ones
    assert weights[max(honest)] > weights[min(honest)]
    assert sum(weights.values()) == pytest.approx(1.0)


def test_adversary_that_was_honest_before_decays():
    """A miner that turns lazy after building reputation falls below the bar in time."""
    cfg = ScoringConfig()
    hot = {0: "a", 1: "b"}
    ema = EmaState()
    for _ in range(40):
        ema = update_ema(ema, combined_scores(score_round({0: _honest(), 1: _honest()}, cfg)), hot, cfg.ema_alpha)
    rng = random.Random(0)
    for _ in range(40):
        s = score_round({0: _honest(), 1: _adversary_input("lazy", rng)}, cfg)
        ema = update_ema(ema, combined_scores(s), hot, cfg.ema_alpha)
    w = compute_weights(ema.scores)
    assert w[1] <= 0.25 * w[0]


def test_check_from_comparison_duck_typed():
    class Cmp:  # shape of dtrain.training.fingerprint.Comparison
        passed, cosine, norm_ratio, loss_diff = True, 0.998, 1.0, 0.02

    c = check_from_comparison(Cmp(), reference_loss=4.0)
    assert c == MicroBatchCheck(True, 0.998, 0.005)
    assert check_from_comparison(Cmp(), reference_loss=0.0).loss_rel_err == math.inf
