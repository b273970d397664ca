"""One model's rounds on dtrain's own protocols (dtrain/swarm/model_rounds.py), as a neuron uses
them: a validator announces with weight 0, miners commit their contributions to work reports and
join; real peers, a real hotkey, the records scoring reads."""

from __future__ import annotations

import itertools
import threading

import pytest
import torch

from dtrain.sketch import WORK_SKETCH_K
from dtrain.swarm.model_rounds import ModelRounds, values_per_part
from dtrain.swarm.records import Outcome
from dtrain.swarm.round import RoundSettings
from dtrain.training.work import WorkReport, work_nonce
from tests.test_swarm_committed_round import honest_report

pytestmark = pytest.mark.slow

SHAPES = [(50, 40), (40,), (3000,)]
SAMPLES = (4, 8, 12)
SETTINGS = RoundSettings(window_s=2.0, sender_timeout_s=10, reducer_timeout_s=10)
_ids = itertools.count()


@pytest.fixture(scope="module")
def swarms(rounds):
    nodes, _ = rounds
    templates = [torch.zeros(shape) for shape in SHAPES]
    # the weighted mean, so that the averages below are exact (CenteredClip: test_swarm_butterfly.py)
    return [ModelRounds(node, templates, "model-a", report_type=WorkReport, settings=SETTINGS, part_values=500,
                        robust=False) for node in nodes]


def contributions(seed: int):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(*shape, generator=gen) for shape in SHAPES] for _ in SAMPLES]


def run(swarms, honest, *, epochs=(5, 5, 5), nonce=None, caps=None):
    """A validator's round and the three miners' (miner m at ``epochs[m]``), concurrently."""
    from dtrain.swarm.loopback import run_concurrently

    validator, *miners = swarms
    round_id, nonce = f"model-{next(_ids)}", nonce or work_nonce("model", 5)
    received = [torch.zeros(shape) for shape in SHAPES]
    tensors = [[t.clone() for t in m] for m in honest]

    def miner(m):
        report = honest_report(honest[m], SAMPLES[m], work_nonce("model", epochs[m]))
        return miners[m].run_round(tensors[m], float(SAMPLES[m]), round_id=round_id, epoch=epochs[m],
                                   announcer=validator.peer_id, work=report, work_nonce=work_nonce("model", epochs[m]))

    def announce():
        return validator.run_round(received, 0.0, round_id=round_id, epoch=5, work_nonce=nonce, caps=caps)

    records = run_concurrently([announce] + [lambda m=m: miner(m) for m in range(3)], timeout_s=120)
    return round_id, records, tensors, received


def test_every_member_averages_by_committed_samples_and_the_records_say_so(swarms):
    honest = contributions(1)
    round_id, records, tensors, received = run(swarms, honest)
    total = sum(SAMPLES)
    expected = [sum(w * m[i] for m, w in zip(honest, SAMPLES)) / total for i in range(len(SHAPES))]
    for holder in [received, *tensors]:
        for got, want in zip(holder, expected):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for record in records:
        assert record.ok and record.in_step and record.error == "", record.error
        assert record.round_id == round_id and len(record.group) == 4
        assert {p.outcome for p in record.peers} == {Outcome.SUCCESS} and record.total_weight == total
    assert set(records[0].work_reports) == {s.peer_id for s in swarms[1:]}
    assert records[0].evidence.result_check.failed == {}
    # a miner answers the validators' round audit about the round it committed, and only that one
    miner = swarms[1]
    assert miner.sent_round == round_id and swarms[0].sent_round is None
    sketches = miner.sent_sketches(round_id, "dtrain/audit/v1:" + "00" * 32)
    assert sketches.shape == (miner.num_parts, WORK_SKETCH_K)
    assert len(miner.sent_wire(round_id, 0)) == 4 * 500  # fp32 on the wire
    with pytest.raises(LookupError):
        miner.sent_sketches("another-round", "n")
    with pytest.raises(IndexError):
        miner.sent_wire(round_id, miner.num_parts)


def test_the_announcers_caps_are_signed_into_the_membership_and_every_member_applies_them(swarms):
    # a validator's verdicts (0 on probation, less than claimed) reach every member, not only those it asked
    honest = contributions(4)
    miners = [s.peer_id for s in swarms[1:]]
    caps = {miners[0]: 0.0, miners[1]: 2.0, miners[2]: 100.0}
    _, records, tensors, received = run(swarms, honest, caps=caps)
    weights = (0.0, 2.0, float(SAMPLES[2]))  # capped, capped, as committed (its cap is above it)
    expected = [sum(w * m[i] for m, w in zip(honest, weights)) / sum(weights) for i in range(len(SHAPES))]
    for holder in [received, *tensors]:  # the capped-out miner receives the average like everyone
        for got, want in zip(holder, expected):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    membership = swarms[0].last_round.membership.membership
    assert membership.sender_index(membership.index(miners[0])) is None  # cap 0: it only receives
    for record in records:
        assert record.ok and record.error == "", record.error
        used = {p.peer_id: p.weight_used for p in record.peers}
        assert [used[m] for m in miners] == list(weights) and record.total_weight == sum(weights)


