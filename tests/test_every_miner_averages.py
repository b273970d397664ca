"""Every miner averages every round, whichever miners the validators check: when a miner joins
(round notices on the DHT), whom a validator expects and checks, and how
sampled checks are paid and penalised (docs/protocol.md "AllReduce", docs/scoring.md "Sampled
checks")."""

from __future__ import annotations

import math
import random
import time

import pytest

from dtrain.neurons.round_joining import TRIED_KEPT, CatchUp, Join, RoundJoining
from dtrain.swarm.progress import PeerProgress
from dtrain.swarm.round_notices import RoundNotice
from dtrain.validation import round_rules as R
from dtrain.validation.scoring import EmaState, forfeit, update_ema
from dtrain.validation.verification import PROBATION_ROUNDS, probation_rounds
from tests.test_validation_round_rules import Commit, Neuron  # the chain's neuron and commitment, as data


def notice(epoch: int, round_id: str = "run-1-1", announcer: str = "V1") -> RoundNotice:
    return RoundNotice(announcer, epoch, round_id)


# ------------------------------------------------------------------ when a miner joins

def test_a_miner_joins_once_per_notice_for_its_epoch_and_catches_up_to_a_later_one():
    j = RoundJoining(min_gap_s=1.0, now=0.0)
    assert j.decide(5, [], now=0.5) is None  # nothing announced: miners never start a round alone
    assert j.decide(5, [], now=1e6) is None
    assert j.decide(5, [notice(4)], now=2.0) is None  # an older round: not ours
    assert j.decide(5, [notice(5, "run-5-7")], now=2.0) == Join("run-5-7", "V1")
    j.attempted(now=3.0)
    assert j.decide(5, [notice(5, "run-5-7")], now=10.0) is None  # the same notice is joined once
    # a second validator's notice for the same epoch (its round failed, or it came late)
    assert j.decide(5, [notice(5, "run-5-7"), notice(5, "run-5-8", "V2")], now=10.0) == Join("run-5-8", "V2")
    j.attempted(now=11.0)
    # behind: a round of a later epoch would refuse its contribution; it catches up instead
    assert j.decide(5, [notice(9, "run-9-1")], now=20.0) == CatchUp(9)
    assert j.decide(5, [notice(9, "run-9-2", "V2")], now=20.5) is None  # one catch-up per gap
    assert j.decide(5, [notice(9, "run-9-1")], now=30.0) is None  # once per notice
    # the same validator's round id at the next epoch is a new notice
    assert j.decide(6, [notice(6, "run-5-7")], now=40.0) == Join("run-5-7", "V1")


def test_joins_are_at_least_min_gap_apart_so_forged_notices_cost_one_attempt_per_gap():
    j = RoundJoining(min_gap_s=5.0, now=0.0)
    flood = [notice(3, f"forged-{i}", f"P{i}") for i in range(50)]
    joined = []
    for t in range(0, 60):
        decision = j.decide(3, flood, now=float(t))
        if decision is not None:
            joined.append(t)
            j.attempted(now=float(t))
    assert joined[0] == 0  # the first notice is joined at once
    assert all(b - a >= 5 for a, b in zip(joined, joined[1:])), joined
    assert len(j._tried) <= TRIED_KEPT


# ------------------------------------------------------------------ round notices on a real DHT

def test_round_notices_travel_over_the_dht_and_junk_is_ignored():
    from dtrain.swarm.loopback import local_nodes
    from dtrain.swarm.round_notices import RoundNotices

    with local_nodes(2) as nodes:
        assert nodes[1].ensure_connected(timeout_s=10) >= 1
        ours, theirs = RoundNotices(nodes[0].dht, "ntest"), RoundNotices(nodes[1].dht, "ntest")
        assert ours.announce(7, "sandbox-7-3", expiration_s=300)
        for junk in ("not-a-dict", {"epoch": -1, "round": "x"}, {"epoch": 1, "round": "bad id!"},
                     {"epoch": True, "round": "x"}):
            nodes[0].dht.store("ntest_round", subkey=f"junk{junk!r}"[:40], value=junk,
                               expiration_time=time.time() + 300)
        deadline = time.monotonic() + 60
        while True:
            seen = theirs.current()
            if seen or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert seen == [RoundNotice(nodes[0].peer_id, 7, "sandbox-7-3")]
        with pytest.raises(ValueError, match="expiration_s"):
            ours.announce(1, "r", expiration_s=math.nan)


