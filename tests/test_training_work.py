"""Work reports, range sketches, part layouts, contribution binding, CenteredClip and replica distances."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dtrain.swarm.averaging.contribution import (
    BINDING_RTOL, Commitment, CommitmentError, PartLayout, binding_error, binding_verdict, compute_claims, part_matches_claim,
)
from dtrain.swarm.averaging.centered_clip import centered_clip, weighted_mean
from dtrain.sketch import gradient_sketch, range_sketch
from dtrain.training.replica import (
    REPLICA_RTOL, params_distance, params_rms, params_sketch, sketch_distance, slice_distance, within_tolerance,
)
from dtrain.sketch import WORK_SKETCH_K
from dtrain.training.work import PageWork, WorkLog, WorkReport, WorkReportError, work_nonce

NONCE = work_nonce("unit", 7)


def _tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1000, generator=g), torch.randn(7, 13, generator=g), torch.randn(5, generator=g)]


def test_range_sketches_of_the_pieces_add_up_to_the_whole():
    ts = _tensors()
    whole = gradient_sketch(ts, NONCE, k=WORK_SKETCH_K)
    total = torch.zeros(WORK_SKETCH_K, dtype=torch.float64)
    for i, t in enumerate(ts):
        flat = t.reshape(-1)
        for start in range(0, flat.numel(), 97):
            total += range_sketch(flat[start:start + 97], i, start, NONCE, k=WORK_SKETCH_K)
    torch.testing.assert_close(total, whole, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("compression", ["none", "fp16", "8bit"])
def test_part_layout_is_hiveminds(compression):
    """The parts dtrain claims about are exactly the ones hivemind's container sends."""
    from hivemind.averaging.partition import TensorPartContainer

    from dtrain.swarm import wire

    ts = _tensors() + [torch.randn(3000)]
    comp = wire.make_compression(compression)
    layout = PartLayout.of(ts, comp, part_size_bytes=1024)
    container = TensorPartContainer(ts, peer_fractions=(0.5, 0.3, 0.2), compression=comp, part_size_bytes=1024)
    theirs = [part for peer in range(3) for part in container.get_raw_input_parts(peer)]
    assert len(theirs) == len(layout)
    for (i, start, length), part in zip(layout.parts, theirs):
        assert torch.equal(ts[i].reshape(-1)[start:start + length], part)


def test_part_layout_splits_the_parts_among_reducers_as_hiveminds_container():
    """The shares dtrain's checks read (PartLayout.split) are the ones hivemind's container hands
    each reducer, for load-balanced fractions of every shape: skewed, zero (clients), one peer."""
    import random

    from hivemind.averaging.partition import TensorPartContainer

    from dtrain.swarm import wire

    rng = random.Random(5)
    comp = wire.make_compression("8bit")
    for trial in range(200):
        ts = [torch.zeros(rng.randint(1, 9000)) for _ in range(rng.randint(1, 4))]
        fractions = [rng.choice([0, 0, rng.randint(1, 5000)]) for _ in range(rng.randint(1, 9))]
        if not any(fractions):
            fractions[rng.randrange(len(fractions))] = 1
        size = rng.choice([256, 1024, 4096])
        layout = PartLayout.of(ts, comp, part_size_bytes=size)
        container = TensorPartContainer(ts, peer_fractions=fractions, compression=comp, part_size_bytes=size)
        assert layout.split(fractions) == tuple(container.num_parts_by_peer), (trial, fractions)


def _report_for(tensors, samples=8, epoch=7):
    sketch = gradient_sketch([t * samples for t in tensors], NONCE, k=WORK_SKETCH_K).tolist()
    return WorkReport(epoch=epoch, pages=(PageWork(page=3, counter=0, samples=samples, loss=4.0, sketch=tuple(sketch)),))


def _commitment(sent, report, compression="none"):
    from dtrain.swarm import wire

    comp = wire.make_compression(compression)
    layout = PartLayout.of(sent, comp, 512)
    claims = compute_claims(sent, layout, NONCE, comp)
    return Commitment.parse(Commitment.of_claims(NONCE, report, claims).to_gather(), type(report)), layout, claims


def test_binding_accepts_the_mean_of_the_pages_and_rejects_everything_else():
    ts = _tensors(1)
    report = _report_for(ts)
    good, _, _ = _commitment(ts, report)
    assert binding_error(good) < 1e-6 and binding_verdict(good, weight=8, nonce=NONCE, compression="none") == ""
    noise = [0.05 * t.norm() / math.sqrt(t.numel()) * torch.randn_like(t) for t in ts]
    for name, sent in {"negated": [-t for t in ts], "zero": [t * 0 for t in ts], "rescaled": [1.5 * t for t in ts],
                       "noisy": [t + n for t, n in zip(ts, noise)], "replayed": _tensors(2)}.items():
        bad, _, _ = _commitment(sent, report)
        assert "does not match its committed pages" in binding_verdict(bad, weight=8, nonce=NONCE,
                                                                       compression="none"), name
    assert "committed 8 samples" in binding_verdict(good, weight=9, nonce=NONCE, compression="none")
    assert "another epoch" in binding_verdict(good, weight=8, nonce=work_nonce("unit", 6), compression="none")
    assert binding_verdict(None, weight=8, nonce=NONCE, compression="none") == "no work commitment"


