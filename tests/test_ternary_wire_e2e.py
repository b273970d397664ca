"""The ternary wire between real hivemind peers on loopback: both legs of the butterfly in
ternary, every check on the decoded values, one set of bits on every peer; and a peer on another
codec refused at group formation, naming both codecs."""

from __future__ import annotations

import itertools

import pytest
import torch

from dtrain.sketch import WORK_SKETCH_K, gradient_sketch
from dtrain.swarm.codecs import wire_format
from dtrain.swarm.records import Outcome
from dtrain.swarm.ternary import BLOCK, packed_size
from dtrain.training.work import PageWork, WorkReport, work_nonce

NONCE = work_nonce("ternary-wire", 3)
_prefix = itertools.count()
SIZE = 40_000


@pytest.fixture(scope="module")
def nodes():
    from dtrain.swarm.loopback import local_nodes

    with local_nodes(4) as started:
        yield started


def _report(tensors, samples: int = 8) -> WorkReport:
    total = gradient_sketch([t * samples for t in tensors], NONCE, k=WORK_SKETCH_K).tolist()
    return WorkReport(epoch=3, pages=(PageWork(page=1, counter=0, samples=samples, loss=5.0, sketch=tuple(total)),))


def _contributions(n: int) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(11)
    shared = torch.randn(SIZE, generator=gen)
    return [[shared + 0.5 * torch.randn(SIZE, generator=gen)] for _ in range(n)]


def _round(nodes, contributions, wires, *, faults=None):
    from tests.swarm_checks import retry_matchmaking_miss

    return retry_matchmaking_miss(lambda: _round_once(nodes, contributions, wires, faults=faults))


def _round_once(nodes, contributions, wires, *, faults=None):
    from dtrain.swarm.loopback import run_concurrently
    from tests.faults import swarm as make_swarm
    from tests.swarm_checks import loopback_config

    prefix = f"t{next(_prefix)}"
    sent = [[t.clone() for t in c] for c in contributions]
    swarms = [make_swarm(nodes[i].dht, contributions[i], "model-a",
                         loopback_config(prefix, len(contributions), require_commitments=True, compression=wires[i],
                                         aggregation="mean", part_size_bytes=2048),
                         fault=(faults or {}).get(i))
              for i in range(len(contributions))]
    try:
        recs = run_concurrently([
            lambda i=i: swarms[i].run_round(sent[i], weight=8, cap=100, work=_report(contributions[i]),
                                            work_nonce=NONCE)
            for i in range(len(contributions))], timeout_s=240)
    finally:
        for s in swarms:
            s.shutdown()
    return swarms, sent, recs


@pytest.mark.slow
def test_four_peers_average_over_the_ternary_wire_on_both_legs_with_every_check_on(nodes):
    contributions = _contributions(4)
    exact = torch.stack([c[0] for c in contributions]).double().mean(0)
    swarms, sent, recs = _round(nodes, contributions, ["ternary"] * 4)
    for r in recs:
        assert not r.error, r.error
        assert all(p.outcome == Outcome.SUCCESS for p in r.peers), [(p.outcome, p.reason) for p in r.peers]
        assert r.fraction_averaged == 1.0
    for s in sent[1:]:
        assert torch.equal(s[0], sent[0][0])  # one set of bits on every peer
    got = sent[0][0].double()
    # the result is ternary: one magnitude (or 0) per block of each part (blocks start with a part)
    from dtrain.swarm.averaging.contribution import PartLayout
    from dtrain.swarm.wire import make_compression

    layout = PartLayout.of(contributions[0], make_compression("ternary"), 2048)
    assert len(layout) > 4
    for _, start, length in layout.parts:
        blocks = torch.nn.functional.pad(got[start:start + length], (0, (-length) % BLOCK)).abs().view(-1, BLOCK)
        assert all(len(set(b[b > 0].tolist())) <= 1 for b in blocks)
    # each leg a projection (relative error ~0.43 on these values): the average keeps the direction
    rel = float((got - exact).norm() / exact.norm())
    cosine = float(got @ exact / (got.norm() * exact.norm()))
    assert rel < 0.75 and cosine > 0.75, (rel, cosine)
    # what each peer moved: the parts it sent and the averaged parts it returned, at 1.85 bits a
    # value plus the claims heads, against 32 bits a value in fp32
    fp32 = 2 * 4 * SIZE * 3 / 4
    for r in recs:
        assert r.bytes_sent < 0.2 * fp32, (r.bytes_sent, fp32)
    assert packed_size(SIZE) * 8 / SIZE < 1.9


@pytest.mark.slow
def test_a_peer_on_the_eight_bit_wire_is_refused_by_name_and_the_others_average(nodes):
    contributions = _contributions(4)
    swarms, sent, recs = _round(nodes, contributions, ["ternary", "ternary", "ternary", "8bit"])
    odd = swarms[3].peer_id
    for r in recs[:3]:
        assert not r.error, r.error
        assert r.outcome_of(odd) == Outcome.WRONG_MODEL
        reason = next(p.reason for p in r.peers if p.peer_id == odd)
        assert wire_format("8bit") in reason and wire_format("ternary") in reason, reason
        assert all(p.outcome == Outcome.SUCCESS for p in r.peers if p.peer_id != odd)
    assert torch.equal(sent[0][0], sent[1][0]) and torch.equal(sent[0][0], sent[2][0])
    # the odd one out averaged with nobody: its values are its own (through its own 8-bit round
    # trip, as a reducer keeps what its receivers get), never a mix decoded with another codec
    from dtrain.swarm.codecs import BLOCKWISE_ERROR_BOUND

    own = contributions[3][0]
    assert float((sent[3][0] - own).norm()) <= BLOCKWISE_ERROR_BOUND * float(own.norm())
    theirs = recs[3]
    assert all(p.outcome == Outcome.WRONG_MODEL for p in theirs.peers if p.peer_id != odd)


@pytest.mark.slow
def test_a_part_that_contradicts_its_claim_is_refused_on_the_ternary_wire(nodes):
    """The per-part check is exact on decoded values: a sender that negates its parts after
    committing honest claims is banned by every reducer, as on any other wire."""
    from tests.faults import FaultInjection

    contributions = _contributions(4)
    swarms, sent, recs = _round(nodes, contributions, ["ternary"] * 4, faults={2: FaultInjection(scale_parts=-1.0)})
    liar = swarms[2].peer_id
    for r in (recs[0], recs[1], recs[3]):
        assert r.outcome_of(liar) == Outcome.FAIL
        reason = next(p.reason for p in r.peers if p.peer_id == liar)
        assert "contradicts its commitment" in reason, reason
    assert torch.equal(sent[0][0], sent[1][0]) and torch.equal(sent[0][0], sent[3][0])