# ------------------------------------------------------------------ whom a validator expects and checks

def test_a_validator_expects_every_committed_miner_whose_progress_shows_its_epoch():
    progress = [PeerProgress("A", 4, 64, 1.0, 0.0), PeerProgress("B", 4, 0, 0.0, 0.0),
                PeerProgress("C", 3, 64, 1.0, 0.0),  # behind: it catches up instead of joining
                PeerProgress("X", 4, 64, 1.0, 0.0)]  # not a committed miner: a forged record
    assert R.live_miners(progress, {"A", "B", "C"}, 4) == {"A", "B"}


def test_checks_rotate_so_every_miner_is_checked_within_miners_over_count_rounds():
    neurons = [Neuron(i, f"m{i}") for i in range(1, 13)] + [Neuron(0, "me", True)]
    commitments = {n.hotkey: Commit(f"a:{n.uid}", f"P{n.uid}") for n in neurons}
    last: dict[str, int] = {}
    rng = random.Random(7)
    seen_by_round = []
    for round_no in range(1, 9):
        targets = R.select_targets(neurons, commitments, "me", 3, rng, last)
        assert len(targets) == 3 and len({t.uid for t in targets}) == 3
        last.update({t.hotkey: round_no for t in targets})
        seen_by_round.append({t.uid for t in targets})
    # every 12 / 3 = 4 rounds, each of the 12 miners exactly once
    assert set().union(*seen_by_round[:4]) == set(range(1, 13))
    assert set().union(*seen_by_round[4:]) == set(range(1, 13))
    # the order among equals is drawn, not fixed
    firsts = {tuple(sorted(t.uid for t in R.select_targets(neurons, commitments, "me", 3, random.Random(s), {})))
              for s in range(10)}
    assert len(firsts) > 1


def test_later_audits_are_drawn_among_the_unchecked_members_only():
    members = [f"P{i}" for i in range(10)]
    checked = {"P0", "P1", "P2"}
    draws = [R.later_audits(members, checked, 2, random.Random(s)) for s in range(50)]
    assert all(len(d) == 2 and not set(d) & checked and set(d) <= set(members) for d in draws)
    assert len({tuple(sorted(d)) for d in draws}) > 5
    assert R.later_audits(members, set(members), 2, random.Random(0)) == []
    assert sorted(R.later_audits(members, checked, 99, random.Random(0))) == sorted(set(members) - checked)


def test_a_validator_in_step_with_its_round_never_resynchronises_toward_stale_checked_miners():
    from dtrain.training.replica import REPLICA_RTOL

    far = REPLICA_RTOL * 10
    # the case: both checked miners are stale replicas that sat a round out
    assert R.drifted_alone([far, far], [False, False], in_step=True) is None
    # after a resume or a catch-up (not in step) the majority rule still heals the validator
    assert R.drifted_alone([far, far], [False, False], in_step=False) == R.Drift(2, 2)


# ------------------------------------------------------------------ pay per verified sample, penalties

def test_a_miner_checked_less_often_is_paid_the_same_per_verified_score():
    hotkeys = {1: "often", 2: "rarely", 3: "once"}
    state = EmaState()
    for round_no in range(1, 13):
        scores = {1: 0.8}
        if round_no % 4 == 0:
            scores[2] = 0.8
        if round_no == 12:
            scores[3] = 0.8
        state = update_ema(state, scores, hotkeys, alpha=0.5)
    paid = state.paid()
    assert paid[1] == pytest.approx(0.8) and paid[2] == pytest.approx(0.8) and paid[3] == pytest.approx(0.8)
    # the raw EMA would have paid the rarely checked less
    assert state.scores[3] < state.scores[1]


def test_a_failed_audit_forfeits_what_a_miner_earned_and_it_climbs_back_slowly():
    hotkeys = {1: "cheat", 2: "honest"}
    state = EmaState()
    for _ in range(10):
        state = update_ema(state, {1: 1.0, 2: 1.0}, hotkeys, alpha=0.1)
    state = update_ema(forfeit(state, [1]), {1: 0.0, 2: 1.0}, hotkeys, alpha=0.1)
    assert state.paid()[1] == 0.0 and state.paid()[2] == pytest.approx(1.0)
    state = update_ema(state, {1: 1.0, 2: 1.0}, hotkeys, alpha=0.1)
    assert state.paid()[1] < 0.2  # one honest check does not undo the forfeit
    # a new owner of the uid starts afresh: no inherited mass or score
    fresh = update_ema(state, {1: 0.5}, {1: "new owner", 2: "honest"}, alpha=0.1)
    assert fresh.paid()[1] == pytest.approx(0.5)


