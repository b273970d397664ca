"""Accountable reducers: the account a reducer sends with each averaged part, and the receivers'
check of it against the senders' claims and the reducer's rule (dtrain/swarm/averaging/accounts.py).

The checks run on real range sketches of real parts; tests/test_swarm_commitments.py runs them
in real hivemind rounds.
"""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest
import torch

from dtrain.swarm.averaging.accounts import (
    Account,
    AccountError,
    account_problem,
    own_part_problem,
    rule_problem,
    tau_floor,
)
from dtrain.swarm.averaging.centered_clip import clip_account
from dtrain.swarm.averaging.reducer import CheckedReducer
from dtrain.sketch import range_sketch
from dtrain.training.work import work_nonce

NONCE = work_nonce("accounts-test", 1)
PARAM, START = 2, 1000


def _claims(parts):
    return [range_sketch(p, PARAM, START, NONCE, k=64).numpy().astype("<f4") for p in parts]


def _check(part, coefficients, parts, weights, *, robust=False, tau=0.0, rtol=1e-4, me=None, committed=None):
    """What every receiver checks, then (for ``me``) what only that sender can."""
    account = Account(np.asarray(coefficients, dtype=np.float64), tau)
    problem = account_problem(part, account, _claims(parts), committed or [True] * len(parts), weights,
                              robust=robust, param_index=PARAM, start=START, nonce=NONCE, rtol=rtol)
    if problem or me is None:
        return problem
    return own_part_problem(part, account, weights, robust=robust, me=me, my_part=lambda: parts[me], rtol=rtol)


def _senders(n=4, m=3000, seed=0, spread=0.5):
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(m, generator=gen)
    return [base + spread * torch.randn(m, generator=gen) for _ in range(n)]


def test_an_account_goes_over_the_wire_and_back_and_a_malformed_one_is_refused():
    account = Account(np.array([0.25, 0.0, 0.75]), tau=1.5)
    back = Account.from_bytes(account.to_bytes(), 3)
    assert back.tau == 1.5 and np.array_equal(back.coefficients, account.coefficients)
    for bad, why in [(account.to_bytes()[:-8], "bytes"), (b"", "bytes"),
                     (Account(np.array([0.5, -0.25, 0.75])).to_bytes(), "negative"),
                     (Account(np.array([0.5, math.nan, 0.5])).to_bytes(), "non-finite"),
                     (Account(np.array([0.5, 0.25, 0.75])).to_bytes(), "sum to")]:
        with pytest.raises(AccountError, match=why):
            Account.from_bytes(bad, 3)


@pytest.mark.parametrize("robust", [False, True])
def test_the_reducer_states_the_combination_it_returned(robust):
    """CheckedReducer's account of each part reproduces the part it returned, under both rules."""
    parts = _senders(4, m=8, seed=3)
    weights = [1.0, 2.0, 3.0, 0.0]
    shapes = (torch.Size([8]),)

    async def go():
        reducer = CheckedReducer(shapes, 4, sender_weights=weights, robust=robust)
        out = await asyncio.gather(*(reducer.accumulate_part(i, 0, p) for i, p in enumerate(parts)))
        return out[0], reducer.accounts[0]

    result, account = asyncio.run(asyncio.wait_for(go(), 30))
    c = account.coefficients
    assert c[3] == 0 and abs(c.sum() - 1) < 1e-12 and (c >= 0).all()
    combined = sum(float(ci) * p.double() for ci, p in zip(c, parts))
    torch.testing.assert_close(result.double(), combined, rtol=1e-6, atol=1e-6)
    if not robust:
        np.testing.assert_allclose(c[:3], np.array(weights[:3]) / 6)


