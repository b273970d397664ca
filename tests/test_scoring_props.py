"""Property tests: invariants of scoring and weights for arbitrary inputs."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dtrain.swarm.records import Outcome
from dtrain.validation.scoring import (
    EmaState,
    MicroBatchCheck,
    MinerRoundInput,
    TrainCheck,
    combined_scores,
    score_round,
    update_ema,
)
from dtrain.validation.weights import U16_MAX, compute_weights, to_u16

floats = st.floats(allow_nan=True, allow_infinity=True, width=64)
checks = st.builds(MicroBatchCheck, st.booleans(), floats, floats)
trains = st.builds(
    TrainCheck, st.lists(checks, max_size=5), st.integers(-10, 10**7), st.integers(-10, 10**7)
)
outcomes = st.sampled_from(list(Outcome))
inputs = st.builds(MinerRoundInput, st.none() | trains, st.none() | outcomes, st.none() | floats)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.integers(0, 255), inputs, max_size=8))
def test_round_scores_bounded_and_gated(round_inputs):
    scores = score_round(round_inputs)
    assert set(scores) == set(round_inputs)
    for uid, s in scores.items():
        inp = round_inputs[uid]
        if s.combined is not None:
            assert 0.0 <= s.combined <= 1.0
        for c in (s.gradient, s.steps, s.bandwidth, s.participation):
            assert c is None or 0.0 <= c <= 1.0
        if inp.train is not None and any(not c.passed for c in inp.train.checks):
            assert s.combined == 0.0 and s.credited_samples == 0
        if inp.outcome is not None and inp.outcome is not Outcome.SUCCESS:
            assert s.combined == 0.0
        if s.gated:
            assert s.combined == 0.0


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.integers(0, 4095), floats, max_size=30))
def test_weights_normalised(scores):
    # Any finite scores, the extremes included (1e308 overflowed the old sum to inf).
    w = compute_weights(scores)
    if w:
        assert sum(w.values()) == pytest.approx(1.0)
        assert all(0.0 <= v <= 1.0 and math.isfinite(v) for v in w.values())
        best = max((u for u, v in scores.items() if math.isfinite(v) and v > 0), key=lambda u: scores[u])
        assert w[best] == max(w.values()) > 0
        uids, vals = to_u16(w)
        assert max(vals) == U16_MAX and all(1 <= v <= U16_MAX for v in vals)
        assert uids == sorted(uids)
    else:
        assert not any(math.isfinite(v) and v > 0 for v in scores.values())


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(min_value=1e300, max_value=1.7e308), min_size=2, max_size=30))
def test_weights_of_huge_scores_do_not_vanish(values):
    w = compute_weights(dict(enumerate(values)))
    assert sum(w.values()) == pytest.approx(1.0) and all(v > 0 for v in w.values())


@settings(max_examples=100, deadline=None)
@given(st.lists(st.dictionaries(st.integers(0, 20), floats, max_size=10), max_size=10))
def test_ema_stays_in_unit_interval(rounds):
    ema = EmaState()
    hotkeys = {u: f"hk{u}" for u in range(0, 21, 2)}
    for r in rounds:
        ema = update_ema(ema, r, hotkeys, alpha=0.3)
        assert set(ema.scores) == set(hotkeys)
        assert all(0.0 <= v <= 1.0 for v in ema.scores.values())


def test_combined_scores_skips_unscored():
    s = score_round({1: MinerRoundInput(outcome="SUCCESS")})
    assert combined_scores(s) == {}