def test_probation_lasts_as_many_of_the_miners_own_checks_whatever_the_sampling_rate():
    assert probation_rounds(8, 8) == PROBATION_ROUNDS
    assert probation_rounds(12, 3) == 4 * PROBATION_ROUNDS
    assert probation_rounds(200, 8) == 25 * PROBATION_ROUNDS
    assert probation_rounds(0, 0) == PROBATION_ROUNDS


def test_a_state_written_before_the_mass_was_kept_loads_as_warmed_up(tmp_path):
    from dtrain.validation.state import ValidatorState, load_state, save_state

    state = ValidatorState(ema=update_ema(EmaState(), {1: 0.6}, {1: "hk"}, alpha=0.5))
    path = tmp_path / "state.json"
    save_state(path, state)
    again = load_state(path)
    assert again.ema.paid() == pytest.approx({1: 0.6}) and again.ema.mass == {1: 0.5}
    old = state.to_json()
    del old["ema_mass"]
    legacy = ValidatorState.from_json(old, path)
    assert legacy.ema.paid() == pytest.approx({1: 0.3})  # the raw EMA, as before


def test_a_checked_miner_that_sat_the_round_out_is_not_scored_on_it_a_few_times_in_a_row():
    from dtrain.validation.scoring import score_round

    def verdict(streak_before: int, result=None):
        return R.miner_verdict(result=result, claimed_weight=None, reachable=True, status_epoch=3, our_epoch=4,
                               checks=[], note="miner is at epoch 3, the query is for epoch 4", moved_on=False,
                               moved_on_before=streak_before, shared_peer_id=False, work=None, slice_bps=None,
                               probation=False)

    first = verdict(0)
    assert first.moved_on_streak == 1 and first.note.endswith("not scored this round")
    assert score_round({1: first.scoring})[1].combined is None  # its EMA keeps its value
    # behind round after round: scored (0) after a few, so falling behind never shelters a miner
    later = verdict(3)
    assert score_round({1: later.scoring})[1].combined == 0.0


# ------------------------------------------------------------------ faults the round itself proves

def test_a_member_refused_for_its_own_gather_is_marked_proven_but_not_one_of_another_epoch():
    from dtrain.swarm.averaging.contribution import OTHER_EPOCH
    from dtrain.swarm.averaging.group_rules import GroupPlan
    from dtrain.swarm.averaging.report import refused_for_its_gather

    plan = GroupPlan(peer_ids=["V", "A", "B", "C", "D", "E"], me=0, mine={}, roles=["node"] * 6,
                     claimed=[0, 64, 64, 64, 64, 1e6], used=[0] * 6, compatible=[True, True, True, True, False, True],
                     norms=[0.0] * 6, out_of_scale={2},
                     unbound={3: OTHER_EPOCH, 5: "claims weight 1e+06 but committed 64 samples"})
    assert [refused_for_its_gather(plan, i) for i in range(6)] == [False, False, True, False, False, True]