@pytest.mark.parametrize("rule", ["mean", "centered_clip"])
def test_an_honest_account_passes_and_every_alteration_of_the_part_fails(rule):
    parts = _senders(5, seed=1)
    weights = [1.0, 2.0, 1.0, 3.0, 1.0]
    robust = rule == "centered_clip"
    if robust:
        result, c, tau = clip_account(parts, weights)
    else:
        c, tau = np.array(weights) / sum(weights), 0.0
        result = sum(float(ci) * p for ci, p in zip(c, parts))
    for me in (None, 0, 3):
        assert _check(result, c, parts, weights, robust=robust, tau=tau, me=me) == ""
    stale = sum(float(ci) * p for ci, p in zip(c, _senders(5, seed=2)))
    altered = {"negated": -result, "halved": 0.5 * result, "noise 1%": result + 0.01 * result.norm() / 55 * torch.randn(3000),
               "stale": stale, "zero": torch.zeros_like(result)}
    for name, part in altered.items():
        assert "account does not explain" in _check(part, c, parts, weights, robust=robust, tau=tau), name


def test_the_codec_tolerance_is_what_an_altered_part_can_hide_in():
    """With 8-bit's tolerance (0.125 relative) a 1 % change passes and a 50 % one does not: the
    public claims bound a reducer's alteration to the codec's error, not below it."""
    parts = _senders(4, seed=4)
    weights = [1.0] * 4
    c = np.full(4, 0.25)
    mean = sum(0.25 * p for p in parts)
    noise = torch.randn(3000, generator=torch.Generator().manual_seed(9))
    small = mean + 0.01 * mean.norm() * noise / noise.norm()
    assert _check(small, c, parts, weights, rtol=0.125) == ""
    assert "does not explain" in _check(small, c, parts, weights, rtol=1e-4)
    assert "does not explain" in _check(mean * 1.5, c, parts, weights, rtol=0.125)


def test_coefficients_against_the_rule():
    parts = _senders(4, seed=5)
    weights = [1.0, 2.0, 1.0, 0.0]
    # claims that explain the part, but weights the mean does not give
    c = np.array([0.5, 0.25, 0.25, 0.0])
    part = sum(float(ci) * p for ci, p in zip(c, parts))
    assert "against the rule" in _check(part, c, parts, weights)
    # weight on a weight-0 sender (a validator's zeros, or a peer the reducer's caps give 0)
    c = np.array([0.25, 0.5, 0.0, 0.25])
    part = sum(float(ci) * p for ci, p in zip(c, parts))
    assert "rule gives none" in _check(part, c, parts, weights)
    # a sender left out: consistent for everyone else, not for the sender itself
    c = np.array([0.0, 2 / 3, 1 / 3, 0.0])
    part = sum(float(ci) * p for ci, p in zip(c, parts))
    assert _check(part, c, parts, weights, me=1) == ""
    assert "left our part out" in _check(part, c, parts, weights, me=0)
    # a committed sender's weight without its claims
    shown = _claims(parts)
    shown[1] = None
    assert "did not show" in account_problem(part, Account(c), shown, [True] * 4, weights, robust=False,
                                             param_index=PARAM, start=START, nonce=NONCE, rtol=1e-4)


