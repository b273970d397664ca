"""The part reducer (dtrain/swarm/averaging/reducer.py), driven directly as the runner drives it."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from dtrain.swarm.averaging.centered_clip import centered_clip, clip_account
from dtrain.swarm.averaging.norms import NORM_SLACK, part_check, within_norm
from dtrain.swarm.averaging.reducer import CheckedReducer, ReducerFinished, SenderBanned

SHAPES = (torch.Size([4]), torch.Size([4]))


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=30))


def full(v):
    return torch.full((4,), float(v))


async def _all(reducer, parts_by_sender, part_index=0, **kw):
    """Every sender sends its part of ``part_index`` concurrently; results (or exceptions) in order."""
    return await asyncio.gather(*(reducer.accumulate_part(i, part_index, p, **kw)
                                  for i, p in enumerate(parts_by_sender)), return_exceptions=True)


def test_checks():
    assert part_check(torch.tensor([3.0, 4.0])) == (True, 5.0)
    assert not part_check(torch.tensor([1.0, math.nan]))[0]
    assert not part_check(torch.tensor([1.0, math.inf]))[0]
    assert not part_check(torch.tensor([1.0, math.inf], dtype=torch.float64))[0]
    assert part_check(torch.tensor([3.0, 4.0], dtype=torch.float64)) == (True, 5.0)
    assert within_norm(10.0, 10.0) and within_norm(10.0 * NORM_SLACK, 10.0)
    assert not within_norm(10.0 * NORM_SLACK + 1e-3, 10.0)


def test_part_check_is_exact_where_float32_squares_overflow():
    # finite float32 values whose squares overflow float32 take the float64 pass: still finite,
    # with the right norm (the float32 dot alone would call them infinite)
    big = torch.tensor([3e20, 4e20, 0.0])
    finite, norm = part_check(big)
    assert finite and math.isclose(norm, 5e20, rel_tol=1e-6)
    huge = torch.full((10,), 3.0e38)
    finite, norm = part_check(huge)
    assert finite and math.isclose(norm, 3.0e38 * math.sqrt(10), rel_tol=1e-6)
    # and the float32 pass agrees with float64 on ordinary parts, views and other shapes
    x = torch.randn(3, 40_000, generator=torch.Generator().manual_seed(1))
    for t in (x, x[1], x[:, ::7], x.T):
        finite, norm = part_check(t)
        assert finite and math.isclose(norm, float(t.double().norm()), rel_tol=1e-5)
    for bad in (math.nan, math.inf, -math.inf):
        y = x.clone()
        y[2, 39_999] = bad
        assert not part_check(y)[0]
    assert not part_check(torch.tensor([1.0, math.nan], dtype=torch.float16))[0]
    assert part_check(torch.zeros(0)) == (True, 0.0)


def test_weights_come_from_the_gather_not_the_wire():
    async def go():
        r = CheckedReducer(SHAPES, 3, sender_weights=[1.0, 3.0, 0.0])
        return await _all(r, [full(1), full(2), full(100)], weight=1000.0)

    out = run(go())
    for result in out:  # every sender receives the same average: (1*1 + 3*2 + 0*100) / 4
        assert torch.equal(result, full(7 / 4))


def test_a_nonfinite_part_bans_its_sender_and_is_never_added():
    async def go():
        r = CheckedReducer(SHAPES, 3, sender_weights=[1.0, 1.0, 1.0])
        bad = full(1)
        bad[1] = math.nan
        first = await _all(r, [full(1), full(3), bad])
        second = await _all(r, [full(5), full(7), full(0)], part_index=1)
        return r, first, second

    r, first, second = run(go())
    assert isinstance(first[2], SenderBanned) and "non-finite" in str(first[2])
    assert torch.equal(first[0], full(2)) and torch.equal(first[1], full(2))
    assert isinstance(second[2], SenderBanned) and "banned in background" in str(second[2])
    assert torch.equal(second[0], full(6))
    assert r.rejected == {2} and r.too_large == set() and r.finished.is_set()


def test_a_part_larger_than_its_announced_norm_is_refused():
    async def go():
        r = CheckedReducer(SHAPES, 2, sender_weights=[1.0, 1.0], sender_norms=[10.0, 1.0])
        return r, await _all(r, [full(1), full(1)])  # norm 2: fine for sender 0, too large for sender 1

    r, out = run(go())
    assert torch.equal(out[0], full(1))
    assert isinstance(out[1], SenderBanned) and "larger than its announced norm" in str(out[1])
    assert r.too_large == {1} and r.rejected == {1}


def test_a_part_checked_off_the_loop_uses_the_given_verdict():
    async def go():
        r = CheckedReducer(SHAPES, 1, sender_weights=[1.0])
        return await r.accumulate_part(0, 0, full(1), check=(False, 2.0))

    with pytest.raises(SenderBanned, match="non-finite"):
        run(go())


def test_reject_bans_for_a_reason_of_the_caller():
    async def go():
        r = CheckedReducer(SHAPES, 2, sender_weights=[1.0, 1.0])
        with pytest.raises(SenderBanned, match="contradicts"):
            r.reject(1, r.contradicted, "sent a part that contradicts its commitment")
        return r, await r.accumulate_part(0, 0, full(4))

    r, out = run(go())
    assert r.contradicted == {1} and r.rejected == {1}
    assert torch.equal(out, full(4))  # the part completed without the refused sender


def test_banning_a_sender_twice_counts_once():
    async def go():
        r = CheckedReducer(SHAPES, 3, sender_weights=[1.0, 1.0, 1.0])
        r.on_sender_failed(2)
        r.on_sender_failed(2)  # the runner may ban again from another path
        assert r.num_current_senders == 2
        return await _all(r, [full(1), full(3)])

    out = run(go())
    assert all(torch.equal(x, full(2)) for x in out)


def test_without_weight_the_part_is_the_plain_mean():
    async def go():
        r = CheckedReducer(SHAPES, 2, sender_weights=[0.0, 0.0])  # only validators left
        return await _all(r, [full(1), full(5)])

    out = run(go())
    assert all(torch.equal(x, full(3)) for x in out)


def test_a_part_nobody_sent_is_nan():
    async def go():
        r = CheckedReducer(SHAPES, 2, sender_weights=[1.0, 1.0])
        await _all(r, [full(1), full(3)])
        part = r.current_part_future
        r.on_sender_failed(0)
        r.on_sender_failed(1)
        return r, await part

    r, result = run(go())
    assert bool(torch.isnan(result).all())  # receivers keep their local values for it
    assert r.finished.is_set()


def test_parts_are_reduced_in_order():
    async def go():
        r = CheckedReducer(SHAPES, 2, sender_weights=[1.0, 1.0])
        early = asyncio.create_task(r.accumulate_part(0, 1, full(10)))
        await asyncio.sleep(0.01)
        assert not early.done() and r.current_part_index == 0
        await _all(r, [full(1), full(3)])
        late = await r.accumulate_part(1, 1, full(20))
        return await early, late

    early, late = run(go())
    assert torch.equal(early, full(15)) and torch.equal(late, full(15))


def test_centered_clip_combines_the_weighted_senders():
    torch.manual_seed(0)
    parts = [torch.randn(4) for _ in range(3)] + [torch.full((4,), 50.0)]
    weights = [1.0, 2.0, 1.0, 1.0]

    async def go():
        r = CheckedReducer(SHAPES, 4, sender_weights=weights, robust=True)
        return await _all(r, parts)

    out = run(go())
    want = centered_clip(parts, weights)
    for x in out:
        torch.testing.assert_close(x, want)
    mean = sum(w * p for w, p in zip(weights, parts)) / sum(weights)
    assert float((want - mean).norm()) > 1.0  # the clip, not the mean


def _direct_centered_clip(parts, weights, iterations=20, tau_scale=1.0):
    """The rule as written (Karimireddy et al.): the iteration on the vectors themselves, in float64."""
    x = torch.stack([p.double() for p, w in zip(parts, weights) if w > 0])
    w = torch.tensor([float(w) for w in weights if w > 0], dtype=torch.float64)
    v = x.sort(dim=0).values[(x.shape[0] - 1) // 2].clone()
    tau = tau_scale * float((x - v).norm(dim=1).median())
    share = w / w.sum()
    for _ in range(iterations):
        scale = torch.clamp(tau / (x - v).norm(dim=1).clamp_min(1e-30), max=1.0)
        step = ((share * scale)[:, None] * (x - v)).sum(0)
        v = v + step
        if float(step.norm()) <= 1e-6 * float(v.norm()):
            break
    return v


def _fixed_point(parts, weights, tau_scale=1.0, iterations=5000):
    """The rule's fixed point, ``v = sum_i c_i(v) x_i / sum_i c_i(v)``, iterated to the end in float64."""
    x = torch.stack([p.double() for p, w in zip(parts, weights) if w > 0])
    w = torch.tensor([float(w) for w in weights if w > 0], dtype=torch.float64)
    v0 = x.sort(dim=0).values[(x.shape[0] - 1) // 2]
    tau = tau_scale * float((x - v0).norm(dim=1).median())
    v = _direct_centered_clip(parts, weights, tau_scale=tau_scale)
    for _ in range(iterations):
        c = w * torch.clamp(tau / (x - v).norm(dim=1).clamp_min(1e-30), max=1.0)
        v = (c[:, None] * x).sum(0) / c.sum()
    return v


@pytest.mark.parametrize("senders", [3, 4, 5, 8])
def test_centered_clip_is_the_direct_iteration_computed_on_coefficients(senders):
    """The reducer's CenteredClip runs on the Gram matrix of the senders' offsets and returns a
    convex combination of the parts (its account, which receivers check): it must be the rule's
    fixed point at least as closely as the direct iteration is, for honest clusters, one or two
    far-off senders, scaled and negated ones, unequal weights, and every sender on one line (a
    rank-1 Gram)."""
    gen = torch.Generator().manual_seed(senders)
    m = 4096
    g = torch.randn(m, generator=gen)
    cases = {
        "honest": [g + 0.3 * torch.randn(m, generator=gen) for _ in range(senders)],
        "one far": [g + 0.3 * torch.randn(m, generator=gen) for _ in range(senders - 1)] + [-50 * g],
        "two far": [g + 0.3 * torch.randn(m, generator=gen) for _ in range(senders - 2)] + [10 * g, 40 * torch.ones(m)],
        "collinear": [(1 + 0.1 * i) * g for i in range(senders)],
        "tiny": [1e-7 * (g + 0.3 * torch.randn(m, generator=gen)) for _ in range(senders)],
    }
    for name, parts in cases.items():
        weights = [float(1 + (i % 3)) for i in range(senders)]
        direct = _direct_centered_clip(parts, weights)
        got, coefficients, tau = clip_account(parts, weights)
        assert got.dtype == torch.float32 and got.shape == parts[0].shape
        # the account: a convex combination of the parts that is the result
        assert (coefficients >= 0).all() and abs(coefficients.sum() - 1) < 1e-12
        combined = sum(float(c) * p.double() for c, p in zip(coefficients, parts))
        assert float((got.double() - combined).norm() / combined.norm()) < 1e-6, name
        # as close to the rule's fixed point as the direct iteration gets (closer where 20
        # iterations do not converge: a far sender holding half the weight)
        fixed = _fixed_point(parts, weights)
        err_direct = float((direct - fixed).norm() / fixed.norm())
        err = float((got.double() - fixed).norm() / fixed.norm())
        assert err <= err_direct + 1e-6, (name, err, err_direct)
        if err_direct < 1e-6:
            assert float((got.double() - direct).norm() / direct.norm()) < 1e-5, name
    # weight-0 senders are left out, as before
    parts = [g + 0.3 * torch.randn(m, generator=gen) for _ in range(3)] + [1e6 * g]
    torch.testing.assert_close(centered_clip(parts, [1.0, 1.0, 1.0, 0.0]), centered_clip(parts[:3], [1.0] * 3))


@pytest.mark.parametrize("n", list(range(1, 13)) + [16])
def test_the_pruned_median_network_is_the_lower_median(n):
    from dtrain.swarm.averaging.centered_clip import _median_network, _sorting_network, lower_median

    gen = torch.Generator().manual_seed(n)
    rows = [torch.randn(513, generator=gen) for _ in range(n)]
    rows[0][:5] = rows[-1][:5]  # ties
    want = torch.stack(rows).sort(dim=0).values[(n - 1) // 2]
    got = lower_median(rows)
    assert torch.equal(got, want)
    assert all(got is not r for r in rows)  # a new tensor: the caller adds to it in place
    _, kept = _median_network(n)
    _, full_network = _sorting_network(n)
    assert sum(lo + hi for _, _, lo, hi in kept) <= 2 * len(full_network)


def test_a_finished_reducer_refuses_later_parts():
    async def go():
        r = CheckedReducer(SHAPES, 1, sender_weights=[1.0])
        r.finalize()
        await r.accumulate_part(0, 1, full(1))

    with pytest.raises(ReducerFinished):
        run(go())


@pytest.mark.parametrize("robust", [False, True], ids=["mean", "centered-clip"])
def test_a_sender_cancelled_while_it_waits_leaves_the_part_to_the_others(robust):
    """A sender's stream handler is cancelled when its stream closes (a peer that crashed, hung
    up or was killed) while it waits for the other senders of a part. That must end only its
    own wait: the part still completes for everyone else, and the reducer moves on. Awaiting
    the part's shared future directly cancelled the future itself: every other sender of the
    part got CancelledError (their streams failed, and the runner banned honest peers), the
    next sender's part could not be set, and the reducer never finished."""
    async def go():
        r = CheckedReducer(SHAPES, 3, sender_weights=[1.0, 1.0, 1.0], robust=robust)
        first = asyncio.create_task(r.accumulate_part(0, 0, full(1)))
        gone = asyncio.create_task(r.accumulate_part(1, 0, full(3)))
        await asyncio.sleep(0.01)
        gone.cancel()  # its stream closed; the runner then bans it for the parts it did not send
        await asyncio.gather(gone, return_exceptions=True)
        r.on_sender_failed(1)
        last = await r.accumulate_part(2, 0, full(5))
        rest = await _all(r, [full(7), full(100), full(9)], part_index=1)
        return await first, last, gone.cancelled(), rest, r.finished.is_set()

    first, last, cancelled, rest, finished = run(go())
    assert cancelled
    want = centered_clip([full(1), full(3), full(5)], [1.0, 1.0, 1.0]) if robust else full(3)
    torch.testing.assert_close(first, want)
    torch.testing.assert_close(last, want)
    # part 1: the cancelled sender is out (banned after its part 0); the others' mean
    assert isinstance(rest[1], SenderBanned)
    want_next = centered_clip([full(7), full(9)], [1.0, 1.0]) if robust else full(8)
    torch.testing.assert_close(rest[0], want_next)
    torch.testing.assert_close(rest[2], want_next)
    assert finished
