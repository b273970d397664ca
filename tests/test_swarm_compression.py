"""A compressed wire: 8-bit all-reduce keeps the norm and commitment rules sound (issue #11).

``8bit`` is dtrain's blockwise codec (dtrain.swarm.codecs.BlockwiseAbsmax8Bit), whose relative
L2 error is at most ``BLOCKWISE_ERROR_BOUND`` for any input; the binding tolerance is derived
from that bound (dtrain.swarm.averaging.contribution, SKETCH_MARGIN). The unit tests measure, on the
gradient shapes a swarm sees, that honest peers stay inside every rule and that each cheat
stays outside; the slow tests run the same with real hivemind peers on loopback.
"""

from __future__ import annotations

import itertools
import math
import warnings

import pytest
import torch

from dtrain.swarm import codecs, wire
from dtrain.swarm.averaging import AveragingConfig
from dtrain.swarm.averaging.contribution import (
    BINDING_RTOL,
    PART_RTOL,
    SKETCH_MARGIN,
    Commitment,
    PartLayout,
    as_received,
    binding_error,
    binding_verdict,
    compute_claims,
    part_matches_claim,
)
from dtrain.swarm.averaging.norms import NORM_SLACK
from dtrain.swarm.averaging.norms import within_norm as _within
from dtrain.swarm.records import Outcome
from dtrain.sketch import WORK_SKETCH_K, gradient_sketch
from dtrain.training.work import PageWork, WorkReport, work_nonce

EPS = codecs.BLOCKWISE_ERROR_BOUND
RHO = BINDING_RTOL["8bit"]
NONCE = work_nonce("compression-test", 5)
# hivemind's default part size (after compression) and the small one the loopback tests use
PART_SIZES = (2**17, 4096)


# ----------------------------------------------------------------------------------------------
# the gradients a swarm sees
# ----------------------------------------------------------------------------------------------


def _tiny_lm():
    from dtrain.training.models import create_model

    return create_model("tiny", vocab_size=512, n_positions=32, seed=0)


def _lm_gradient(model, seed: int) -> list[torch.Tensor]:
    """A real per-sample mean gradient of dtrain's tiny GPT-2: embedding rows of unseen tokens are zero."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 512, (4, 32), generator=gen)
    model.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def _diloco_pseudo_gradient(model, seed: int, steps: int = 3) -> list[torch.Tensor]:
    """anchor - parameters after a few AdamW steps: the difference of two parameter snapshots."""
    params = list(model.parameters())
    anchor = [p.detach().clone() for p in params]
    opt = torch.optim.AdamW(params, lr=1e-3)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, 512, (4, 32), generator=gen)
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    pseudo = [a - p.detach() for a, p in zip(anchor, params)]
    with torch.no_grad():
        for p, a in zip(params, anchor):
            p.copy_(a)
    return pseudo


def _synthetic(kind: str, seed: int, n: int = 100_000) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen)
    if kind == "gaussian":
        return [x]
    if kind == "heavy-tailed":  # Student-t with 3 degrees of freedom: N(0,1) / sqrt(chi2_3 / 3)
        chi2 = torch.randn(3, n, generator=gen).pow(2).sum(0) / 3
        return [x / chi2.sqrt()]
    if kind == "outliers":  # 0.1 % of the values 50x larger
        idx = torch.randint(0, n, (n // 1000,), generator=gen)
        x[idx] *= 50
        return [x]
    if kind == "sparse":  # 99 % exact zeros
        x[torch.rand(n, generator=gen) > 0.01] = 0
        return [x]
    if kind == "tiny":  # below float16's smallest subnormal, and squares below float32's range
        return [x * 1e-25]
    if kind == "mixed-scale":  # tensors of very different scales, and rows spanning 4 decades in one tensor
        rows = torch.randn(512, 128, generator=gen) * 10 ** (torch.rand(512, 1, generator=gen) * 4 - 3)
        return [x[:40_000] * 1e-4, rows, x[40_000:90_000] * 100, x[90_000:90_300] * 1e-2]
    raise KeyError(kind)


SYNTHETIC = ("gaussian", "heavy-tailed", "outliers", "sparse", "tiny", "mixed-scale")


@pytest.fixture(scope="module")
def distributions() -> dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """kind -> (a contribution, an older contribution of the same kind: what a replayer sends)."""
    out = {kind: (_synthetic(kind, 1), _synthetic(kind, 2)) for kind in SYNTHETIC}
    torch.manual_seed(0)
    model = _tiny_lm()
    out["lm-gradient"] = (_lm_gradient(model, 1), _lm_gradient(model, 2))
    out["diloco-pseudo-gradient"] = (_diloco_pseudo_gradient(model, 1), _diloco_pseudo_gradient(model, 2))
    return out


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1).double() for t in tensors])


def _report(tensors, samples: int = 8, nonce: str = NONCE) -> WorkReport:
    """An honest report: two pages whose sketches add up to ``samples`` x the contribution."""
    total = gradient_sketch([t * samples for t in tensors], nonce, k=WORK_SKETCH_K).tolist()
    first = [0.3 * v for v in total]
    rest = [v - f for v, f in zip(total, first)]
    return WorkReport(epoch=5, pages=(PageWork(page=1, counter=0, samples=3, loss=5.0, sketch=tuple(first)),
                                      PageWork(page=2, counter=1, samples=samples - 3, loss=5.0, sketch=tuple(rest))))


def _decoded(tensors, compression, part_size: int) -> list[torch.Tensor]:
    """What receivers decode of ``tensors``, part by part, as hivemind sends them."""
    layout = PartLayout.of(tensors, compression, part_size)
    out = [torch.empty(t.numel()) for t in tensors]
    for i, start, length in layout.parts:
        out[i][start:start + length] = as_received(tensors[i].reshape(-1)[start:start + length], compression)
    return [o.reshape(t.shape) for o, t in zip(out, tensors)]


def _binding(sent, report, compression, part_size: int, nonce: str = NONCE):
    """(binding error, the parsed commitment, the layout, the claims it commits to)."""
    layout = PartLayout.of(sent, compression, part_size)
    claims = compute_claims(sent, layout, nonce, compression)
    commitment = Commitment.parse(Commitment.of_claims(nonce, report, claims).to_gather(), type(report))
    return binding_error(commitment), commitment, layout, claims


def _cheats(true, old) -> dict[str, list[torch.Tensor]]:
    """What each cheat sends instead of ``true`` while committing ``true``'s report (dtrain.sandbox.adversary)."""
    flat = _flat(true)
    sigma = 0.5 * float(flat.norm()) / math.sqrt(flat.numel())
    gen = torch.Generator().manual_seed(9)
    return {"negated": [-t for t in true], "zeroed": [t * 0 for t in true], "rescaled x2": [t * 2 for t in true],
            "rescaled x0.5": [t * 0.5 for t in true],
            "noise": [t + sigma * torch.randn(t.shape, generator=gen) for t in true], "replayed": old}