def test_centered_clip_radius_and_down_weighting():
    parts = _senders(5, seed=6)
    weights = [1.0] * 5
    result, c, tau = clip_account(parts, weights)
    sketches = [s.astype(np.float64) for s in _claims(parts)]
    floor = tau_floor(sketches)
    assert 0 < floor < tau  # an honest radius is above the floor the sketches prove
    assert "clip radius" in rule_problem(Account(c, tau=0.9 * floor), weights, robust=True, sketches=sketches)
    assert rule_problem(Account(c, tau), weights, robust=True, sketches=sketches) == ""
    # a radius of 0 (the rule's "a majority sent the very same part") needs that majority
    one = np.zeros(5)
    one[2] = 1.0
    assert "without a majority" in rule_problem(Account(one, 0.0), weights, robust=True, sketches=sketches[2:3],
                                                weighted_sketches=sketches)
    same = [sketches[0]] * 3 + sketches[3:]
    assert rule_problem(Account(one, 0.0), weights, robust=True, sketches=same[2:3], weighted_sketches=same) == ""
    # a reducer that shrinks sender 0's coefficient to a tenth of the rule's, and renormalises:
    # only sender 0 can tell
    shrunk = c.copy()
    shrunk[0] *= 0.1
    shrunk /= shrunk.sum()
    assert "down-weighted our part" in own_part_problem(result, Account(shrunk, tau), weights, robust=True, me=0,
                                                        my_part=lambda: parts[0], rtol=1e-4)
    assert own_part_problem(result, Account(c, tau), weights, robust=True, me=0, my_part=lambda: parts[0],
                            rtol=1e-4) == ""
    # our part, given lazily, is read only when our coefficient is below our fair share
    reads = []

    def ours():
        reads.append(1)
        return parts[0]

    assert "down-weighted our part" in own_part_problem(result, Account(shrunk, tau), weights, robust=True, me=0,
                                                        my_part=ours, rtol=1e-4)
    assert len(reads) == 1
    fair = weights[0] / sum(weights)
    generous = c.copy()
    generous[0] = fair
    generous[1:] *= (1 - fair) / generous[1:].sum()
    assert own_part_problem(result, Account(generous, tau), weights, robust=True, me=0, my_part=ours,
                            rtol=1e-4) == ""
    assert len(reads) == 1


@pytest.mark.parametrize("senders", [3, 4, 5, 8])
def test_honest_centered_clip_passes_the_rule_checks_even_with_heavy_outliers(senders):
    """The floor on tau is proven from the senders' spread, not read off the result: an honest
    CenteredClip passes every receiver's checks and every sender's own, with equal, uneven or
    outlier-heavy weights, honest clusters, far senders, collinear ones and no cluster at all."""
    for seed in range(3):
        gen = torch.Generator().manual_seed(100 * senders + seed)
        m = 4096
        g = torch.randn(m, generator=gen)
        cases = {
            "honest": [g + 0.3 * torch.randn(m, generator=gen) for _ in range(senders)],
            "one far": [g + 0.3 * torch.randn(m, generator=gen) for _ in range(senders - 1)] + [-50 * g],
            "two far": [g + 0.3 * torch.randn(m, generator=gen) for _ in range(senders - 2)]
            + [10 * g, 40 * torch.ones(m)],
            "collinear": [(1 + 0.1 * i) * g for i in range(senders)],
            "no cluster": [torch.randn(m, generator=gen) for _ in range(senders)],
        }
        for weights in ([1.0] * senders, [float(1 + i % 3) for i in range(senders)],
                        [1.0] * (senders - 1) + [float(senders)]):
            for name, parts in cases.items():
                result, c, tau = clip_account(parts, weights)
                sketches = [range_sketch(p, PARAM, START, NONCE, k=64).numpy().astype(np.float64)
                            for p, ci in zip(parts, c) if ci > 0]
                weighted = [range_sketch(p, PARAM, START, NONCE, k=64).numpy().astype(np.float64) for p in parts]
                problem = rule_problem(Account(c, tau), weights, robust=True, sketches=sketches,
                                       weighted_sketches=weighted)
                assert problem == "", (name, weights, problem)
                for me in range(senders):
                    problem = own_part_problem(result, Account(c, tau), weights, robust=True, me=me,
                                               my_part=lambda: parts[me], rtol=1e-4)
                    assert problem == "", (name, weights, me, problem)


def test_the_weight_zero_plain_mean_is_not_checked_against_claims_but_a_dropped_sender_sees_it():
    parts = [torch.zeros(3000)] * 3
    c = np.full(3, 1 / 3)
    assert _check(torch.zeros(3000), c, parts, [0.0, 0.0, 0.0], committed=[False] * 3) == ""
    # everyone with weight dropped: a weighted receiver's own part is missing (under either
    # rule: a radius of 0 excuses our coefficient only for a majority of weighted senders)
    for robust in (False, True):
        assert "left our part out" in _check(torch.zeros(3000), np.array([0.0, 0.5, 0.5]), parts, [2.0, 0.0, 0.0],
                                             committed=[True, False, False], me=0, robust=robust)
