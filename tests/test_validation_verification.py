"""The validator's per-round decisions (dtrain.validation.verification), as pure functions."""

from __future__ import annotations

import random

from dtrain.swarm.records import Outcome
from dtrain.training.work import PageWork, WorkReport
from dtrain.validation.scoring import (
    GATE_WORK_AUDIT,
    MicroBatchCheck,
    ScoringConfig,
    score_round,
)
from dtrain.validation.verification import (
    NOT_COMMITTED,
    PageAudit,
    WorkVerdict,
    batch_audit_chance,
    check_page_ids,
    choose_audit_pages,
    judge_work,
    round_input,
    train_passed,
    weight_caps,
)

OK = MicroBatchCheck(passed=True, similarity=0.9999, loss_rel_err=0.0)
BAD = MicroBatchCheck(passed=False, similarity=0.2, loss_rel_err=0.5)


def _report(n=4, epoch=3, samples=4):
    return WorkReport(epoch=epoch, pages=tuple(PageWork(page=100 + c, counter=c, samples=samples, loss=5.0,
                                                        sketch=(0.0,) * 4) for c in range(n)))


def _audit(passed=True):
    return PageAudit(page=101, counter=1, passed=passed, cosine=1.0 if passed else 0.1, norm_ratio=1.0,
                     loss_diff=0.0, reasons=() if passed else ("cosine 0.1 < 0.995",))


def test_train_passed_is_decided_in_one_place():
    assert train_passed([OK, OK])
    assert not train_passed([])
    assert not train_passed([OK, BAD])
    assert not train_passed([OK], shared_peer_id=True)


def test_train_answers_out_of_sync_or_misshapen_are_not_checked():
    from dtrain.training.replica import REPLICA_RTOL
    from dtrain.validation.verification import (
        answer_problem,
        choose_recomputed,
        in_sync_problem,
    )

    assert in_sync_problem(4, 4, None) == "" and in_sync_problem(4, 4, REPLICA_RTOL / 2) == ""
    assert "epoch 3, ours 4" in in_sync_problem(3, 4, 0.0)
    assert "replica tolerance" in in_sync_problem(4, 4, REPLICA_RTOL * 10)
    assert answer_problem(2, 2) == ("", [])
    problem, checks = answer_problem(1, 2)
    assert "expected 2 micro-batches, got 1" in problem and not train_passed(checks)
    assert len({tuple(choose_recomputed(8, 0.25, random.Random(seed))) for seed in range(30)}) > 5
    assert len(choose_recomputed(4, 0.5, random.Random(1))) == 2 and len(choose_recomputed(1, 0.1, random.Random(1))) == 1
    assert choose_recomputed(0, 0.5, random.Random(1)) == []


def test_weight_caps_follow_the_train_verdict():
    assert weight_caps({"a": True, "b": False}, 64) == {"a": 64.0, "b": 0.0}


def test_audit_pages_are_distinct_and_drawn_from_the_validators_randomness():
    picks = {tuple(choose_audit_pages(16, 2, random.Random(seed))) for seed in range(50)}
    assert len(picks) > 20  # not predictable from the report
    assert all(len(set(p)) == 2 and all(0 <= i < 16 for i in p) for p in picks)
    assert choose_audit_pages(3, 10, random.Random(0)) == [0, 1, 2]
    assert choose_audit_pages(0, 1, random.Random(0)) == [] and choose_audit_pages(5, 0, random.Random(0)) == []


def test_committed_pages_must_be_the_miners_own_assignment():
    report = _report()
    assert check_page_ids(report.pages, lambda c: 100 + c) == ""
    assert "is not this miner's" in check_page_ids(report.pages, lambda c: 200 + c)
    repeated = report.pages[:2] + report.pages[1:2]
    assert "repeats or goes back" in check_page_ids(repeated, lambda c: 100 + c)