@pytest.mark.parametrize("compression", ["fp16", "8bit"])
def test_binding_tolerates_wire_compression(compression):
    ts = [t * 1e-3 for t in _tensors(3)]  # gradient-sized values
    report = _report_for(ts)
    sent, _, _ = _commitment(ts, report, compression)
    assert binding_error(sent) <= BINDING_RTOL[compression] / 3
    flipped, _, _ = _commitment([-t for t in ts], report, compression)
    assert binding_error(flipped) > 1.0


def test_a_part_must_match_its_claim():
    ts = _tensors(4)
    c, layout, claims = _commitment(ts, _report_for(ts))
    for g, (i, start, length) in enumerate(layout.parts):
        piece = ts[i].reshape(-1)[start:start + length]
        assert part_matches_claim(piece, claims[g], i, start, NONCE)
        assert not part_matches_claim(-piece, claims[g], i, start, NONCE)
        assert not part_matches_claim(piece * 1.01, claims[g], i, start, NONCE)


def test_the_commitment_is_the_claims_trees_root_and_proves_any_share():
    """The gather carries 32 + 8k bytes whatever the number of parts; every contiguous share of
    parts is proven against it, and the proof of a share is refused for any other claims."""
    from dtrain.swarm.averaging.claims_tree import ClaimsProofError, ClaimsTree, proof_bytes

    ts = _tensors(4)
    c, layout, claims = _commitment(ts, _report_for(ts))
    n = len(layout)
    assert n > 8 and len(c.root) == 32 and c.total.shape == (WORK_SKETCH_K,)
    assert np.allclose(c.total, claims.astype(np.float64).sum(axis=0), rtol=1e-12, atol=1e-12)
    tree = ClaimsTree(claims)
    for first, end in [(0, n), (0, 1), (n - 1, n), (1, n - 2), (3, 4), (2, 7)]:
        proof = tree.range_proof(first, end)
        assert len(proof) == proof_bytes(first, end, n, WORK_SKETCH_K)
        assert np.array_equal(c.share_claims(proof, first=first, end=end, num_parts=n), claims[first:end])
        with pytest.raises(ClaimsProofError):  # the same proof for another share
            c.share_claims(proof, first=first + 1, end=end + 1, num_parts=n + 1)
    # claims that differ anywhere (a negated part, the parts in another order, a part moved)
    # hash to another root: a reducer refuses them, whichever share it holds
    for other in (claims * np.where(np.arange(n) == 3, -1, 1)[:, None].astype("<f4"), claims[::-1].copy(),
                  np.roll(claims, 1, axis=0)):
        forged = ClaimsTree(other)
        for first, end in [(0, n), (3, 5)]:
            if np.array_equal(other[first:end], claims[first:end]) and (first, end) != (0, n):
                continue
            with pytest.raises(ClaimsProofError, match="committed root"):
                c.share_claims(forged.range_proof(first, end), first=first, end=end, num_parts=n)
    # a proof of the wrong size, or with non-finite values, names the problem
    with pytest.raises(ClaimsProofError, match="bytes, expected"):
        c.share_claims(tree.range_proof(0, 2)[:-1], first=0, end=2, num_parts=n)
    bad = bytearray(tree.range_proof(0, 2))
    bad[:4] = np.array([np.nan], "<f4").tobytes()
    with pytest.raises(ClaimsProofError, match="non-finite"):
        c.share_claims(bytes(bad), first=0, end=2, num_parts=n)


def test_malformed_commitments_name_the_problem():
    ts = _tensors()
    good, layout, _ = _commitment(ts, _report_for(ts))
    wire = good.to_gather()
    with pytest.raises(CommitmentError, match="claims root must be 32 bytes"):
        Commitment.parse({**wire, "root": b"\0" * 12}, WorkReport)
    with pytest.raises(CommitmentError, match="claims total must be"):
        Commitment.parse({**wire, "total": b"\0" * 12}, WorkReport)
    with pytest.raises(CommitmentError, match="non-finite"):
        Commitment.parse({**wire, "total": np.full(WORK_SKETCH_K, np.nan, "<f8").tobytes()}, WorkReport)
    work = wire["work"]
    for broken, match in [({"e": 1}, "page list"), ({"e": 1, "p": [[1, 0, 0, 1.0, b""]]}, "samples >= 1"),
                          ({"e": 1, "p": [[1, 0, 1, float("nan"), b""]]}, "finite"),
                          ({"e": 1, "p": [[1, 0, 1, 1.0, b"x"]]}, "bytes"),
                          ({"e": 1, "p": [work["p"][0], work["p"][0]]}, "strictly increasing")]:
        with pytest.raises(WorkReportError, match=match):
            WorkReport.from_wire(broken)