def test_the_validator_penalises_unchecked_members_its_record_proves_at_fault():
    from dtrain.neurons.validation_audit import Probe, caught, proven_faults
    from dtrain.swarm.records import Outcome, PeerResult, RoundRecord

    record = RoundRecord(round_id="g", local_peer_id="V", started_at=0.0, duration_s=1.0, group=["V", "A", "B", "C"],
                         peers=[PeerResult("V", Outcome.SUCCESS), PeerResult("A", Outcome.SUCCESS),
                                PeerResult("B", Outcome.FAIL, 64, 0, "contribution does not match its committed "
                                           "pages (sketch error 1)", proven=True),
                                PeerResult("C", Outcome.FAIL, 64, 0, "banned as sender (timeout, disconnect or "
                                           "protocol error)")])
    again = RoundRecord.from_dict(record.to_dict())
    assert [p.proven for p in again.peers] == [False, False, True, False]
    miners = {peer: R.Target(uid=i, hotkey=f"h{peer}", api=f"a:{i}", peer_id=peer)
              for i, peer in enumerate(["A", "B", "C"], start=1)}
    found = proven_faults(again, miners, checked={"A"})
    assert [p.uid for p in found] == [2] and not found[0].work.passed  # a timeout proves nothing
    assert proven_faults(again, miners, checked={"B"}) == []  # a checked one is judged by its checks
    # a reducer our round audit proved at fault with committed bytes, unchecked: the same
    from types import SimpleNamespace

    audit = SimpleNamespace(problems={"C": "returned part 3 that is not the combination its account states",
                                      "A": "did not answer the round audit"}, proven={"C"})
    assert [(p.uid, p.note) for p in proven_faults(again, miners, checked={"B"}, audit=audit)] == [
        (3, "round audit: returned part 3 that is not the combination its account states")]
    checked_b = Probe.of(miners["B"])
    assert caught([checked_b, Probe.of(miners["A"])], again) == [2]


def test_a_miner_on_probation_is_noted_so_even_when_checked_while_behind():
    # caught unchecked in an earlier round, checked later while behind: the note leads with
    # the probation (why it earns nothing for rounds), then the round's own problem
    from dtrain.neurons.validation_round import Probe, update_probation
    from dtrain.swarm.records import RoundRecord
    from dtrain.validation.verification import WorkVerdict

    behind, fresh, caught_now = (Probe.of(R.Target(uid=i, hotkey=f"h{i}", api=f"a:{i}", peer_id=f"P{i}"))
                                 for i in (1, 2, 3))
    behind.note = "a:1: miner is at epoch 1, the query is for epoch 2"
    caught_now.work = WorkVerdict(committed_samples=0, problem="committed page 7 failed its audit")
    caught_now.note = "committed page 7 failed its audit"
    no_round = RoundRecord(round_id="", local_peer_id="V", started_at=0.0, duration_s=0.0)
    after = update_probation([behind, fresh, caught_now], no_round, {"h1": 9, "h2": 8}, round_no=3, rounds=5)
    assert after == {"h1": 9, "h2": 8, "h3": 8}
    assert behind.note == ("on probation until round 9 (an audit or a round proved it cheated); "
                           "a:1: miner is at epoch 1, the query is for epoch 2")
    assert fresh.note == "on probation until round 8 (an audit or a round proved it cheated)"
    assert caught_now.note == "committed page 7 failed its audit"  # the audit's own problem says it


def test_a_checked_miner_the_round_refused_for_its_gather_goes_on_probation_like_an_unchecked_one():
    # its pages were real (the work audit passes) but what it sent was not their mean: the
    # record's proof is enough, checked or not (docs/scoring.md, "Sampled checks")
    from dtrain.neurons.validation_round import Probe, update_probation
    from dtrain.swarm.records import Outcome, PeerResult, RoundRecord
    from dtrain.validation.verification import WorkVerdict

    record = RoundRecord(round_id="g", local_peer_id="V", started_at=0.0, duration_s=1.0, group=["V", "P1", "P2"],
                         peers=[PeerResult("V", Outcome.SUCCESS),
                                PeerResult("P1", Outcome.FAIL, 64, 0, "contribution does not match its committed "
                                           "pages (sketch error 1)", proven=True),
                                PeerResult("P2", Outcome.FAIL, 64, 0, "banned as sender (timeout)")])
    sender, slow = (Probe.of(R.Target(uid=i, hotkey=f"h{i}", api=f"a:{i}", peer_id=f"P{i}")) for i in (1, 2))
    sender.work = slow.work = WorkVerdict(committed_samples=64)
    after = update_probation([sender, slow], record, {}, round_no=4, rounds=10)
    assert after == {"h1": 14}  # a timeout proves nothing
    assert R.probation_update({}, {"h": None}, round_no=2, refused={"h"}) == ({"h": 2 + PROBATION_ROUNDS}, {})


