"""Work commitments and robust aggregation in real hivemind rounds (docs/protocol.md, "Work commitments").

Each weighted peer commits, in its gather, to a work report (per page, the sketch of that
page's gradient) and to per-part claims about what it sends. These tests run real peers on
loopback and check that every way of sending something other than the committed work's mean
is refused, and that CenteredClip bounds a sender nobody caught.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from dtrain.swarm.averaging import AveragingConfig, GradientSwarm
from dtrain.swarm.loopback import local_nodes, run_concurrently
from dtrain.swarm.records import Outcome
from dtrain.sketch import WORK_SKETCH_K, gradient_sketch
from dtrain.training.work import PageWork, WorkReport, work_nonce
from tests.faults import FaultInjection
from tests.faults import swarm as make_swarm
from tests.swarm_checks import loopback_config

pytestmark = pytest.mark.slow

_prefix = itertools.count()
NONCE = work_nonce("commit-test", 3)


@pytest.fixture(scope="module")
def nodes():
    with local_nodes(4) as started:
        yield started


def _cfg(group: int, **kw) -> AveragingConfig:
    # exact weighted means are checked below: ask for them (test_centered_clip_bounds_an_unchecked_attacker
    # compares both rules)
    return loopback_config(f"c{next(_prefix)}", group, **{"require_commitments": True, "aggregation": "mean", **kw})


def honest_report(tensors, samples: int, pages: int = 2) -> WorkReport:
    """A report whose pages sum to ``samples`` x the contribution (split unevenly over pages)."""
    total = gradient_sketch([t * samples for t in tensors], NONCE, k=WORK_SKETCH_K).tolist()
    first = [0.25 * v for v in total]
    rest = [v - f for v, f in zip(total, first)]
    per = [samples // pages] * pages
    per[-1] += samples - sum(per)
    sketches = [first, rest] if pages == 2 else [total]
    return WorkReport(epoch=3, pages=tuple(PageWork(page=10 + i, counter=i, samples=per[i], loss=5.0,
                                                    sketch=tuple(sketches[i])) for i in range(pages)))


def _run(nodes, data, cfg, *, reports, sent=None, weights, faults=None):
    swarms = [make_swarm(nodes[i].dht, data[i], "model-a", cfg, fault=(faults or {}).get(i))
              for i in range(len(data))]
    sent = sent or data
    try:
        return swarms, run_concurrently([
            lambda i=i: swarms[i].run_round(sent[i], weight=weights[i], cap=100, work=reports[i], work_nonce=NONCE)
            for i in range(len(data))])
    finally:
        for s in swarms:
            s.shutdown()


def _reason(record, peer_id):
    return next(p.reason for p in record.peers if p.peer_id == peer_id)


@pytest.mark.parametrize("cheat", ["negated", "zero", "rescaled", "noisy"])
def test_contribution_that_is_not_the_mean_of_its_pages_is_refused(nodes, cheat):
    torch.manual_seed(1)
    honest = [[torch.randn(3000)] for _ in range(3)]
    reports = [honest_report(t, 8) for t in honest]
    true = honest[2][0]
    bad = {"negated": -true, "zero": torch.zeros_like(true), "rescaled": 3 * true,
           "noisy": true + 0.05 * true.norm() / 3000 ** 0.5 * torch.randn(3000)}[cheat]
    sent = [[honest[0][0].clone()], [honest[1][0].clone()], [bad.clone()]]
    swarms, recs = _run(nodes, sent, _cfg(3), reports=reports, weights=[8, 8, 8])
    cheater = swarms[2].peer_id
    for r in recs[:2]:
        assert not r.error, r.error
        assert r.outcome_of(cheater) == Outcome.FAIL
        assert "does not match its committed pages" in _reason(r, cheater)
    mean = (honest[0][0] + honest[1][0]) / 2
    for s in sent[:2]:
        torch.testing.assert_close(s[0], mean, rtol=0, atol=1e-5)
    # every peer received the committed work reports, for validators to audit
    assert set(recs[0].work_reports) == {s.peer_id for s in swarms}


def test_lying_claims_are_caught_by_the_reducer(nodes):
    """Claims computed from the honest mean, parts negated on the wire: reducers ban the sender."""
    torch.manual_seed(2)
    data = [[torch.randn(3000)] for _ in range(3)]
    reports = [honest_report(t, 8) for t in data]
    originals = [d[0].clone() for d in data]
    swarms, recs = _run(nodes, data, _cfg(3), reports=reports, weights=[8, 8, 8],
                        faults={2: FaultInjection(scale_parts=-1.0)})
    liar = swarms[2].peer_id
    for r in recs[:2]:
        assert r.outcome_of(liar) == Outcome.FAIL
        assert "contradicts its commitment" in _reason(r, liar)
    honest_mean = (originals[0] + originals[1]) / 2
    # the liar's own share is reduced by the liar itself, from its true (committed) values
    all_three = (originals[0] + originals[1] + originals[2]) / 3
    with_liar = (originals[0] + originals[1] - originals[2]) / 3
    for i, d in enumerate(data[:2]):
        assert not torch.isclose(d[0], with_liar, atol=1e-5).any()  # the negated parts never got in
        changed = d[0] != originals[i]
        ok = torch.isclose(d[0], honest_mean, atol=1e-5) | torch.isclose(d[0], all_three, atol=1e-5)
        assert bool(ok[changed].all())
        assert bool(torch.isclose(d[0], honest_mean, atol=1e-5).any())


def test_claims_that_do_not_prove_out_against_the_committed_root_are_refused(nodes):
    """Parts negated on the wire, and with them the claims each reducer is shown for its share
    (so every part matches its claim): those claims are not under the root the gather committed,
    and every reducer refuses the sender before it takes a part."""
    torch.manual_seed(6)
    data = [[torch.randn(3000)] for _ in range(3)]
    reports = [honest_report(t, 8) for t in data]
    originals = [d[0].clone() for d in data]
    swarms, recs = _run(nodes, data, _cfg(3), reports=reports, weights=[8, 8, 8],
                        faults={2: FaultInjection(scale_parts=-1.0, forge_claims=True)})
    liar = swarms[2].peer_id
    for r in recs[:2]:
        assert r.outcome_of(liar) == Outcome.FAIL
        assert _reason(r, liar) == "sent claims that do not match its committed root"
        assert all(r.outcome_of(s.peer_id) == Outcome.SUCCESS for s in swarms[:2])
    honest_mean = (originals[0] + originals[1]) / 2
    all_three = (originals[0] + originals[1] + originals[2]) / 3
    for d in data[:2]:  # the negated parts never got in (the liar reduces its own share honestly)
        ok = torch.isclose(d[0], honest_mean, atol=1e-5) | torch.isclose(d[0], all_three, atol=1e-5)
        assert bool(ok.all())


def test_a_reducer_that_commits_nothing_still_reads_the_claims_ahead_of_the_parts(nodes):
    """Without required commitments, a peer that committed nothing checks nobody's claims, but a
    committed sender's stream to it still starts with them: it must read them off and average
    the parts after them, and the committed peers must not expect claims from it."""
    torch.manual_seed(7)
    data = [[torch.randn(3000)] for _ in range(3)]
    reports = [honest_report(t, 8) for t in data]
    expected = (data[0][0] + data[1][0] + data[2][0]) / 3
    cfg = _cfg(3, require_commitments=False)
    swarms = [GradientSwarm(nodes[i].dht, data[i], "model-a", cfg, report_type=WorkReport) for i in range(3)]
    try:
        recs = run_concurrently([
            lambda: swarms[0].run_round(data[0], weight=8, cap=100, work=reports[0], work_nonce=NONCE),
            lambda: swarms[1].run_round(data[1], weight=8, cap=100, work=reports[1], work_nonce=NONCE),
            lambda: swarms[2].run_round(data[2], weight=8, cap=100),  # no commitment
        ])
    finally:
        for s in swarms:
            s.shutdown()
    for r in recs:
        assert not r.error and r.fraction_averaged == 1.0, r.error
        assert all(p.outcome == Outcome.SUCCESS for p in r.peers), [(p.outcome, p.reason) for p in r.peers]
    for d in data:
        torch.testing.assert_close(d[0], expected, rtol=0, atol=1e-5)


def test_weight_above_committed_samples_and_missing_commitment_are_refused(nodes):
    torch.manual_seed(3)
    data = [[torch.randn(2000)] for _ in range(4)]
    reports = [honest_report(t, 8) for t in data]
    # peer 2 claims 16 samples for 8 committed; peer 3 sends no commitment at all
    swarms = [GradientSwarm(nodes[i].dht, data[i], "model-a", cfg, report_type=WorkReport) for i, cfg in enumerate([_cfg(4)] * 1)]
    cfg = swarms[0].config
    swarms += [GradientSwarm(nodes[i].dht, data[i], "model-a", cfg, report_type=WorkReport) for i in (1, 2, 3)]
    try:
        recs = run_concurrently([
            lambda: swarms[0].run_round(data[0], weight=8, cap=100, work=reports[0], work_nonce=NONCE),
            lambda: swarms[1].run_round(data[1], weight=8, cap=100, work=reports[1], work_nonce=NONCE),
            lambda: swarms[2].run_round(data[2], weight=16, cap=100, work=reports[2], work_nonce=NONCE),
            lambda: swarms[3].run_round(data[3], weight=8, cap=100),
        ])
    finally:
        for s in swarms:
            s.shutdown()
    for r in recs[:2]:
        assert "claims weight 16 but committed 8 samples" in _reason(r, swarms[2].peer_id)
        assert _reason(r, swarms[3].peer_id) == "no work commitment"
        assert r.outcome_of(swarms[0].peer_id) == r.outcome_of(swarms[1].peer_id) == Outcome.SUCCESS, \
            [(p.peer_id[-6:], p.outcome.value, p.reason) for p in r.peers]


def test_centered_clip_bounds_an_unchecked_attacker(nodes):
    """Without commitments an attacker inside the norm limit gets in; CenteredClip bounds it."""
    torch.manual_seed(4)
    g = torch.randn(3000)
    honest = [g + 0.3 * torch.randn(3000) for _ in range(3)]
    attacker = -5.0 * g
    results = {}
    for rule in ("mean", "centered_clip"):
        data = [[h.clone()] for h in honest] + [[attacker.clone()]]
        cfg = _cfg(4, require_commitments=False, aggregation=rule)
        swarms = [GradientSwarm(nodes[i].dht, data[i], "model-a", cfg, report_type=WorkReport) for i in range(4)]
        try:
            recs = run_concurrently([lambda i=i: swarms[i].run_round(data[i], weight=8, cap=100) for i in range(4)])
        finally:
            for s in swarms:
                s.shutdown()
        assert all(not r.error for r in recs)
        results[rule] = data[0][0]
    honest_mean = torch.stack(honest).mean(0)
    cos = lambda a, b: float(a @ b / (a.norm() * b.norm()))  # noqa: E731
    assert cos(results["mean"], honest_mean) < 0  # the plain mean is dragged past zero
    assert cos(results["centered_clip"], honest_mean) > 0.9


def test_a_large_commitment_reaches_the_averager_whole(nodes):
    """A gather of hundreds of KB (many parts) crosses hivemind's command pipe intact.

    hivemind reads that pipe non-blocking; without dtrain's whole-message reader a message
    larger than one pipe write failed half-read and killed the averager's loop.
    """
    torch.manual_seed(5)
    data = [[torch.randn(300_000)] for _ in range(2)]
    reports = [honest_report(t, 8) for t in data]
    expected = (data[0][0] + data[1][0]) / 2
    # 4 KiB parts: 293 parts x 64 float32 claims = 75 KB of claims, which go to our own averager
    # with the gather (only their tree's root goes to the group)
    swarms, recs = _run(nodes, data, _cfg(2), reports=reports, weights=[8, 8])
    for r in recs:
        assert not r.error, r.error
        assert all(p.outcome == Outcome.SUCCESS for p in r.peers)
    for d in data:
        torch.testing.assert_close(d[0], expected, rtol=0, atol=1e-6)


def test_a_peer_of_another_epoch_owns_no_share_and_sits_the_round_out(nodes):
    """A validator that lands in a later epoch's group (the group key names no epoch) must not
    reduce a share under its own epoch's rules, nor apply the others' average."""
    torch.manual_seed(5)
    data = [[torch.randn(3000)] for _ in range(3)]
    reports = [honest_report(t, 8) for t in data]
    cfg = _cfg(4)
    swarms = [GradientSwarm(nodes[i].dht, data[i], "model-a", cfg, report_type=WorkReport) for i in range(3)]
    late = [torch.full((3000,), 7.0)]
    swarms.append(GradientSwarm(nodes[3].dht, late, "model-a", cfg, report_type=WorkReport))
    stale = work_nonce("commit-test", 2)
    try:
        recs = run_concurrently([
            *[lambda i=i: swarms[i].run_round(data[i], weight=8, cap=100, work=reports[i], work_nonce=NONCE)
              for i in range(3)],
            lambda: swarms[3].run_round(late, weight=0.0, cap=0.0, work=WorkReport(epoch=2), work_nonce=stale),
        ])
    finally:
        for s in swarms:
            s.shutdown()
    mean = torch.stack([d[0] for d in data]).mean(0)
    for i, r in enumerate(recs[:3]):
        assert r.ok and r.fraction_averaged == 1.0, r
        assert r.outcome_of(swarms[3].peer_id) == Outcome.FAIL
        assert _reason(r, swarms[3].peer_id) == "work committed under another epoch's nonce"
        assert torch.allclose(data[i][0], mean, atol=1e-5)  # the three averaged among themselves
    odd = recs[3]
    assert not odd.ok and "another epoch than the group (3 of 3 peers" in odd.error
    assert torch.equal(late[0], torch.full((3000,), 7.0))  # nothing of another epoch was applied
    assert {r.epoch for pid, r in odd.work_reports.items() if pid != swarms[3].peer_id} == {3}


@pytest.mark.parametrize("alteration", [dict(scale_results=-1.0), dict(scale_results=0.5),
                                        dict(noise_results=0.05)])
def test_a_reducer_whose_results_its_account_does_not_explain_is_failed_and_not_applied(nodes, alteration):
    """An honest sender that, as a reducer, returns its share negated, halved or with noise of 5 %
    of its norm (its account stays the true combination): every receiver checks each averaged
    part against the senders' claims, records the reducer FAIL, and re-reduces that share itself
    from the senders' committed bytes (the same values on every receiver: no re-sync needed), so
    every share is the honest mean. The claims are public-seed sketches, so this catches any
    alteration that is not crafted into their null space (issue #22)."""
    torch.manual_seed(11)
    data = [[torch.randn(3000)] for _ in range(3)]
    reports = [honest_report(t, 8) for t in data]
    originals = [d[0].clone() for d in data]
    swarms, recs = _run(nodes, data, _cfg(3), reports=reports, weights=[8, 8, 8],
                        faults={2: FaultInjection(**alteration)})
    cheat = swarms[2].peer_id
    mean = (originals[0] + originals[1] + originals[2]) / 3
    for i, r in enumerate(recs[:2]):
        assert r.outcome_of(cheat) == Outcome.FAIL, r
        assert "account does not explain" in _reason(r, cheat)
        assert r.outcome_of(swarms[1 - i].peer_id) == Outcome.SUCCESS
        torch.testing.assert_close(data[i][0], mean, rtol=0, atol=1e-5)  # its share re-reduced too
        assert 0 < r.fraction_recovered < 1 and r.fraction_refused == 0
        assert r.fraction_averaged == 1.0 and r.in_step
    assert torch.equal(data[0][0], data[1][0])  # the honest receivers hold the same values


def test_a_reducer_that_leaves_a_sender_out_is_failed_by_that_sender(nodes):
    """A reducer that leaves sender 0 out of every combination and says so in its account (a
    result the claims explain): sender 0 received each reply only after the reducer took its
    part, so its own coefficient of 0 fails the reducer in its record; the other receiver sees
    a consistent mean of the others and cannot tell. Sender 0 still applies the parts: only it
    can tell, and refusing them would leave it with other values than every other receiver."""
    torch.manual_seed(13)
    data = [[torch.randn(3000)] for _ in range(3)]
    reports = [honest_report(t, 8) for t in data]
    swarms, recs = _run(nodes, data, _cfg(3), reports=reports, weights=[8, 8, 8],
                        faults={2: FaultInjection(drop_sender=str(nodes[0].dht.peer_id))})
    cheat = swarms[2].peer_id
    assert recs[0].outcome_of(cheat) == Outcome.FAIL
    assert "left our part out" in _reason(recs[0], cheat)
    assert recs[1].outcome_of(cheat) == Outcome.SUCCESS
    assert recs[0].fraction_refused == 0 and recs[0].in_step
    assert torch.equal(data[0][0], data[1][0])  # both receivers hold the same values


@pytest.mark.parametrize("aggregation", ["centered_clip", "mean"])
def test_an_honest_group_passes_every_account_check_under_both_rules(nodes, aggregation):
    """Four honest senders with unequal weights (and 8-bit parts under CenteredClip): every
    account checks out, every peer holds the same result, nobody is failed."""
    torch.manual_seed(14)
    base = torch.randn(4000)
    data = [[base + 0.5 * torch.randn(4000)] for _ in range(4)]
    reports = [honest_report(t, s) for t, s in zip(data, (4, 8, 12, 16))]
    cfg = _cfg(4, aggregation=aggregation, **({"compression": "8bit"} if aggregation == "centered_clip" else {}))
    swarms, recs = _run(nodes, data, cfg, reports=reports, weights=[4, 8, 12, 16])
    for r in recs:
        assert not r.error and r.fraction_averaged == 1.0, r.error
        assert all(p.outcome == Outcome.SUCCESS for p in r.peers), [(p.outcome, p.reason) for p in r.peers]
    assert all(torch.equal(d[0], data[0][0]) for d in data)


def test_a_refused_reducer_is_benched_by_the_group_in_the_next_rounds(nodes):
    """Three rounds of the same four swarms, one of which negates its share as a reducer: in the
    first it is refused by every receiver (which re-reduce its share); each receiver names it in
    its next gathers, so in the second round the majority benches it: it reduces no share, its
    contribution is still averaged, it is recorded FAIL, and every honest peer holds the full
    average of all four."""
    torch.manual_seed(15)
    cfg = _cfg(4)
    numel = 8192  # 8 parts of 1024 values: two for every reducer (with 3 parts, one would reduce none)
    swarms = [make_swarm(nodes[i].dht, [torch.zeros(numel)], "model-a", cfg,
                         fault=FaultInjection(scale_results=-1.0) if i == 3 else None) for i in range(4)]
    cheat = swarms[3].peer_id
    try:
        for round_no in range(2):
            data = [[torch.randn(numel)] for _ in range(4)]
            originals = [d[0].clone() for d in data]
            reports = [honest_report(t, 8) for t in data]
            recs = run_concurrently([
                lambda i=i: swarms[i].run_round(data[i], weight=8, cap=100, work=reports[i], work_nonce=NONCE)
                for i in range(4)])
            mean = sum(originals) / 4
            for i, r in enumerate(recs[:3]):
                assert r.outcome_of(cheat) == Outcome.FAIL
                assert all(r.outcome_of(s.peer_id) == Outcome.SUCCESS for s in swarms[:3])
                if round_no == 0:
                    assert "account does not explain" in _reason(r, cheat)
                    assert 0 < r.fraction_recovered < 1 and r.fraction_averaged == 1.0 and r.in_step
                    torch.testing.assert_close(data[i][0], mean, rtol=0, atol=1e-5)
                else:
                    assert "benched" in _reason(r, cheat)
                    assert r.fraction_averaged == 1.0
                    torch.testing.assert_close(data[i][0], mean, rtol=0, atol=1e-5)
    finally:
        for s in swarms:
            s.shutdown()
