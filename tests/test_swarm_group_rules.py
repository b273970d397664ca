"""dtrain's group rules as pure functions of gathered data (dtrain/swarm/averaging/group_rules.py),
and the round report they end in (report.py).

No peers and no hivemind objects: a group is a list of gathers, as every member receives them.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dtrain.swarm.averaging import group_rules as gr
from dtrain.swarm.averaging.contribution import OTHER_EPOCH, Commitment
from dtrain.swarm.averaging.report import Figures, Verdicts, build_report, sit_out_report
from dtrain.swarm.records import Outcome
from dtrain.sketch import WORK_SKETCH_K
from dtrain.training.work import PageWork, WorkReport, work_nonce

NONCE = work_nonce("rules", 4)
PARTS = 3


def gather(*, w=8.0, cap=100.0, norm=1.0, fp="model-a", schema="s1", ratio=10.0, caps=None, commit=None,
           req=True, agg="mean", comp="none"):
    return gr.make_gather(fingerprint=fp, schema=schema, weight=w, cap=cap, norm=norm, max_norm_ratio=ratio,
                          peer_caps=caps, aggregation=agg, compression=comp, require_commitments=req,
                          commitment=commit)


def ids(n):
    return [f"peer{i}" for i in range(n)]


def plan(users, me=0, roles=None):
    return gr.plan_group(ids(len(users)), me, users, roles or ["node"] * len(users))


def round_report(p, round_id="r", *, total_size=0, failed_size=0, bytes_sent=0, bytes_received=0, **verdicts):
    return build_report(p, round_id, Verdicts(**verdicts),
                        Figures(total_size=total_size, failed_size=failed_size, bytes_sent=bytes_sent,
                                bytes_received=bytes_received))


def outcomes(report):
    return [x.outcome.value for x in report.peers]


# -- model check and caps ----------------------------------------------------------------------


def test_a_peer_of_another_model_or_schema_is_aux_and_wrong_model():
    users = [gather(), gather(fp="model-b"), gather(schema="s2"), {**gather(), "v": 99}, "not a gather", gather()]
    p = plan(users)
    assert p.compatible == [True, False, False, False, False, True]
    assert p.roles == ["node", "aux", "aux", "aux", "aux", "node"]
    assert p.used == [8.0, 0.0, 0.0, 0.0, 0.0, 8.0]
    assert p.senders == [0, 5]
    report = round_report(p)
    assert outcomes(report) == ["SUCCESS"] + ["WRONG_MODEL"] * 4 + ["SUCCESS"]
    assert report.peers[1].reason == "model fingerprint or tensor schema (shapes, dtypes, part size) differs"
    assert "another dtrain release" in report.peers[3].reason


def test_a_peer_on_another_wire_codec_is_refused_naming_both_codecs():
    """A versioned wire: a peer that would send parts we cannot decode (or decode as something
    else) never averages; its record names its codec and ours, on both sides."""
    from dtrain.swarm.codecs import wire_format

    users = [gather(comp="8bit"), gather(comp="ternary"), gather(comp="8bit"), {**gather(comp="8bit"), "wire": None}]
    p = plan(users)
    assert p.compatible == [True, False, True, False]
    assert p.senders == [0, 2] and p.used[1] == 0.0
    report = round_report(p)
    assert outcomes(report) == ["SUCCESS", "WRONG_MODEL", "SUCCESS", "WRONG_MODEL"]
    reason = report.peers[1].reason
    assert wire_format("ternary") in reason and wire_format("8bit") in reason, reason
    assert "ternary/128/5-per-byte/v1" in reason and "blockwise-absmax-int8/64" in reason
    # the ternary peer's own view: it refuses the 8-bit ones, naming both the other way round
    theirs = round_report(plan(users, me=1))
    assert outcomes(theirs)[0] == "WRONG_MODEL"
    assert theirs.peers[0].reason.index("int8") < theirs.peers[0].reason.index("ternary")
    # an older release's gather (another version) is refused as such, not as another codec
    old = round_report(plan([gather(), {**gather(), "v": gr.GATHER_VERSION - 1}]))
    assert "another dtrain release" in old.peers[1].reason


def test_an_unknown_mode_is_an_error_only_for_a_compatible_peer():
    p = plan([gather(), gather(fp="other")], roles=["node", None])
    assert p.roles == ["node", "aux"]
    with pytest.raises(ValueError, match="unknown averaging mode"):
        plan([gather(), gather()], roles=["node", None])


def test_weights_are_capped_by_the_reducer_not_the_sender():
    # claimed 1, 3, 1000 and 0 (a validator), with this peer's cap 4
    users = [gather(w=1, cap=4), gather(w=3), gather(w=1000, cap=1e9), gather(w=0)]
    p = plan(users)
    assert p.claimed == [1.0, 3.0, 1000.0, 0.0]
    assert p.used == [1.0, 3.0, 4.0, 0.0]
    assert p.sender_weights == [1.0, 3.0, 4.0, 0.0]


def test_per_peer_caps_override_the_default_cap_and_bad_ones_are_dropped():
    caps = {"peer1": 0.0, "peer2": 2.5, "peer3": math.nan, "peer4": -1.0, "peer5": "x"}
    mine = gather(cap=100, caps=caps)
    assert mine["caps"] == {"peer1": 0.0, "peer2": 2.5}
    p = plan([mine] + [gather(w=8)] * 5)
    assert p.used == [8.0, 0.0, 2.5, 8.0, 8.0, 8.0]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0, "8", None])
def test_a_malformed_weight_counts_as_zero(bad):
    users = [gather(), {**gather(), "w": bad}]
    assert plan(users).claimed[1] == 0.0


def test_caps_of_other_peers_are_not_ours():
    # a hostile peer's gather lifts nobody's limit: only this peer's own caps count
    users = [gather(cap=1), gather(w=50, caps={"peer1": 1e9})]
    assert plan(users).used == [1.0, 1.0]


# -- scale check -----------------------------------------------------------------------------


def test_an_out_of_scale_contribution_is_excluded_against_the_weighted_median():
    # the validator's huge norm (weight 0) neither counts in the median nor is judged
    users = [gather(norm=1.0), gather(norm=2.0), gather(norm=25.0), gather(norm=1e9, w=0), gather(norm=19.9)]
    p = plan(users)
    assert p.out_of_scale == {2}
    assert p.roles[2] == "aux" and p.used[2] == 0.0
    assert p.roles[3] == "node"
    peer = round_report(p).peers[2]
    assert peer.outcome == Outcome.FAIL and peer.reason == "out-of-scale contribution (norm 25)"


def test_a_missing_norm_is_out_of_scale_and_ratio_zero_disables_the_check():
    users = [gather(norm=1.0), gather(norm=1.0), {**gather(), "norm": "big"}]
    assert plan(users).out_of_scale == {2}
    norms, bad = gr.scale_check(users, [True] * 3, [8.0] * 3, 0.0)
    assert bad == set() and norms[2] == math.inf


def test_two_peers_use_the_smaller_norm_as_reference():
    _, bad = gr.scale_check([gather(norm=1.0), gather(norm=10.5)], [True, True], [1.0, 1.0], 10.0)
    assert bad == {1}


def test_plan_bounds_for_the_runner():
    users = [gather(norm=3.0), gather(norm=4.0, w=0), gather(fp="x", norm=99.0)]
    p = plan(users)
    assert p.sender_norms == [3.0, 4.0] and p.max_norm == 4.0
    assert p.download_bandwidths([5.0, None, 7.0]) == [5.0, None, 0.0]
    assert p.receives and not p.robust
    assert plan([gather(agg="centered_clip")]).robust


# -- work commitments -------------------------------------------------------------------------


def report(samples=8, epoch=4, direction=None):
    """A report whose mean sketch is ``direction`` (two pages), and claims that add up to it."""
    direction = np.arange(1, WORK_SKETCH_K + 1, dtype=np.float64) if direction is None else direction
    total = direction * samples
    pages = (PageWork(page=1, counter=0, samples=3, loss=1.0, sketch=tuple(0.25 * total)),
             PageWork(page=2, counter=1, samples=samples - 3, loss=1.0, sketch=tuple(0.75 * total)))
    claims = np.zeros((PARTS, WORK_SKETCH_K), dtype="<f4")
    claims[0], claims[2] = 0.5 * direction, 0.5 * direction
    return WorkReport(epoch=epoch, pages=pages), claims


def commit(nonce=NONCE, claims=None, **kw):
    rep, honest = report(**kw)
    return Commitment.of_claims(nonce, rep, honest if claims is None else claims).to_gather()


def verdicts(users, me=0):
    p = plan(users, me)
    commitments, unbound = gr.check_commitments(users, p.mine, p.compatible, p.claimed, WorkReport)
    gr.apply_commitments(p, commitments, unbound)
    return p, commitments, unbound


def test_commitment_verdicts():
    lying = report()[1] * -1
    users = [
        gather(commit=commit()),  # this peer
        gather(commit=commit()),  # honest
        gather(w=16, commit=commit()),  # claims more than it committed
        gather(),  # no commitment
        gather(commit=commit(claims=lying)),  # claims that do not add up to its report
        gather(commit=commit(nonce=work_nonce("rules", 3))),  # another epoch
        gather(commit={**commit(), "root": b"short"}),  # malformed
        gather(w=0, commit=commit(nonce=work_nonce("rules", 5))),  # a validator of another epoch
        gather(w=0, commit=commit()),  # a validator of this epoch
        gather(fp="other", commit=commit(claims=lying)),  # another model: not judged here
    ]
    p, commitments, unbound = verdicts(users)
    assert set(commitments) == {0, 1, 2, 4, 5, 7, 8}
    assert unbound[2] == "claims weight 16 but committed 8 samples"
    assert unbound[3] == "no work commitment"
    assert unbound[4].startswith("contribution does not match its committed pages")
    assert unbound[5] == OTHER_EPOCH and unbound[7] == OTHER_EPOCH
    assert unbound[6].startswith("malformed work commitment:")
    assert set(unbound) == {2, 3, 4, 5, 6, 7}
    assert [p.roles[i] for i in range(10)] == ["node", "node"] + ["aux"] * 6 + ["node", "aux"]
    assert set(p.work_reports()) == {f"peer{i}" for i in (0, 1, 2, 4, 5, 7, 8)}
    assert p.claims_nonce == NONCE
    commits = p.sender_commitments
    assert len(commits) == len(p.senders) == 3 and all(c is not None for c in commits)
    # every sender that committed heads its streams with its claims; the others' streams do not
    assert p.senders_with_claims == [True, True, True]
    rep = round_report(p)
    assert outcomes(rep) == ["SUCCESS", "SUCCESS"] + ["FAIL"] * 6 + ["SUCCESS", "WRONG_MODEL"]
    assert rep.peers[3].reason == "no work commitment"


def test_without_required_commitments_an_uncommitted_peer_is_admitted():
    users = [gather(req=False, commit=commit()), gather(), gather(commit=commit(samples=4), w=8)]
    _, _, unbound = verdicts(users)
    assert unbound == {2: "claims weight 8 but committed 4 samples"}  # who commits is still bound


def test_a_peer_without_a_commitment_of_its_own_checks_none():
    p, commitments, unbound = verdicts([gather(), gather(commit=commit(claims=report()[1] * 0))])
    assert commitments is None and unbound == {} and p.sender_commitments is None and p.claims_nonce == ""
    # it does not check the other's claims, but reads them off the head of its stream all the same
    assert p.senders_with_claims == [False, True]


# -- sitting out -----------------------------------------------------------------------------


def test_a_peer_at_another_epoch_than_most_of_its_group_sits_out():
    stale = work_nonce("rules", 3)
    users = [gather(w=0, commit=commit(nonce=stale))] + [gather(commit=commit()) for _ in range(3)]
    p, _, _ = verdicts(users)
    reason = gr.out_of_step(p)
    assert reason == ("this peer is at another epoch than the group (3 of 3 peers committed under another "
                      "epoch's nonce)")
    rep = sit_out_report(p, "abcd", reason)
    assert rep.out_of_step == reason and rep.round_id == "abcd" and rep.fraction_averaged == 0.0
    assert [x.peer_id for x in rep.peers] == ["peer1", "peer2", "peer3"]  # not itself
    assert all(x.outcome == Outcome.FAIL and x.weight_used == 0.0 for x in rep.peers)
    assert set(rep.work_reports) == {"peer0", "peer1", "peer2", "peer3"}


def test_a_minority_at_another_epoch_does_not_make_the_majority_sit_out():
    users = [gather(commit=commit()), gather(commit=commit()), gather(w=0, commit=commit(nonce="x"))]
    p, _, unbound = verdicts(users)
    assert gr.out_of_step(p) is None and unbound == {2: OTHER_EPOCH}
    assert gr.out_of_step(plan([gather(), gather()])) is None  # no commitments: nothing to compare


# -- the round report ------------------------------------------------------------------------


def test_round_report_outcomes_reasons_and_figures():
    n = 9
    users = [gather(norm=1.0)] * n
    users[1] = gather(fp="other")
    users[2] = gather(norm=50.0)
    p = plan(users)
    gr.apply_commitments(p, None, {3: "no work commitment"})
    pid = ids(n)
    rep = round_report(p, "ff", contradicted={pid[4]}, too_large={pid[5]},
                       rejected={pid[4], pid[5], pid[6]}, banned={pid[4], pid[7]},
                       failed_reducers={pid[8]: "TimeoutError()", pid[0]: "never: it is us"},
                       bytes_sent=10, bytes_received=20, total_size=1000, failed_size=250)
    got = [(x.outcome.value, x.reason) for x in rep.peers]
    assert got == [
        ("SUCCESS", ""),
        ("WRONG_MODEL", "model fingerprint or tensor schema (shapes, dtypes, part size) differs"),
        ("FAIL", "out-of-scale contribution (norm 50)"),
        ("FAIL", "no work commitment"),
        ("FAIL", "sent a part that contradicts its commitment"),
        ("FAIL", "sent a part larger than its announced norm"),
        ("FAIL", "sent non-finite values"),
        ("FAIL", "banned as sender (timeout, disconnect or protocol error)"),
        ("FAIL", "did not deliver its averaged part: TimeoutError()"),
    ]
    assert [x.weight_used for x in rep.peers] == [8.0] + [0.0] * 8
    assert rep.total_weight == 8.0
    assert rep.fraction_averaged == 0.75
    assert rep.group == pid and rep.round_id == "ff"
    assert (rep.bytes_sent, rep.bytes_received) == (10, 20)
    assert rep.peers[0].outcome is Outcome.SUCCESS


def test_an_aux_peer_averaged_nothing():
    p = plan([gather(fp="mine-alone"), gather(fp="other"), gather(fp="other")], me=0)
    p.exclude(0)
    assert not p.receives
    assert round_report(p, total_size=10).fraction_averaged == 0.0


def test_gather_and_schema():
    g = gr.make_gather(fingerprint="fp", schema="s", weight=2, cap=3, norm=1.5, max_norm_ratio=10,
                       aggregation="centered_clip", compression="8bit", require_commitments=True,
                       expect=["b", "a"])
    assert g["v"] == gr.GATHER_VERSION and g["w"] == 2.0 and g["agg"] == "centered_clip" and g["req"] is True
    assert g["wire"] == "blockwise-absmax-int8/64" and g["comp"] == "8bit"
    assert g["expect"] == ["b", "a"] and "commit" not in g
    assert "expect" not in gather()
    a = gr.schema_hash([torch.zeros(3, 4), torch.zeros(5)], 2**17)
    assert a == gr.schema_hash([torch.ones(3, 4), torch.ones(5)], 2**17)  # shapes, not values
    assert a != gr.schema_hash([torch.zeros(4, 3), torch.zeros(5)], 2**17)
    assert a != gr.schema_hash([torch.zeros(3, 4, dtype=torch.float64), torch.zeros(5)], 2**17)


def test_a_member_that_never_started_the_round_is_told_from_one_that_failed_it():
    # peer1: never sent us a part, and its reducer answered "not in this group": a follower the
    # leader counted in after it had left matchmaking. peer2: never sent either, but its
    # reducer served (or timed out): it was in the round and failed it. peer3: started, then banned.
    p = plan([gather()] * 4)
    pid = ids(4)
    rep = round_report(p, banned={pid[1], pid[2], pid[3]}, never_started={pid[1], pid[2]},
                       failed_reducers={pid[1]: "AllreduceException('peer1 sent BAD_GROUP_ID')",
                                        pid[2]: "TimeoutError()"})
    got = [(x.outcome.value, x.reason) for x in rep.peers]
    assert got[1] == ("NON_PARTICIPATING",
                      "counted into the group after it had left matchmaking: it never started this round")
    assert got[2] == ("FAIL", "banned as sender (timeout, disconnect or protocol error)")
    assert got[3] == ("FAIL", "banned as sender (timeout, disconnect or protocol error)")
    assert [x.weight_used for x in rep.peers] == [8.0, 0.0, 0.0, 0.0]


# -- accountable reducers: each reducer's rule, and benching ----------------------------------


def test_each_reducers_weights_are_its_own_caps_over_our_senders():
    users = [gather(w=8.0, caps={"peer1": 2.0}), gather(w=8.0, cap=4.0), gather(w=8.0, agg="centered_clip"),
             gather(w=0.0)]
    p = plan(users)
    rules = gr.reducer_rules(p, users)
    assert rules[0] == ([8.0, 2.0, 8.0, 0.0], False)
    assert rules[1] == ([4.0, 4.0, 4.0, 0.0], False)
    assert rules[2] == ([8.0, 8.0, 8.0, 0.0], True)
    # a member whose cap is not a number gives everyone 0 (every account it sends then fails)
    broken = users[:3] + [{**gather(w=0.0), "cap": "lots"}]
    assert gr.reducer_rules(plan(broken), broken)[3] == ([0.0, 0.0, 0.0, 0.0], False)


def test_a_reducer_named_by_a_majority_is_benched_and_a_minority_cannot_bench_anyone():
    def with_ref(names):
        return {**gather(), "ref": names}

    # peer3 named by peers 0, 1 and 2 (3 of its 3 others): benched, no share, recorded FAIL
    users = [with_ref(["peer3"]), with_ref(["peer3"]), with_ref(["peer3"]), with_ref(["peer0", "peer1"])]
    p = plan(users)
    assert p.benched == {3}
    assert p.download_bandwidths([1.0, 1.0, 1.0, 1.0]) == [1.0, 1.0, 1.0, 0.0]
    assert 3 in p.senders and p.used[3] == 8.0  # it still sends, with its weight
    report = round_report(p)
    assert report.peers[3].outcome == Outcome.FAIL and "benched" in report.peers[3].reason
    # one accuser of three others, or half of them: nobody benched; naming oneself counts nothing
    assert plan([with_ref(["peer1"]), gather(), gather(), gather()]).benched == set()
    assert plan([with_ref(["peer3"]), with_ref(["peer3"]), gather(), gather(), gather()]).benched == set()
    assert plan([with_ref(["peer0"]), gather()]).benched == set()
    assert plan([with_ref(["peer1"]), with_ref(["peer0"])]).benched == set()  # a group of two: no bench
    # an incompatible member's gather is no vote; a malformed ref is ignored
    assert plan([with_ref(["peer3"]), {**with_ref(["peer3"]), "fp": "other"}, with_ref(["peer3"]),
                 gather()]).benched == {3}
    assert plan([with_ref(["peer3"]), {**with_ref(["peer3"]), "fp": "other"}, gather(), gather()]).benched == set()
    assert plan([{**gather(), "ref": "peer1"}, {**gather(), "ref": "peer1"}, gather()]).benched == set()
    # a group never benches all its members
    everyone = [with_ref(["peer1", "peer2"]), with_ref(["peer0", "peer2"]), with_ref(["peer0", "peer1"])]
    assert plan(everyone).benched == set()
    # the gather names at most MAX_REFUSED_NAMED peers
    many = gr.make_gather(fingerprint="model-a", schema="s1", weight=1.0, cap=1.0, norm=1.0, max_norm_ratio=10.0,
                          aggregation="mean", compression="none", require_commitments=True,
                          refused=[f"p{i}" for i in range(200)])
    assert len(many["ref"]) == gr.MAX_REFUSED_NAMED


def test_the_bench_list_counts_down_and_names_the_latest_refused_first():
    """One countdown for the swarm's own refusals and a validator's audit findings: a peer is
    named for as many rounds as it was named for, the longest-named first, then forgotten."""
    bench = gr.BenchList()
    bench.name(["a"], 2)
    bench.name(["b", "c"], 3)
    assert bench.named() == ["b", "c", "a"]
    bench.tick()
    assert bench.named() == ["b", "c", "a"]
    bench.tick()
    assert bench.named() == ["b", "c"]  # "a" served its 2 rounds
    bench.name(["a"], 5)  # named again: its countdown starts over
    bench.tick()
    assert bench.named() == ["a"]
    for _ in range(3):
        bench.tick()
    assert bench.named() == ["a"] and (bench.tick() or bench.named()) == []