def test_a_checked_miner_is_judged_at_the_rounds_epoch_not_the_validators_after_its_step():
    # the validator scores after taking the round's step: against that epoch every miner would
    # read as behind, and a refused one would be excused instead of scored FAIL
    from dtrain.api.messages import StatusResponse
    from dtrain.neurons.validation_round import Probe, assess
    from dtrain.swarm.records import Outcome, PeerResult, RoundRecord
    from dtrain.validation.scoring import MicroBatchCheck

    record = RoundRecord(round_id="g", local_peer_id="V", started_at=0.0, duration_s=1.0, group=["V", "P1"],
                         peers=[PeerResult("V", Outcome.SUCCESS),
                                PeerResult("P1", Outcome.FAIL, 64, 0, "contribution does not match its committed "
                                           "pages (sketch error 1)", proven=True)])
    probe = Probe.of(R.Target(uid=1, hotkey="h1", api="a:1", peer_id="P1"))
    probe.status = StatusResponse(epoch=5)
    probe.checks = [MicroBatchCheck(passed=True, similarity=0.9999, loss_rel_err=0.0)]
    inputs, streaks = assess([probe], record, epoch=5, probation={}, round_no=3, moved_on_streaks={})
    assert probe.outcome == "FAIL" and "not scored" not in probe.note and streaks == {}
    assert inputs[1].outcome == Outcome.FAIL  # scored on its FAIL
    # behind the round's epoch and out of the group: that one is excused (it sat the round out)
    probe = Probe.of(R.Target(uid=1, hotkey="h1", api="a:1", peer_id="P9"))
    probe.status = StatusResponse(epoch=4)
    inputs, streaks = assess([probe], record, epoch=5, probation={}, round_no=3, moved_on_streaks={})
    assert "not scored" in probe.note and streaks == {"h1": 1} and inputs[1].outcome is None


def test_the_allreduce_query_gives_unchecked_miners_the_full_cap_unless_on_probation():
    from dtrain.neurons.validation_round import Probe, allreduce_request
    from dtrain.validation.scoring import MicroBatchCheck

    good, bad = (Probe.of(R.Target(uid=i, hotkey=f"h{i}", api=f"a:{i}", peer_id=f"P{i}")) for i in (1, 2))
    good.checks = [MicroBatchCheck(passed=True, similarity=0.9999, loss_rel_err=0.0)]
    bad.checks = [MicroBatchCheck(passed=False, similarity=0.2, loss_rel_err=0.5)]
    request = allreduce_request([good, bad], run_id="r", epoch=3, round_no=7, digest="ab", weight_cap=64.0,
                                deadline_s=60.0, probation={"h4": 9},
                                unchecked={"P1": "h1", "P2": "h2", "P3": "h3", "P4": "h4"})
    # checked: what we verified; unchecked: the full cap (bound by its commitment), 0 on probation
    assert request.weight_caps == {"P1": 64.0, "P2": 0.0, "P3": 64.0, "P4": 0.0}


def test_a_round_joined_from_a_notice_counts_only_with_its_announcer_in_the_group():
    from types import SimpleNamespace

    from dtrain.neurons.miner_rounds import MinerRounds
    from dtrain.swarm.records import RoundRecord

    rounds = MinerRounds(miner=SimpleNamespace())
    late_group = RoundRecord(round_id="g2", local_peer_id="M", started_at=0.0, duration_s=1.0, group=["M", "M2"])
    validators_group = RoundRecord(round_id="g1", local_peer_id="M", started_at=0.0, duration_s=1.0,
                                   group=["V1", "M", "M2"])
    assert rounds.witnessed(late_group)  # a validator's query asked us in: no condition
    rounds.announcer = "V1"
    assert not rounds.witnessed(late_group) and rounds.witnessed(validators_group)
    rounds.finished()
    assert rounds.announcer is None and rounds.witnessed(late_group)


def test_an_unwitnessed_round_is_marked_failed_so_its_step_is_not_taken():
    from types import SimpleNamespace

    from dtrain.neurons.miner_rounds import MinerRounds
    from dtrain.swarm.records import Outcome, PeerResult, RoundRecord

    rounds = MinerRounds(miner=SimpleNamespace())
    rounds.announcer = "V1"
    record = RoundRecord(round_id="g2", local_peer_id="M", started_at=0.0, duration_s=1.0, group=["M", "M2"],
                         peers=[PeerResult("M", Outcome.SUCCESS), PeerResult("M2", Outcome.SUCCESS)],
                         fraction_averaged=1.0)
    assert record.ok
    rounds.vet(record)
    assert not record.ok and "not in this group" in record.error