# ----------------------------------------------------------------------------------------------
# the codec
# ----------------------------------------------------------------------------------------------


def test_eight_bit_means_the_blockwise_codec_and_its_bound_holds_for_any_input(distributions):
    comp = wire.make_compression("8bit")
    assert comp.codec is codecs.BlockwiseAbsmax8Bit
    assert wire.make_compression("int8") is comp
    worst = torch.full((codecs.BLOCK,), 1 / 254 + 1e-7)  # one element at absmax, the rest just past half a step
    worst[0] = 1.0
    cases = {k: v[0] for k, v in distributions.items()}
    cases.update(worst=[worst], zeros=[torch.zeros(1000)], constant=[torch.full((777,), -3.0)],
                 huge=[torch.randn(5000) * 1e30], scalar=[torch.tensor(2.5)], odd=[torch.randn(3, 67)])
    for kind, tensors in cases.items():
        for t in tensors:
            got = as_received(t, comp)
            assert got.shape == t.shape and got.dtype == t.dtype, kind
            err = float((got.double() - t.double()).norm())
            assert err <= EPS * float(t.double().norm()) * (1 + 1e-5) + 1e-30, (kind, err / float(t.double().norm()))
    # the bound is tight: the worst block reaches it
    got = as_received(worst, comp)
    assert float((got - worst).norm() / worst.norm()) > 0.99 * EPS


def test_wire_bytes_are_a_quarter_plus_one_scale_per_block():
    from hivemind.compression import serialize_torch_tensor

    x = torch.randn(100_000)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # hivemind's uniform codec uses a deprecated torch quantizer
        sizes = {name: len(serialize_torch_tensor(x, wire.make_compression(name).compression_type).buffer)
                 for name in ("none", "fp16", "8bit", "8bit-uniform", "8bit-quantile")}
    assert sizes["none"] == 4 * x.numel() and sizes["fp16"] == 2 * x.numel()
    assert sizes["8bit"] == x.numel() + 4 * math.ceil(x.numel() / codecs.BLOCK)  # 0.266 of fp32
    assert sizes["8bit-uniform"] == sizes["8bit-quantile"] == x.numel() + 8 + 4 * 256


