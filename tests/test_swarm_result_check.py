"""The result check (dtrain.swarm.averaging.result_check; docs/protocol.md, "Result check").

Every receiver checks every result it applied under a seed hashed from the results themselves,
with sketches it asks the senders for over the real p2p wire, before the caller gets anything.
The rules are tested on their own, then real hivemind peers on loopback run real rounds with
honest peers, reducers that hide a change in the public sketch's null space (two constructions),
a sender that lies about its sketches (to every receiver, and about one reducer only), and a
sender that does not answer.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from dtrain.swarm.averaging import kept
from dtrain.swarm.averaging import result_check as rc
from dtrain.swarm.averaging.audit import audit_nonce, audit_round, clear_framed_reducers, draw_seed
from dtrain.swarm.averaging.contribution import binding_rtol
from dtrain.swarm.loopback import local_nodes, run_concurrently
from dtrain.swarm.records import Outcome
from tests.faults import FaultInjection
from tests.faults import swarm as make_swarm
from tests.swarm_checks import loopback_config
from tests.test_swarm_commitments import NONCE, honest_report

SEED = bytes(range(32))


# -- the rules ------------------------------------------------------------------------------

def test_a_question_and_its_answer_round_trip_and_malformed_questions_are_refused():
    assert kept.decode_ask(kept.encode_ask(SEED, [0, 3, 7]), num_parts=8) == (kept.ASK_SKETCHES, SEED, [0, 3, 7])
    assert kept.decode_ask(kept.encode_fetch([1, 2]), num_parts=8) == (kept.ASK_BYTES, None, [1, 2])
    for bad, why in [(b"S" + SEED, "whole u32"), (b"S" + SEED + b"\x00\x00", "whole u32"),
                     (b"S" + SEED[:5], "32-byte seed"), (b"X" + SEED, "sketches \\(S\\) or bytes"),
                     (kept.encode_ask(SEED, [3, 9]), "below 8"), (kept.encode_ask(SEED, [5, 2]), "ascend"),
                     (kept.encode_ask(SEED, [4, 4]), "ascend"), (kept.encode_fetch([2, 1]), "ascend")]:
        with pytest.raises(ValueError, match=why):
            kept.decode_ask(bad, num_parts=8)
    with pytest.raises(ValueError):
        kept.encode_ask(SEED[:31], [0])
    with pytest.raises(ValueError):
        kept.encode_ask(SEED, list(range(kept.MAX_ASK_PARTS + 1)))
    sketches = np.arange(2 * 64, dtype="<f4").reshape(2, 64)
    assert np.array_equal(kept.decode_answer(kept.encode_answer(sketches), 2), sketches)
    assert kept.decode_answer(kept.encode_answer(sketches), 3) is None  # the wrong size: silent
    assert kept.decode_answer(None, 2) is None
    sketches[1, 5] = np.nan
    assert kept.decode_answer(kept.encode_answer(sketches), 2) is None  # non-finite: silent
    wires = [b"abc", b"", b"\x00" * 70]
    assert kept.decode_wires(kept.encode_wires(wires), 3) == wires
    assert kept.decode_wires(kept.encode_wires(wires), 2) is None  # trailing bytes
    assert kept.decode_wires(kept.encode_wires(wires)[:-1], 3) is None  # truncated
    assert kept.decode_wires(None, 3) is None


def test_the_seed_binds_every_bit_of_every_result_and_where_it_lies():
    parts = [(0, torch.randn(100)), (1, torch.randn(50))]
    seed = rc.result_seed(b"group", parts)
    assert seed == rc.result_seed(b"group", [(g, t.clone()) for g, t in parts]) and len(seed) == 32
    flipped = parts[1][1].clone()
    flipped.view(torch.int32)[7] ^= 1  # one bit of one value
    assert rc.result_seed(b"group", [parts[0], (1, flipped)]) != seed
    assert rc.result_seed(b"group", [parts[0], (2, parts[1][1])]) != seed  # another part index
    assert rc.result_seed(b"other", parts) != seed


def _sketches(rng, n_parts, n_senders):
    return {i: {g: rng.standard_normal(64) for g in range(n_parts)} for i in range(n_senders)}


def test_judge_blames_a_lone_reducer_and_sets_aside_a_sender_that_contradicts_several():
    rng = np.random.default_rng(0)
    answers = _sketches(rng, 6, 3)
    c = {g: (1 / 3, 1 / 3, 1 / 3) for g in range(6)}
    reducers = {g: g // 2 for g in range(6)}  # reducers 0, 1, 2 hold two parts each
    norms = {g: {i: float(np.linalg.norm(answers[i][g])) for i in range(3)} for g in range(6)}
    true = {g: sum(c[g][i] * answers[i][g] for i in range(3)) for g in range(6)}
    assert rc.judge(true, c, reducers, answers, norms, 1e-4) == (set(), {})
    # a reducer that returns its parts negated: its parts fail, it is the only one to blame
    altered = {**true, 2: -true[2], 3: -true[3]}
    assert rc.judge(altered, c, reducers, answers, norms, 1e-4) == ({2, 3}, {})
    # one sender's false sketches make every reducer fail: they are set aside, nothing fails
    lying = {**answers, 1: {g: -s for g, s in answers[1].items()}}
    failing, set_aside = rc.judge(true, c, reducers, lying, norms, 1e-4)
    assert failing == set() and list(set_aside) == [1]
    # both at once: the liar is set aside and the cheating reducer still fails
    failing, set_aside = rc.judge(altered, c, reducers, lying, norms, 1e-4)
    assert failing == {2, 3} and list(set_aside) == [1]


def test_a_silent_sender_is_bounded_by_its_claimed_part():
    rng = np.random.default_rng(1)
    answers = _sketches(rng, 2, 4)
    c = {g: (0.25,) * 4 for g in range(2)}
    norms = {g: {i: float(np.linalg.norm(answers[i][g])) for i in range(4)} for g in range(2)}
    true = {g: sum(0.25 * answers[i][g] for i in range(4)) for g in range(2)}
    silent = {**answers, 3: None}
    assert rc.failing_parts(true, c, silent, norms, 1e-4) == set()  # a silent peer blocks nothing
    nudged = {0: true[0] + 0.1 * answers[3][0], 1: -true[1]}
    assert rc.failing_parts(nudged, c, silent, norms, 1e-4) == {1}  # only what its term could cover passes
    assert rc.failing_parts(nudged, c, answers, norms, 1e-4) == {0, 1}  # and nothing, once it answers


# -- real peers -----------------------------------------------------------------------------

_prefix = itertools.count()


@pytest.fixture(scope="module")
def nodes():
    with local_nodes(4) as started:
        yield started


def _round(nodes, n, *, faults=None, seed=31, **cfg):
    torch.manual_seed(seed)
    base = torch.randn(12000)
    data = [[base + torch.randn(12000)] for _ in range(n)]
    config = loopback_config(f"rc{next(_prefix)}", n, **{"require_commitments": True, "aggregation": "mean", **cfg})
    swarms = [make_swarm(nodes[i].dht, data[i], "model-a", config, fault=(faults or {}).get(i)) for i in range(n)]
    applied = [[t.clone() for t in d] for d in data]
    try:
        records = run_concurrently([
            lambda i=i: swarms[i].run_round(applied[i], weight=8, cap=100, work=honest_report(data[i], 8),
                                            work_nonce=NONCE) for i in range(n)])
    except BaseException:
        _close(swarms)
        raise
    return swarms, records, applied, data


def _close(swarms):
    for s in swarms:
        s.shutdown()


def _audit(swarms, record, result):
    nonce = audit_nonce(draw_seed())
    by_peer = {s.peer_id: s for s in swarms}
    reports = {p: s.sent_sketches(s.sent_round, nonce) for p, s in by_peer.items()}
    return audit_round(record.evidence, result, reports, nonce, binding_rtol(record.compression),
                       lambda peer, part: by_peer[peer].sent_wire(by_peer[peer].sent_round, part))


@pytest.mark.slow
@pytest.mark.parametrize("compression, aggregation", [("none", "mean"), ("8bit", "centered_clip")])
def test_an_honest_round_passes_the_result_check_on_every_part(nodes, compression, aggregation):
    swarms, recs, applied, _ = _round(nodes, 4, compression=compression, aggregation=aggregation,
                                      part_size_bytes=2048)
    try:
        for r, mine in zip(recs, applied):
            assert all(p.outcome == Outcome.SUCCESS for p in r.peers), [(p.outcome, p.reason) for p in r.peers]
            check = r.evidence.result_check
            assert check.failed == {} and check.disputed == {} and check.silent == []
            own = {g for g, part in r.evidence.parts.items() if part.reducer == r.local_peer_id}
            assert check.parts_checked == len(r.evidence.layout) - len(own) > 0  # every other reducer's part
            assert r.result_check_s > 0 and r.fraction_refused == 0
            assert torch.equal(mine[0], applied[0][0])  # the same bits on every peer
    finally:
        _close(swarms)


@pytest.mark.slow
@pytest.mark.parametrize("fault, compression, aggregation", [
    (FaultInjection(nullspace_results=True), "8bit", "centered_clip"),  # its result reflected
    (FaultInjection(nullspace_noise_results=0.5), "none", "mean"),  # noise half its size, all hidden
])
def test_a_reducer_that_hides_a_change_in_the_null_space_is_refused_before_anyone_applies_it(
        nodes, fault, compression, aggregation):
    """Every honest receiver refuses the cheat's parts before applying them and re-reduces its
    share itself from the senders' committed bytes: all three hold the same bits, the honest
    average everywhere."""
    swarms, recs, applied, data = _round(nodes, 4, faults={3: fault}, compression=compression,
                                         aggregation=aggregation, part_size_bytes=1024)
    try:
        cheat = swarms[3].peer_id
        assert any(p.reducer == cheat for p in recs[3].evidence.parts.values())  # it reduced a share
        for r in recs[:3]:
            assert r.outcome_of(cheat) == Outcome.FAIL and rc.REASON in r.result_of(cheat).reason
            assert all(p.outcome == Outcome.SUCCESS for p in r.peers if p.peer_id != cheat)
            assert r.in_step and r.fraction_averaged == 1.0 and r.fraction_refused == 0
            assert 0.1 < r.fraction_recovered < 0.5  # its share (about a quarter, in whole parts), re-reduced
            assert {f.reducer for f in r.evidence.result_check.failed.values()} == {cheat}
        assert torch.equal(applied[0][0], applied[1][0]) and torch.equal(applied[0][0], applied[2][0])
        mean = sum(d[0] for d in data) / 4
        cos = float(torch.nn.functional.cosine_similarity(applied[0][0], mean, dim=0))
        assert cos > 0.97, cos  # what was applied is the honest average (8-bit rounding aside)
        result = _audit(swarms, recs[0], applied[0])
        assert set(result.problems) == {cheat} and result.proven == {cheat}, result.problems
    finally:
        _close(swarms)


@pytest.mark.slow
def test_a_sender_that_lies_to_every_receiver_is_set_aside_and_named_and_nothing_is_lost(nodes):
    swarms, recs, applied, _ = _round(nodes, 4, faults={1: FaultInjection(lie_in_result_check="all")})
    try:
        liar = swarms[1].peer_id
        for r in (recs[0], recs[2], recs[3]):
            assert all(p.outcome == Outcome.SUCCESS for p in r.peers), [(p.outcome, p.reason) for p in r.peers]
            check = r.evidence.result_check
            assert check.failed == {} and len(check.disputed) == 1
            assert r.fraction_averaged == 1.0
            result = _audit(swarms, r, applied[recs.index(r)])
            assert set(result.problems) == {liar} and result.proven == {liar}, result.problems
            assert "contradict" in result.problems[liar]
        assert torch.equal(applied[0][0], applied[2][0])
    finally:
        _close(swarms)


@pytest.mark.slow
def test_a_reducer_refused_for_a_senders_lie_is_cleared_by_the_validator_and_the_liar_named(nodes):
    """A sender that lies about one part of each question (one reducer's) gets that reducer's
    parts refused by every receiver it lied to; the audit's settlement shows its bytes
    contradict its answer, names it on evidence, and gives the reducer its SUCCESS back."""
    swarms, recs, applied, _ = _round(nodes, 4, faults={1: FaultInjection(lie_in_result_check="first")})
    try:
        liar = swarms[1].peer_id
        r = recs[0]
        framed = {f.reducer for f in r.evidence.result_check.failed.values()}
        assert len(framed) == 1 and liar not in framed
        (reducer,) = framed
        assert r.outcome_of(reducer) == Outcome.FAIL
        result = _audit(swarms, r, applied[0])
        assert set(result.problems) == {liar} and result.proven == {liar}, result.problems
        assert clear_framed_reducers(r, r.evidence, result) == [reducer]
        assert r.outcome_of(reducer) == Outcome.SUCCESS and r.result_of(reducer).weight_used == 8
    finally:
        _close(swarms)


@pytest.mark.slow
def test_a_sender_that_does_not_answer_blocks_nothing(nodes):
    swarms, recs, applied, _ = _round(nodes, 3, faults={2: FaultInjection(silent_in_result_check=True)})
    try:
        for r in recs[:2]:
            assert all(p.outcome == Outcome.SUCCESS for p in r.peers), [(p.outcome, p.reason) for p in r.peers]
            assert r.evidence.result_check.silent == [swarms[2].peer_id]
            assert r.evidence.result_check.failed == {} and r.fraction_averaged == 1.0
    finally:
        _close(swarms)


@pytest.mark.slow
def test_what_a_peer_sent_is_kept_once_in_its_averager_until_its_next_round(nodes):
    """The swarm asks the averager process, which keeps the one copy of what it sent: its bytes
    are the ones sent, and once the next round begins the old round is gone (LookupError: the
    miner's round-audit handler answers 404 for it)."""
    from dtrain.swarm.averaging.kept import SentContribution
    from dtrain.swarm.wire import make_compression

    swarms, recs, applied, data = _round(nodes, 3)
    try:
        first = swarms[0].sent_round
        assert first == recs[0].round_id
        mine = SentContribution(data[0], swarms[0]._part_layout(), make_compression(swarms[0].config.compression))
        assert swarms[0].sent_wire(first, 1) == mine.wire(1)
        assert np.array_equal(swarms[0].sent_sketches(first, "n1"), mine.sketches("n1"))
        with pytest.raises(IndexError):
            swarms[0].sent_wire(first, swarms[0].num_parts)
        again = [[d[0] + 1.0] for d in data]
        run_concurrently([lambda i=i: swarms[i].run_round(again[i], weight=8, cap=100, work=honest_report(again[i], 8),
                                                          work_nonce=NONCE) for i in range(3)])
        with pytest.raises(LookupError):
            swarms[0].sent_sketches(first, "n1")
        assert swarms[0].sent_round != first
        assert swarms[0].sent_wire(swarms[0].sent_round, 1) == SentContribution(
            [data[0][0] + 1.0], mine.layout, mine.compression).wire(1)
    finally:
        _close(swarms)