def test_a_miner_never_runs_the_same_round_twice_whatever_its_result():
    # a checked miner joins from the notice and then gets the validator's query for the same
    # round: run again after its group was gone, its matchmaking led a group at the wrong epoch
    # that caught the next round's peers (seen in CI: the validator missed its miners' group)
    from dtrain.api.messages import AllReduceRequest, AllReduceResponse
    from dtrain.neurons.miner_rounds import MinerRounds

    rounds = MinerRounds(miner=None)
    query = AllReduceRequest(round_id="sandbox-1-2", epoch=1, weight_cap=64.0, deadline_s=30.0)
    assert rounds.answered(query, epoch=1) is None  # nothing run yet
    refused = AllReduceResponse(joined=True, epoch=1, round={"round_id": "g1", "error": ""})
    rounds.ran(query, refused, applied=False)  # the group refused its contribution: still at epoch 1
    assert rounds.answered(query, epoch=1) is refused
    # the next round, at the same epoch (it failed to catch up), is a new round: run it
    assert rounds.answered(AllReduceRequest(round_id="sandbox-1-3", epoch=1, weight_cap=64.0, deadline_s=30.0),
                           epoch=1) is None
    # a round it stepped on answers another validator's query for that epoch, not a later one
    stepped = AllReduceResponse(joined=True, epoch=2, round={"round_id": "g2", "error": ""})
    rounds.ran(AllReduceRequest(round_id="v1-2", epoch=1, weight_cap=64.0, deadline_s=30.0), stepped, applied=True)
    other = AllReduceRequest(round_id="v2-7", epoch=1, weight_cap=64.0, deadline_s=30.0)
    assert rounds.answered(other, epoch=2) is stepped
    assert rounds.answered(AllReduceRequest(round_id="v2-8", epoch=2, weight_cap=64.0, deadline_s=30.0),
                           epoch=2) is None


def test_the_audit_asks_a_restarted_miner_where_it_serves_now():
    # restarted after the round began (seen in the chaos e2e): same hotkey and peer id, a new
    # API port; the round audit sent to the old one read as withheld and put it on probation
    from dtrain.neurons.validation_audit import Probe, follow_restarts

    restarted = Probe.of(R.Target(uid=1, hotkey="h1", api="127.0.0.1:1000", peer_id="P1", shared_peer_id=True))
    steady = Probe.of(R.Target(uid=2, hotkey="h2", api="127.0.0.1:2000", peer_id="P2"))
    gone = Probe.of(R.Target(uid=3, hotkey="h3", api="127.0.0.1:3000", peer_id="P3"))
    now = {"P1": R.Target(uid=1, hotkey="h1", api="127.0.0.1:1111", peer_id="P1"),
           "P2": R.Target(uid=2, hotkey="h2", api="127.0.0.1:2000", peer_id="P2"),
           "P3": R.Target(uid=9, hotkey="other", api="127.0.0.1:9999", peer_id="P3")}  # another hotkey's claim
    follow_restarts([restarted, steady, gone], now)
    assert restarted.api == "127.0.0.1:1111" and restarted.target.shared_peer_id  # only the address changes
    assert steady.api == "127.0.0.1:2000"
    assert gone.api == "127.0.0.1:3000"  # a peer id committed by another hotkey is not followed


def test_a_round_that_is_not_scored_leaves_its_miners_first_in_line():
    # 9 miners, 3 a round: an overtaken round (chosen, never scored) must not cost its three
    # their turn, or a 3-round run never checks them (an honest one then ends at weight 0).
    neurons = [Neuron(i, f"m{i}") for i in range(1, 10)] + [Neuron(0, "me", True)]
    commitments = {n.hotkey: Commit(f"a:{n.uid}", f"P{n.uid}") for n in neurons}
    rotation = R.CheckRotation()
    rng = random.Random(3)
    first = rotation.choose(neurons, commitments, "me", 3, rng)
    rotation.scored(first, 1)
    overtaken = rotation.choose(neurons, commitments, "me", 3, rng)
    assert not {t.uid for t in overtaken} & {t.uid for t in first}
    checked = {t.uid for t in first}
    for round_no in (2, 3):
        targets = rotation.choose(neurons, commitments, "me", 3, rng)
        rotation.scored(targets, round_no)
        checked |= {t.uid for t in targets}
    assert checked == set(range(1, 10))