def test_work_report_round_trips():
    ts = _tensors()
    report = _report_for(ts)
    assert WorkReport.from_wire(report.to_wire()) == report


def test_work_log_page_sketches_sum_to_the_accumulated_gradient():
    from dtrain.training.models import create_model
    from dtrain.training.trainer import Trainer, TrainerConfig
    from dtrain.training.work_audit import recompute_page_work

    model = create_model("tiny", vocab_size=300, n_positions=16, seed=0)
    trainer = Trainer(model, TrainerConfig(micro_batch_size=2, local_batch_size=8))
    log = WorkLog("unit")
    log.reset(7)
    gen = torch.Generator().manual_seed(0)
    pages = [torch.randint(0, 300, (4, 16), generator=gen) for _ in range(3)]
    for i, tokens in enumerate(pages):
        results = trainer.accumulate(tokens)
        log.record(page=100 + i, counter=i, samples=4, loss=results[0].loss, gradients=trainer.gradients())
    report = log.report()
    assert report.samples == 12 and [p.counter for p in report.pages] == [0, 1, 2]
    mean = [g / 12 for g in trainer.gradients()]
    got, want = torch.tensor(report.mean_sketch(), dtype=torch.float64), gradient_sketch(mean, NONCE, k=WORK_SKETCH_K)
    assert float((got - want).norm() / want.norm()) < 1e-5  # float32 rounding of the division, far inside 1e-4
    # the validator's recomputation of page 1 alone gives the sketch the log kept for it
    ref = recompute_page_work(trainer.model, pages[1], nonce=NONCE, micro_batch_size=2, k=WORK_SKETCH_K)
    a, b = torch.tensor(ref.sketch), torch.tensor(report.pages[1].sketch)
    assert float(a @ b / (a.norm() * b.norm())) > 0.9999 and abs(float(a.norm() / b.norm()) - 1) < 1e-4


def test_centered_clip():
    torch.manual_seed(0)
    g = torch.randn(500)
    honest = [g + 0.2 * torch.randn(500) for _ in range(3)]
    mean = weighted_mean(honest, [1, 1, 1])
    # identical contributions come back unchanged; honest ones stay close to their mean
    torch.testing.assert_close(centered_clip([g, g, g], [1, 2, 3]), g)
    assert float((centered_clip(honest, [1, 1, 1]) - mean).norm()) < 0.1 * float(mean.norm())
    for scale in (1, 3, 10, 1000):
        attacked = centered_clip(honest + [-scale * g], [1, 1, 1, 1])
        assert float(attacked @ mean) / float(mean.norm() ** 2) > 0.6, scale
        assert float((attacked - mean).norm()) < 0.5 * float(mean.norm()), scale
    # two senders: no majority to clip against, the weighted mean
    torch.testing.assert_close(centered_clip(honest[:2], [1, 3]), weighted_mean(honest[:2], [1, 3]))
    # zero weights (only validators): plain mean; a zero-weight sender never counts otherwise
    torch.testing.assert_close(centered_clip([g, 3 * g], [0, 0]), 2 * g)
    torch.testing.assert_close(centered_clip(honest + [1e6 * g], [1, 1, 1, 0]), centered_clip(honest, [1, 1, 1]))


def test_replica_distances():
    ts = _tensors()
    drifted = [t * (1 + 1e-8) for t in ts]
    moved = [t + 1e-3 * t.norm() / math.sqrt(t.numel()) * torch.randn_like(t) for t in ts]
    assert params_distance(drifted, ts) < REPLICA_RTOL < params_distance(moved, ts)
    assert within_tolerance(sketch_distance(params_sketch(drifted), params_sketch(ts)))
    assert not within_tolerance(sketch_distance(params_sketch(moved), params_sketch(ts)))
    assert sketch_distance((1.0,), (1.0, 2.0)) == math.inf
    flat = torch.cat([t.reshape(-1) for t in ts])
    a = flat[:200].numpy().astype("<f4").tobytes()
    b = (flat[:200] * (1 + 1e-7)).numpy().astype("<f4").tobytes()
    assert within_tolerance(slice_distance(b, a, params_rms(ts)))
    assert not within_tolerance(slice_distance(a[:-4] + b"\0\0\0\0", a, params_rms(ts)))  # one value lost
    assert slice_distance(a, a[:-4], 1.0) == math.inf