def test_a_malformed_or_nonfinite_blockwise_part_never_decodes_to_finite_garbage():
    from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor

    comp = wire.make_compression("8bit")
    msg = serialize_torch_tensor(torch.randn(300), comp.compression_type)
    msg.buffer = msg.buffer[:-1]
    with pytest.raises(ValueError, match="must be"):
        deserialize_torch_tensor(msg)
    bad = torch.randn(300)
    bad[::7] = float("nan")
    bad[1] = float("inf")
    # the reducer's finiteness check then bans the sender, as without compression
    assert not bool(torch.isfinite(as_received(bad, comp)).all())


def test_single_codebook_8bit_codecs_have_no_bound(distributions):
    """Why ``8bit`` is not hivemind's uniform or quantile codec: one codebook per part loses
    most of an outlier-heavy or sparse gradient, so honest peers would fail the binding check."""
    for name in ("8bit-uniform", "8bit-quantile"):
        comp = wire.make_compression(name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for kind in ("outliers", "sparse"):
                x = distributions[kind][0]
                err = float((_flat(_decoded(x, comp, 2**17)) - _flat(x)).norm() / _flat(x).norm())
                assert err > 10 * EPS, (name, kind, err)
                assert err > RHO  # such an honest peer would be excluded


def test_fp16_loses_tiny_gradients():
    """Why fp16 keeps its measured tolerance and is not advised for small gradients: a plain
    half-precision cast flushes values below 6e-8 to zero."""
    comp = wire.make_compression("fp16")
    x = torch.randn(10_000) * 1e-9
    assert float(as_received(x, comp).abs().max()) == 0.0


# ----------------------------------------------------------------------------------------------
# the rules, with the measured margins
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("part_size", PART_SIZES)
def test_honest_eight_bit_contributions_pass_every_rule(distributions, part_size):
    comp = wire.make_compression("8bit")
    worst_binding = {}
    for kind, (x, _) in distributions.items():
        announced = float(_flat(x).norm())
        decoded = _decoded(x, comp, part_size)
        # the epoch's nonce draws the sketch: several epochs exercise the sketch's randomness
        for epoch in range(2):
            nonce = work_nonce("compression-test", epoch)
            err, commitment, layout, claims = _binding(x, _report(x, nonce=nonce), comp, part_size, nonce)
            worst_binding[kind] = max(worst_binding.get(kind, 0.0), err)
            assert binding_verdict(commitment, weight=8, nonce=nonce, compression="8bit") == "", (kind, err)
            # every part a reducer receives matches its claim and stays within the announced norm
            for g, (i, start, length) in enumerate(layout.parts):
                part = decoded[i].reshape(-1)[start:start + length]
                assert part_matches_claim(part, claims[g], i, start, nonce), (kind, g)
                assert _within(float(part.double().norm()), announced), kind
    # the rule's premise, measured: an honest binding error stays below the codec bound, so far
    # (SKETCH_MARGIN x) inside the tolerance
    assert max(worst_binding.values()) < EPS, worst_binding


def test_every_cheat_fails_the_eight_bit_binding(distributions):
    comp = wire.make_compression("8bit")
    smallest = {}
    for kind, (x, old) in distributions.items():
        report = _report(x)
        for cheat, sent in _cheats(x, old).items():
            err, commitment, _, _ = _binding(sent, report, comp, 2**17)
            smallest[cheat] = min(smallest.get(cheat, math.inf), err)
            assert "does not match its committed pages" in binding_verdict(
                commitment, weight=8, nonce=NONCE, compression="8bit"), (kind, cheat, err)
        # an inflated weight is refused whatever the wire
        honest = _binding(x, report, comp, 2**17)[1]
        assert "committed 8 samples" in binding_verdict(honest, weight=1e6, nonce=NONCE, compression="8bit")
    # the rule's other side, measured: the mildest cheats deviate by 0.5, SKETCH_MARGIN x the tolerance
    assert min(smallest.values()) > 2 * RHO, smallest


def test_a_lying_claim_is_refused_part_by_part_under_eight_bit(distributions):
    comp = wire.make_compression("8bit")
    x = distributions["lm-gradient"][0]
    _, _, layout, claims = _binding(x, _report(x), comp, 4096)
    decoded = _decoded(x, comp, 4096)
    for g, (i, start, length) in enumerate(layout.parts[:40]):
        part = decoded[i].reshape(-1)[start:start + length]
        if float(part.norm()) == 0:
            continue  # an all-zero part (unseen embedding rows) looks the same negated
        for altered in (-part, 0.5 * part, as_received(part * 1.01, comp)):
            assert not part_matches_claim(altered, claims[g], i, start, NONCE)
    assert PART_RTOL < 1e-3


def test_the_averaged_result_stays_within_the_norm_bound_and_the_error_bound(distributions):
    """A reducer averages decoded parts and every peer keeps the decoded average: twice the codec."""
    comp = wire.make_compression("8bit")
    for kind, (x, old) in distributions.items():
        peers = [x, old, [t * 0.7 for t in old]]
        exact = [torch.stack(ts).mean(0) for ts in zip(*peers)]
        layout = PartLayout.of(x, comp, 4096)
        largest = max(float(_flat(p).norm()) for p in peers)
        result = [torch.empty(t.numel()) for t in x]
        for g, (i, start, length) in enumerate(layout.parts):
            owner = g % len(peers)  # the reducer's own part goes in exact, the others decoded
            parts = [p[i].reshape(-1)[start:start + length] for p in peers]
            got = [q if k == owner else as_received(q, comp) for k, q in enumerate(parts)]
            averaged = as_received(torch.stack(got).mean(0), comp)
            assert _within(float(averaged.double().norm()), largest), kind
            result[i][start:start + length] = averaged
        err = float((_flat(result) - _flat(exact)).norm())
        bound = EPS * float(_flat(exact).norm()) + (1 + EPS) * EPS * sum(float(_flat(p).norm()) for p in peers) / 3
        assert err <= bound, (kind, err, bound)
    # the norm slack covers two passes of the codec: (1 + eps)^2 < NORM_SLACK
    assert (1 + EPS) ** 2 < NORM_SLACK


def test_tolerances_follow_the_documented_rule():
    assert RHO == pytest.approx(SKETCH_MARGIN * EPS)
    assert SKETCH_MARGIN * RHO <= 0.5  # the mildest sandbox cheat is caught with the same margin
    assert BINDING_RTOL["none"] < BINDING_RTOL["fp16"] < RHO


# ----------------------------------------------------------------------------------------------
# real hivemind peers on loopback
# ----------------------------------------------------------------------------------------------

_prefix = itertools.count()


@pytest.fixture(scope="module")
def nodes():
    from dtrain.swarm.loopback import local_nodes

    # The state in which a forked averager's codec threads used to race (tests/
    # test_swarm_fork_threads.py): a thread count set in the parent, as a full test run does.
    torch.set_num_threads(torch.get_num_threads())

    with local_nodes(4) as started:
        yield started


def _cfg(group: int, **kw) -> AveragingConfig:
    from tests.swarm_checks import loopback_config

    # the result is checked against the exact mean (within the codec's bound): ask for the mean
    return loopback_config(f"z{next(_prefix)}", group, **{"require_commitments": True, "compression": "8bit",
                                                          "aggregation": "mean", **kw})


def _same_norm(tensors, norm: float = 10.0) -> list[torch.Tensor]:
    scale = norm / float(_flat(tensors).norm())
    return [t * scale for t in tensors]


def _round(nodes, contributions, *, sent=None, weights=None, faults=None, reports=None):
    """One round of real peers sending ``sent`` (default: their contributions), each from a fresh
    copy (a round whose matchmaking missed a peer is run again: tests.swarm_checks)."""
    from tests.swarm_checks import retry_matchmaking_miss

    base = sent or contributions
    return retry_matchmaking_miss(lambda: _round_once(nodes, contributions, [[t.clone() for t in c] for c in base],
                                                      weights=weights, faults=faults, reports=reports))


def _round_once(nodes, contributions, sent, *, weights=None, faults=None, reports=None):
    from dtrain.swarm.loopback import run_concurrently
    from tests.faults import swarm as make_swarm

    cfg = _cfg(len(contributions))
    reports = reports or [_report(c) for c in contributions]
    weights = weights or [8] * len(contributions)
    swarms = [make_swarm(nodes[i].dht, contributions[i], "model-a", cfg, fault=(faults or {}).get(i))
              for i in range(len(contributions))]
    try:
        recs = run_concurrently([
            lambda i=i: swarms[i].run_round(sent[i], weight=weights[i], cap=100, work=reports[i], work_nonce=NONCE)
            for i in range(len(contributions))], timeout_s=240)
    finally:
        for s in swarms:
            s.shutdown()
    return swarms, sent, recs


@pytest.mark.slow
def test_honest_peers_with_unlike_gradients_all_succeed_over_an_eight_bit_wire(nodes, distributions):
    # one tensor schema for all: a flat vector per peer, each of another distribution, equal norms;
    # the LM slice spans the end of the (row-sparse) token embedding, the positions and a block
    kinds = ("heavy-tailed", "outliers", "sparse", "lm-gradient")
    contributions = [[_same_norm([_flat(distributions[k][0])[40_000:100_000].float()])[0]] for k in kinds]
    originals = [c[0].clone() for c in contributions]
    swarms, sent, recs = _round(nodes, contributions)
    for r in recs:
        assert not r.error, r.error
        assert all(p.outcome == Outcome.SUCCESS for p in r.peers), [(p.outcome, p.reason) for p in r.peers]
        # every element of every peer was averaged (tests.swarm_checks' "changed" test does not
        # apply: 8-bit rounds the small averages of sparse blocks to the zeros they started from)
        assert r.fraction_averaged == 1.0
    exact = torch.stack(originals).mean(0).double()
    got = sent[0][0].double()
    bound = EPS * float(exact.norm()) + (1 + EPS) * EPS * sum(float(o.double().norm()) for o in originals) / 4
    assert float((got - exact).norm()) <= bound
    for s in sent[1:]:
        assert torch.equal(s[0], sent[0][0])  # bit-identical on every peer


@pytest.mark.slow
@pytest.mark.parametrize("cheats", [("negated", "zeroed"), ("rescaled x2", "rescaled x0.5"), ("noise", "replayed")])
def test_each_cheat_is_refused_over_an_eight_bit_wire(nodes, distributions, cheats):
    x, old = distributions["lm-gradient"]
    base = _same_norm([_flat(x).float()])[0]
    other = _same_norm([_flat(old).float()])[0]
    gen = torch.Generator().manual_seed(3)
    # four miners' gradients of one model: a shared direction plus each one's batch noise
    contributions = [[base + 0.5 * torch.randn(base.shape, generator=gen) * float(base.norm()) / base.numel() ** 0.5]
                     for _ in range(4)]
    # peers 2 and 3 commit their true work and send something else (a replayer: an older gradient)
    sent = [[contributions[0][0].clone()], [contributions[1][0].clone()],
            [_cheats(contributions[2], [other])[cheats[0]][0].clone()],
            [_cheats(contributions[3], [other])[cheats[1]][0].clone()]]
    honest_mean = (contributions[0][0] + contributions[1][0]) / 2
    swarms, sent, recs = _round(nodes, contributions, sent=sent)
    for r in recs[:2]:
        assert not r.error, r.error
        for k in (0, 1):
            assert r.outcome_of(swarms[k].peer_id) == Outcome.SUCCESS
        for k in (2, 3):
            assert r.outcome_of(swarms[k].peer_id) == Outcome.FAIL
            reason = next(p.reason for p in r.peers if p.peer_id == swarms[k].peer_id)
            assert "does not match its committed pages" in reason, (cheats, reason)
    got = sent[0][0].double()
    mean_norm = float(contributions[0][0].norm() + contributions[1][0].norm()) / 2
    bound = EPS * float(honest_mean.norm()) + (1 + EPS) * EPS * mean_norm
    assert float((got - honest_mean.double()).norm()) <= bound
    assert torch.equal(sent[0][0], sent[1][0])


@pytest.mark.slow
def test_lying_claims_and_an_inflated_weight_are_refused_over_an_eight_bit_wire(nodes, distributions):
    from tests.faults import FaultInjection

    x = _same_norm([_flat(distributions["diloco-pseudo-gradient"][0]).float()])[0]
    gen = torch.Generator().manual_seed(4)
    contributions = [[x + 0.5 * torch.randn(x.shape, generator=gen) * float(x.norm()) / x.numel() ** 0.5]
                     for _ in range(4)]
    # peer 2 commits honest claims but negates its parts on the wire; peer 3 claims 16 samples for 8
    swarms, sent, recs = _round(nodes, contributions, weights=[8, 8, 8, 16],
                                faults={2: FaultInjection(scale_parts=-1.0)})
    for r in recs[:2]:
        assert r.outcome_of(swarms[0].peer_id) == r.outcome_of(swarms[1].peer_id) == Outcome.SUCCESS
        assert r.outcome_of(swarms[2].peer_id) == Outcome.FAIL
        assert "contradicts its commitment" in next(p.reason for p in r.peers if p.peer_id == swarms[2].peer_id)
        assert "claims weight 16 but committed 8 samples" in next(
            p.reason for p in r.peers if p.peer_id == swarms[3].peer_id)
    # the refused sender hears it from each reducer's end of the stream, not from its own
    # reducer timeout (a reducer no longer lingers on a stream it has stopped serving)
    told = [p.reason for p in recs[2].peers if p.outcome == Outcome.FAIL and p.peer_id != swarms[3].peer_id]
    assert len(told) == 2 and not any("Timeout" in reason for reason in told), told