def test_work_verdict():
    report = _report()
    good = judge_work(report, "", [_audit()], expected_epoch=3)
    assert good.passed and good.credited_samples == 16
    failed = judge_work(report, "", [_audit(), _audit(False)], expected_epoch=3)
    assert not failed.passed and failed.credited_samples == 0 and "failed its audit (cosine" in failed.problem
    assert "epoch 3, not 4" in judge_work(report, "", [_audit()], expected_epoch=4).problem
    assert judge_work(report, "page x is not this miner's", [], expected_epoch=3).problem == "page x is not this miner's"


def test_round_input_and_scoring_pay_for_verified_work_only():
    cfg = ScoringConfig()
    full = judge_work(_report(16), "", [_audit()], expected_epoch=3)
    half = judge_work(_report(8), "", [_audit()], expected_epoch=3)
    caught = judge_work(_report(16), "", [_audit(False)], expected_epoch=3)
    inputs = {
        1: round_input(checks=[OK], shared_peer_id=False, work=full, claimed_weight=64, outcome=Outcome.SUCCESS,
                       slice_bps=1e7),
        2: round_input(checks=[OK], shared_peer_id=False, work=half, claimed_weight=32, outcome=Outcome.SUCCESS,
                       slice_bps=1e7),
        3: round_input(checks=[OK], shared_peer_id=False, work=caught, claimed_weight=64, outcome=Outcome.SUCCESS,
                       slice_bps=1e7),
        # joined nothing, answered well: nothing verified, gated by its outcome, not by an audit
        4: round_input(checks=[OK], shared_peer_id=False, work=None, claimed_weight=None,
                       outcome=Outcome.NON_PARTICIPATING, slice_bps=1e7),
        # not reachable at all: only its outcome is evidence
        5: round_input(checks=None, shared_peer_id=False, work=None, claimed_weight=None,
                       outcome=Outcome.NOT_ALIVE, slice_bps=None),
        # claims more than it committed
        6: round_input(checks=[OK], shared_peer_id=False, work=half, claimed_weight=64, outcome=Outcome.SUCCESS,
                       slice_bps=1e7),
    }
    scores = score_round(inputs, cfg)
    assert scores[1].combined > 0.999
    assert abs(scores[2].combined - 0.5 * scores[1].combined) < 1e-9  # half the verified work, half the pay
    assert scores[3].combined == 0.0 and GATE_WORK_AUDIT in scores[3].gated
    assert scores[4].combined == 0.0 and GATE_WORK_AUDIT not in scores[4].gated
    assert inputs[5].train is None and scores[5].combined == 0.0 and "no_participation" in scores[5].gated
    assert scores[6].combined == 0.0 and "inflated_claim" in scores[6].gated
    assert inputs[4].train.verified_samples == 0 and NOT_COMMITTED.credited_samples == 0