def test_a_reducer_the_announcers_checks_refused_reduces_no_share_in_its_next_rounds(rounds):
    """The sandbox's negating reducer on node 1: refused by every receiver in its first round
    (FAIL in the validator's record); in the next, the announcer gives it no share. It still
    sends, so every member then holds the weighted mean of all three and nobody is refused."""
    from dtrain.sandbox.adversary import MINERS
    from dtrain.swarm.commitments import CommittedChecks

    nodes, _ = rounds
    templates = [torch.zeros(shape) for shape in SHAPES]
    negating = MINERS["negating-reducer"]._mechanisms(None).round_checks
    # a validator of its own: its bench must not reach the other tests' rounds
    fresh = [ModelRounds(node, templates, "model-a", report_type=WorkReport, settings=SETTINGS, part_values=500,
                         robust=False, checks_type=negating if i == 1 else CommittedChecks)
             for i, node in enumerate(nodes)]
    cheat = fresh[1].peer_id
    _, records, _, _ = run(fresh, contributions(7))
    membership = fresh[0].last_round.membership.membership
    assert membership.shares[membership.index(cheat)] > 0
    assert records[0].outcome_of(cheat) == Outcome.FAIL
    assert "refused as a reducer" in next(p.reason for p in records[0].peers if p.peer_id == cheat)
    honest = contributions(8)
    _, records, tensors, received = run(fresh, honest)
    membership = fresh[0].last_round.membership.membership
    assert membership.shares[membership.index(cheat)] == 0 and sum(membership.shares) == membership.num_parts
    assert membership.sender_index(membership.index(cheat)) is not None
    expected = [sum(w * m[i] for m, w in zip(honest, SAMPLES)) / sum(SAMPLES) for i in range(len(SHAPES))]
    for holder in [received, *tensors]:
        for got, want in zip(holder, expected):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for record in records:
        assert record.ok and record.fraction_averaged == 1.0 and {p.outcome for p in record.peers} == {Outcome.SUCCESS}


def test_a_miner_of_another_epoch_sits_out_keeps_its_values_and_is_nobodys_fault(swarms):
    honest = contributions(2)
    round_id, records, tensors, received = run(swarms, honest, epochs=(5, 5, 4))
    assert "sat_out" in records[3].error and not records[3].ok
    assert all(torch.equal(a, b) for a, b in zip(tensors[2], honest[2]))
    assert records[3].peers == []  # it blames nobody
    late = swarms[3].peer_id
    for record in records[:3]:
        assert late not in record.group and record.ok
        assert {p.outcome for p in record.peers} == {Outcome.SUCCESS}
    expected = [(4 * honest[0][i] + 8 * honest[1][i]) / 12 for i in range(len(SHAPES))]
    for got, want in zip(received, expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_bad_contributions_are_refused_before_anything_is_sent(swarms):
    miner = swarms[1]
    good = [torch.zeros(shape) for shape in SHAPES]
    with pytest.raises(ValueError, match="shape"):
        miner.run_round([torch.zeros(3), *good[1:]], 1.0, round_id="bad-1", epoch=5, announcer=swarms[0].peer_id)
    nan = [t.clone() for t in good]
    nan[2][7] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        miner.run_round(nan, 1.0, round_id="bad-2", epoch=5, announcer=swarms[0].peer_id)
    with pytest.raises(ValueError, match="nonce"):
        miner.run_round(good, 1.0, round_id="bad-3", epoch=5, announcer=swarms[0].peer_id,
                        work=honest_report(good, 1, "x"))
    with pytest.raises(ValueError, match="weight"):
        miner.run_round(good, float("inf"), round_id="bad-4", epoch=5, announcer=swarms[0].peer_id)


def test_a_stopped_wait_leaves_the_tensors_as_they_were(swarms):
    miner = swarms[2]
    tensors = [torch.ones(shape) for shape in SHAPES]
    stop = threading.Event()
    stop.set()
    # nobody announces this round: the miner would wait for the announcer; stopping ends the wait
    record = miner.run_round(tensors, 1.0, round_id="never-announced", epoch=5, announcer=swarms[0].peer_id,
                             stop=stop)
    assert "stopped" in record.error and not record.ok
    assert all(bool((t == 1).all()) for t in tensors)


def test_the_part_size_reads_only_the_models_size():
    assert values_per_part(10) == 1 << 10
    assert values_per_part(124_000_000) == 1 << 17
    assert values_per_part(32 * 5000) == 5000
