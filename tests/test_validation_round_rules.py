"""The decisions that steer a validation round (dtrain.validation.round_rules), as pure functions."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from dtrain.swarm.records import Outcome, PeerResult, RoundRecord
from dtrain.training.replica import REPLICA_RTOL
from dtrain.validation import round_rules as R
from dtrain.validation.scoring import GATE_PROBATION, MicroBatchCheck, score_round
from dtrain.validation.verification import (
    MAX_OVERTAKEN_IN_A_ROW,
    PROBATION_ROUNDS,
    WorkVerdict,
)

OK = MicroBatchCheck(passed=True, similarity=0.9999, loss_rel_err=0.0)
BAD = MicroBatchCheck(passed=False, similarity=0.2, loss_rel_err=0.5)
NEAR, FAR = REPLICA_RTOL / 10, REPLICA_RTOL * 10


@dataclass
class Neuron:
    uid: int
    hotkey: str
    validator_permit: bool = False


@dataclass
class Commit:
    api: str
    peer_id: str


# ------------------------------------------------------------------ select_targets

def test_targets_are_committed_miners_only_never_validators_or_ourselves():
    neurons = [Neuron(0, "me", True), Neuron(1, "m1"), Neuron(2, "m2"), Neuron(3, "v2", True), Neuron(4, "silent")]
    commitments = {"me": Commit("a:0", "P0"), "m1": Commit("a:1", "P1"), "m2": Commit("a:2", "P2"),
                   "v2": Commit("a:3", "P3")}
    targets = R.select_targets(neurons, commitments, "me", 10, random.Random(1))
    assert sorted(t.uid for t in targets) == [1, 2]
    t1 = next(t for t in targets if t.uid == 1)
    assert (t1.hotkey, t1.api, t1.peer_id, t1.shared_peer_id) == ("m1", "a:1", "P1", False)
    # ourselves, even without a permit, is never a target
    assert R.select_targets([Neuron(0, "me")], {"me": Commit("a:0", "P0")}, "me", 10, random.Random(1)) == []


def test_targets_are_a_random_sample_of_the_requested_size():
    neurons = [Neuron(i, f"m{i}") for i in range(10)]
    commitments = {f"m{i}": Commit(f"a:{i}", f"P{i}") for i in range(10)}
    picks = {tuple(sorted(t.uid for t in R.select_targets(neurons, commitments, "me", 3, random.Random(s))))
             for s in range(30)}
    assert all(len(p) == 3 and len(set(p)) == 3 for p in picks) and len(picks) > 10
    assert len(R.select_targets(neurons, commitments, "me", 0, random.Random(1))) == 0


def test_no_committed_miner_means_no_targets():
    assert R.select_targets([], {}, "me", 4, random.Random(1)) == []
    assert R.select_targets([Neuron(1, "m1")], {}, "me", 4, random.Random(1)) == []


def test_a_peer_id_committed_by_several_hotkeys_marks_every_one_of_them():
    neurons = [Neuron(1, "orig"), Neuron(2, "copy"), Neuron(3, "own")]
    # the copy's peer id is also a validator's commitment: counted over all commitments
    commitments = {"orig": Commit("a:1", "SAME"), "copy": Commit("a:2", "SAME"), "own": Commit("a:3", "P3"),
                   "val": Commit("a:9", "P3")}
    shared = {t.hotkey: t.shared_peer_id for t in R.select_targets(neurons, commitments, "me", 10, random.Random(1))}
    assert shared == {"orig": True, "copy": True, "own": True}
    commitments["val"] = Commit("a:9", "PV")
    shared = {t.hotkey: t.shared_peer_id for t in R.select_targets(neurons, commitments, "me", 10, random.Random(1))}
    assert shared == {"orig": True, "copy": True, "own": False}


# ------------------------------------------------------------------ fellow_validators

def test_fellow_validators_are_weight_zero_members_no_miner_committed():
    record = RoundRecord(round_id="r", local_peer_id="me", started_at=0.0, duration_s=1.0,
                         peers=[PeerResult("me", Outcome.SUCCESS, 0.0), PeerResult("m1", Outcome.SUCCESS, 64.0),
                                PeerResult("lazy", Outcome.SUCCESS, 0.0), PeerResult("v2", Outcome.SUCCESS, 0.0),
                                PeerResult("v3", Outcome.SUCCESS, 0.0), PeerResult("big", Outcome.SUCCESS, 8.0)])
    assert R.fellow_validators(record, {"m1", "lazy"}, "me") == {"v2", "v3"}
    # a lone validator (or a round with no group) names nobody next time
    alone = RoundRecord(round_id="", local_peer_id="me", started_at=0.0, duration_s=1.0,
                        peers=[PeerResult("me", Outcome.FAIL, 0.0)])
    assert R.fellow_validators(alone, {"m1"}, "me") == set()
    assert R.fellow_validators(RoundRecord("", "me", 0.0, 0.0), set(), "me") == set()


# ------------------------------------------------------------------ majority_epoch_ahead

def test_follow_the_swarm_when_most_miners_asked_are_ahead():
    assert R.majority_epoch_ahead([7, 7, 7], 4) == 7
    assert R.majority_epoch_ahead([7, 7, 3], 4) == 7
    # a minority ahead is not followed: the majority is of the miners asked, silent ones included
    assert R.majority_epoch_ahead([7, 4, 4], 4) is None
    assert R.majority_epoch_ahead([7, None, None], 4) is None
    assert R.majority_epoch_ahead([7, 7, None, None], 4) is None  # a tie is no majority
    assert R.majority_epoch_ahead([7, 7, 8, 8], 4) is None  # two camps ahead, neither a majority
    # at or behind our epoch: nothing to follow
    assert R.majority_epoch_ahead([4, 4, 4], 4) is None
    assert R.majority_epoch_ahead([2, 2, 2], 4) is None
    # nobody answered, or nobody was asked
    assert R.majority_epoch_ahead([None, None], 4) is None
    assert R.majority_epoch_ahead([], 4) is None
    # a single miner asked that is ahead is a majority of one
    assert R.majority_epoch_ahead([5], 4) == 5


# ------------------------------------------------------------------ drifted_alone

def test_resync_only_when_most_measured_miners_are_far_from_us():
    assert R.drifted_alone([FAR, FAR, NEAR], [False] * 3) == R.Drift(far=2, measured=3)
    assert R.drifted_alone([FAR, FAR], [False, False]) == (2, 2)
    # a minority far away drifted, not us; a tie is no majority
    assert R.drifted_alone([FAR, NEAR, NEAR], [False] * 3) is None
    assert R.drifted_alone([FAR, FAR, NEAR, NEAR], [False] * 4) is None
    # one measured miner is never enough to blame ourselves
    assert R.drifted_alone([FAR], [False]) is None
    assert R.drifted_alone([FAR, None, None], [False] * 3) is None
    assert R.drifted_alone([], []) is None
    # a miner that moved on during our checks did not drift, and does not count
    assert R.drifted_alone([FAR, FAR, NEAR], [True, False, False]) is None
    assert R.drifted_alone([FAR, FAR, FAR], [True, False, False]) == (2, 2)
    # a failed download (infinite distance) counts as far
    assert R.drifted_alone([float("inf"), float("inf")], [False, False]) == (2, 2)
    with pytest.raises(ValueError):
        R.drifted_alone([FAR], [False, False])


# ------------------------------------------------------------------ swarm_settings_problem

def test_a_different_swarm_fingerprint_is_a_named_problem():
    assert R.swarm_settings_problem(None, "abc") == ""
    assert R.swarm_settings_problem("abc", "abc") == ""
    problem = R.swarm_settings_problem("f" * 40, "0" * 40)
    assert "swarm fingerprint ffffffffffff," in problem and "ours 000000000000;" in problem


# ------------------------------------------------------------------ answers_look_stale

def _stale(**kw):
    args = {"status_epoch": 4, "shared_peer_id": False, "train_epoch": 4, "train_failed": False,
            "replica_distance": NEAR}
    return R.answers_look_stale(4, **{**args, **kw})


def test_answers_that_do_not_fit_our_epoch_are_rechecked():
    assert not _stale()  # everything fits
    assert _stale(train_epoch=5)  # answered from the next epoch
    assert _stale(train_epoch=None, train_failed=True)  # the query failed
    assert _stale(replica_distance=FAR)  # the slice was read after a step
    assert not _stale(train_epoch=None, train_failed=False)  # never asked (e.g. another swarm's settings)
    assert not _stale(replica_distance=None)  # no slice read


def test_only_miners_at_our_epoch_when_the_round_began_are_rechecked():
    assert not _stale(status_epoch=5, train_epoch=5)  # ahead from the start: handled as ahead
    assert not _stale(status_epoch=3, train_epoch=3)
    assert not _stale(status_epoch=None, train_epoch=None, train_failed=True)  # unreachable
    assert not _stale(shared_peer_id=True, train_epoch=5)  # untrusted anyway


# ------------------------------------------------------------------ may_contribute

def test_weight_only_for_a_verified_train_answer_off_probation():
    assert R.may_contribute([OK, OK], shared_peer_id=False, probation={}, hotkey="m", round_no=5)
    assert not R.may_contribute([OK, BAD], shared_peer_id=False, probation={}, hotkey="m", round_no=5)
    assert not R.may_contribute([], shared_peer_id=False, probation={}, hotkey="m", round_no=5)
    assert not R.may_contribute([OK], shared_peer_id=True, probation={}, hotkey="m", round_no=5)
    assert not R.may_contribute([OK], shared_peer_id=False, probation={"m": 5}, hotkey="m", round_no=5)
    assert R.may_contribute([OK], shared_peer_id=False, probation={"m": 4}, hotkey="m", round_no=5)
    assert R.may_contribute([OK], shared_peer_id=False, probation={"other": 9}, hotkey="m", round_no=5)


# ------------------------------------------------------------------ skip_overtaken

def test_an_overtaken_round_is_rerun_a_few_times_in_a_row_then_scored():
    kw = {"round_averaged": False, "our_epoch": 4, "answer_epochs": [5, 5, 5], "asked": 3, "committed_epochs": []}
    assert R.skip_overtaken(**kw, in_a_row=0) == (5, 1)
    assert R.skip_overtaken(**kw, in_a_row=MAX_OVERTAKEN_IN_A_ROW - 1) == (5, MAX_OVERTAKEN_IN_A_ROW)
    # past the limit the round is scored, and the streak keeps counting until a round is not overtaken
    assert R.skip_overtaken(**kw, in_a_row=MAX_OVERTAKEN_IN_A_ROW) == (None, MAX_OVERTAKEN_IN_A_ROW + 1)
    # a round that averaged, or a minority ahead, resets the streak
    assert R.skip_overtaken(**{**kw, "round_averaged": True}, in_a_row=2) == (None, 0)
    assert R.skip_overtaken(**{**kw, "answer_epochs": [5, 4, 4]}, in_a_row=2) == (None, 0)
    # landed in a later epoch's group: catch up past it
    assert R.skip_overtaken(**{**kw, "committed_epochs": [6, 6, 6]}, in_a_row=0) == (7, 1)
    # nobody asked: never overtaken
    assert R.skip_overtaken(**{**kw, "answer_epochs": [], "asked": 0}, in_a_row=1) == (None, 0)


# ------------------------------------------------------------------ probation_update

def test_probation_after_the_audits_and_the_notes_of_those_still_on_it():
    failed, passed = WorkVerdict(16, problem="committed page 3 failed its audit"), WorkVerdict(16)
    after, notes = R.probation_update({"old": 12, "gone": 4}, {"cheat": failed, "old": passed, "new": None,
                                                               "gone": None}, round_no=5)
    assert after == {"old": 12, "cheat": 5 + PROBATION_ROUNDS}  # expired entries are dropped
    # caught now: its note is the audit's problem, not a probation note; unaudited ones are noted too
    assert notes == {"old": "on probation until round 12 (an audit or a round proved it cheated)"}
    # caught again while on probation: extended, and noted by the audit instead
    after, notes = R.probation_update(after, {"old": failed}, round_no=6)
    assert after["old"] == 6 + PROBATION_ROUNDS and notes == {}
    # an empty round changes nothing but expiry
    assert R.probation_update({"x": 9}, {}, round_no=3) == ({"x": 9}, {})
    assert R.probation_update({}, {}, round_no=3) == ({}, {})


def test_a_miner_on_probation_not_audited_this_round_is_still_noted():
    after, notes = R.probation_update({"m": 8}, {"m": None}, round_no=5)
    assert after == {"m": 8} and notes["m"].startswith("on probation until round 8")


# ------------------------------------------------------------------ the per-miner verdict

def test_moved_on_streak_counts_consecutive_rounds_only():
    assert R.moved_on_streak(0, True) == 1
    assert R.moved_on_streak(2, True) == 3
    assert R.moved_on_streak(5, False) == 0


def test_round_outcome_is_the_swarms_or_says_whether_the_miner_was_reachable():
    assert R.round_outcome(PeerResult("p", Outcome.WRONG_MODEL), reachable=True) is Outcome.WRONG_MODEL
    assert R.round_outcome(PeerResult("p", Outcome.SUCCESS), reachable=False) is Outcome.SUCCESS
    assert R.round_outcome(None, reachable=True) is Outcome.NON_PARTICIPATING
    assert R.round_outcome(None, reachable=False) is Outcome.NOT_ALIVE


def test_miner_note_keeps_the_first_problem_and_names_why_a_round_did_not_count():
    assert R.miner_note("", Outcome.SUCCESS, "", excused=False) == ""
    assert R.miner_note("bad sketch", Outcome.FAIL, "lost part", excused=False) == "bad sketch"
    assert R.miner_note("", Outcome.FAIL, "lost part", excused=False) == "lost part"
    assert R.miner_note("", Outcome.NOT_ALIVE, "", excused=False) == "did not join the all-reduce"
    assert R.miner_note("moved to epoch 5", Outcome.NON_PARTICIPATING, "", excused=True) == \
        "moved to epoch 5; not scored this round"


def _verdict(**kw):
    args = {"result": PeerResult("p", Outcome.SUCCESS, 64.0), "claimed_weight": 64.0, "reachable": True,
            "status_epoch": 4, "our_epoch": 4, "checks": [OK, OK], "note": "", "moved_on": False, "moved_on_before": 0,
            "shared_peer_id": False, "work": WorkVerdict(64), "slice_bps": 1e7, "probation": False}
    return R.miner_verdict(**{**args, **kw})


def test_an_honest_miner_is_scored_on_everything_measured():
    v = _verdict()
    assert v.outcome is Outcome.SUCCESS and v.note == "" and v.moved_on_streak == 0
    assert v.scoring.train is not None and v.scoring.train.verified_samples == 64
    assert score_round({1: v.scoring})[1].combined > 0.99


def test_a_reachable_miner_without_a_train_answer_is_gated_not_unmeasured():
    v = _verdict(result=None, claimed_weight=None, checks=[], note="timeout")
    assert v.outcome is Outcome.NON_PARTICIPATING and v.note == "timeout"
    assert v.scoring.train is not None and v.scoring.train.checks == []
    assert score_round({1: v.scoring})[1].combined == 0.0


def test_a_miner_ahead_of_us_or_unreachable_is_scored_by_its_outcome_only():
    ahead = _verdict(result=None, claimed_weight=None, status_epoch=5, checks=[])
    assert ahead.scoring.train is None and ahead.scoring.outcome is Outcome.NON_PARTICIPATING
    gone = _verdict(result=None, claimed_weight=None, reachable=False, status_epoch=None, checks=[])
    assert gone.outcome is Outcome.NOT_ALIVE and gone.scoring.train is None
    assert gone.note == "did not join the all-reduce"
    # a reachable miner without an epoch counts as at epoch 0: not ahead, so gated
    assert _verdict(result=None, claimed_weight=None, status_epoch=None, checks=[]).scoring.train is not None


def test_a_miner_that_moved_on_and_missed_our_group_is_excused_a_few_rounds():
    v = _verdict(result=None, claimed_weight=None, checks=[], moved_on=True, note="moved to epoch 5")
    assert v.moved_on_streak == 1 and v.note == "moved to epoch 5; not scored this round"
    assert v.scoring.train is None and v.scoring.outcome is None
    assert score_round({1: v.scoring})[1].combined is None  # the round says nothing about it
    # the excuse runs out
    late = _verdict(result=None, claimed_weight=None, checks=[], moved_on=True, moved_on_before=MAX_OVERTAKEN_IN_A_ROW)
    assert late.moved_on_streak == MAX_OVERTAKEN_IN_A_ROW + 1 and late.scoring.outcome is Outcome.NON_PARTICIPATING
    assert score_round({1: late.scoring})[1].combined == 0.0
    # a cheat our round refused for its contribution, caught up after the refusal: scored FAIL
    refused = _verdict(result=PeerResult("m1", Outcome.FAIL, 64.0, reason="contribution does not match its "
                                         "committed pages (sketch error 10)", proven=True),
                       moved_on=True, note="contribution does not match its committed pages")
    assert refused.scoring.outcome is Outcome.FAIL and "not scored" not in refused.note
    assert score_round({1: refused.scoring})[1].combined == 0.0
    # one that averaged our epoch with us cannot have moved on before our checks
    liar = _verdict(moved_on=True, checks=[BAD])
    assert liar.scoring.outcome is Outcome.SUCCESS and score_round({1: liar.scoring})[1].combined == 0.0


def test_probation_and_claims_reach_the_scoring_input():
    v = _verdict(probation=True)
    assert GATE_PROBATION in score_round({1: v.scoring})[1].gated
    # the claimed weight is checked against the verified samples
    assert _verdict(claimed_weight=1000.0).scoring.train.claimed_samples == 1000
    assert _verdict(claimed_weight=None).scoring.train.claimed_samples == 0