def test_pay_is_proportional_to_verified_samples_however_large_contributions_grow():
    # Miners train continuously, so contributions differ by hardware speed: each miner's round
    # score is its verified samples over the round's most, at any size (docs/scoring.md).
    cfg = ScoringConfig()
    sizes = {1: 4096, 2: 2048, 3: 1365, 4: 64, 5: 8}
    inputs = {uid: round_input(checks=[OK], shared_peer_id=False,
                               work=judge_work(_report(n // 4), "", [_audit()], expected_epoch=3),
                               claimed_weight=4 * (n // 4), outcome=Outcome.SUCCESS, slice_bps=1e7)
              for uid, n in sizes.items()}
    scores = score_round(inputs, cfg)
    top = scores[1].combined
    for uid, n in sizes.items():
        assert abs(scores[uid].combined - top * (n // 4) / (4096 // 4)) < 1e-9, (uid, scores[uid])


def test_the_batch_audit_chance_keeps_the_validators_cost_bounded():
    # Up to a local batch: the configured chance; beyond it, the expected samples recomputed stay
    # chance x local batch, a falling share of a growing contribution.
    assert batch_audit_chance(0.25, 0, 64) == 0.25
    assert batch_audit_chance(0.25, 64, 64) == 0.25 and batch_audit_chance(1.0, 16, 64) == 1.0
    for samples in (65, 128, 1000, 32768, 1 << 24):
        chance = batch_audit_chance(0.25, samples, 64)
        assert 0 < chance < 0.25
        assert abs(chance * samples - 0.25 * 64) < 1e-9
    assert batch_audit_chance(0.0, 4096, 64) == 0.0


def test_a_failed_train_answer_credits_nothing_even_with_good_work():
    full = judge_work(_report(16), "", [_audit()], expected_epoch=3)
    inp = round_input(checks=[BAD], shared_peer_id=False, work=full, claimed_weight=64, outcome=Outcome.SUCCESS,
                      slice_bps=1e7)
    assert inp.train.verified_samples == 0
    assert score_round({1: inp})[1].combined == 0.0
    assert WorkVerdict(0).passed and WorkVerdict(5, problem="x").credited_samples == 0


def test_probation_after_a_failed_audit():
    from dtrain.validation.scoring import GATE_PROBATION
    from dtrain.validation.verification import (
        PROBATION_ROUNDS,
        on_probation,
        update_probation,
    )

    probation = update_probation({}, {"cheat": True, "honest": False}, round_no=5)
    assert probation == {"cheat": 5 + PROBATION_ROUNDS}
    assert on_probation(probation, "cheat", 5) and on_probation(probation, "cheat", 5 + PROBATION_ROUNDS)
    assert not on_probation(probation, "cheat", 6 + PROBATION_ROUNDS) and not on_probation(probation, "honest", 6)
    # caught again while on probation: the probation is extended, never shortened
    again = update_probation(probation, {"cheat": True}, round_no=8)
    assert again["cheat"] == 8 + PROBATION_ROUNDS
    assert update_probation(again, {}, round_no=9 + PROBATION_ROUNDS) == {}  # expired entries are dropped
    # a miner on probation scores 0 even when this round's checks pass, and credits nothing
    full = judge_work(_report(16), "", [_audit()], expected_epoch=3)
    inputs = {uid: round_input(checks=[OK], shared_peer_id=False, work=full, claimed_weight=64,
                               outcome=Outcome.SUCCESS, slice_bps=1e7, probation=uid == 2) for uid in (1, 2)}
    scores = score_round(inputs)
    assert scores[2].combined == 0.0 and GATE_PROBATION in scores[2].gated and scores[2].credited_samples == 0
    assert scores[1].combined > 0.99


def test_probation_survives_a_restart(tmp_path):
    from dtrain.validation.state import ValidatorState, load_state, save_state

    state = ValidatorState(probation={"5Cheat": 17})
    save_state(tmp_path / "state.json", state)
    assert load_state(tmp_path / "state.json").probation == {"5Cheat": 17}


def test_a_round_overtaken_by_another_validators_round_is_not_held_against_miners():
    from dtrain.validation.verification import overtaken_by

    # no group of our own, and most asked miners answered from the next epoch: catch up to it
    assert overtaken_by(False, 4, [5, 5, 5], asked=3) == 5
    assert overtaken_by(False, 4, [5, 5, 4], asked=3) == 5
    # a round that averaged is scored as usual, whatever the answers say
    assert overtaken_by(True, 4, [5, 5, 5], asked=3) is None
    # the majority is of the miners asked: one answer among silent miners cannot void a round
    assert overtaken_by(False, 4, [5], asked=3) is None
    assert overtaken_by(False, 4, [5, 4, 4], asked=3) is None
    assert overtaken_by(False, 4, [5, 4], asked=2) is None
    assert overtaken_by(False, 4, [], asked=0) is None
    # only the epoch the missed round produced counts: made-up far epochs void nothing
    assert overtaken_by(False, 4, [10**9, 10**9, 10**9], asked=3) is None
    assert overtaken_by(False, 4, [4, 4, 3], asked=3) is None
    # landed in a later epoch's group (the swarm sat this validator out): most asked miners
    # committed epoch 6 there, so they are at 7 now, whatever they answered
    assert overtaken_by(False, 4, [8, 8, 8], asked=3, committed_epochs=[6, 6, 5]) == 7
    assert overtaken_by(True, 4, [], asked=3, committed_epochs=[6, 6, 6]) is None
    assert overtaken_by(False, 4, [], asked=3, committed_epochs=[6]) is None  # a majority of those asked
    assert overtaken_by(False, 4, [], asked=3, committed_epochs=[4, 4, 3]) is None


def test_a_miner_that_steps_mid_check_is_stale_evidence_not_a_failure():
    from dtrain.validation.verification import (
        MAX_OVERTAKEN_IN_A_ROW,
        excuse_moved_on,
        moved_on_during_checks,
    )

    # at our epoch when the round began, at the next one now: another validator's round ran
    assert moved_on_during_checks(4, 4, 5)
    assert moved_on_during_checks(4, 4, 6)
    # still at our epoch (a genuinely wrong answer), never re-read, or already ahead at the start
    assert not moved_on_during_checks(4, 4, 4)
    assert not moved_on_during_checks(4, 4, None)
    assert not moved_on_during_checks(5, 4, 6)  # "ahead" from the start is handled as ahead
    assert not moved_on_during_checks(None, 4, 5)

    # excused only when it also missed our group, and only a few rounds in a row
    assert excuse_moved_on(True, Outcome.NON_PARTICIPATING, 1)
    assert excuse_moved_on(True, "NOT_ALIVE", MAX_OVERTAKEN_IN_A_ROW)
    assert not excuse_moved_on(True, Outcome.NON_PARTICIPATING, MAX_OVERTAKEN_IN_A_ROW + 1)
    # averaged our epoch with us, so it cannot have moved on before our checks: its claim is false
    assert not excuse_moved_on(True, Outcome.SUCCESS, 1)
    assert not excuse_moved_on(False, Outcome.NON_PARTICIPATING, 1)
    # refused by our own round for what it published at our epoch: it caught up after the refusal
    assert excuse_moved_on(True, Outcome.FAIL, 1)
    assert not excuse_moved_on(True, Outcome.FAIL, 1, proven=True)


def test_an_excused_miner_keeps_its_score_and_a_failed_check_still_gates():
    cfg = ScoringConfig()
    honest = round_input(checks=[OK, OK], shared_peer_id=False, work=WorkVerdict(64), claimed_weight=64,
                         outcome=Outcome.SUCCESS, slice_bps=1e7)
    # excused: no checks and no outcome, so the round says nothing about it (its EMA stays)
    excused = round_input(checks=None, shared_peer_id=False, work=None, claimed_weight=None, outcome=None,
                          slice_bps=0.0)
    # not excused: the failed Train answer is an empty check and it missed the round
    failed = round_input(checks=[], shared_peer_id=False, work=None, claimed_weight=None,
                         outcome=Outcome.NON_PARTICIPATING, slice_bps=0.0)
    scores = score_round({1: honest, 2: excused, 3: failed}, cfg)
    assert scores[1].combined > 0.9
    assert scores[2].combined is None and scores[2].gated == ()
    assert scores[3].combined == 0.0 and scores[3].gated


def test_validators_start_rounds_on_a_shared_clock():
    from dtrain.swarm.deadlines import next_round_start

    # two validators that finished their last rounds at different moments meet at one boundary
    assert next_round_start(1_000_003.2, 60.0) == next_round_start(1_000_019.9, 60.0) == 1_000_020.0
    assert next_round_start(120.0, 60.0) == 180.0  # strictly after now: never the boundary just passed
    assert next_round_start(5.5, 2.0) == 6.0
    assert next_round_start(17.25, 0.0) == 17.25  # no interval: at once


def test_validators_start_the_all_reduce_at_one_point_of_the_slot():
    from dtrain.swarm.deadlines import allreduce_start

    # however long each validator's checks took, both wait for the same moment
    assert allreduce_start(1_000_020.0, 60.0) == 1_000_050.0
    assert allreduce_start(6.0, 2.0) == 7.0
    assert allreduce_start(6.0, 0.0) == 6.0
