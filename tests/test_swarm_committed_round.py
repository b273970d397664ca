"""Work commitments and accountable reducers on dtrain's own round (dtrain/swarm/commitments.py):
a validator with a real hotkey announces, three miners declare their commitments in their
gathers and average over real peers; each way of sending or returning something other than
what was committed is caught by every member alike."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from dtrain.sketch import WORK_SKETCH_K, gradient_sketch
from dtrain.swarm.averaging.accounts import Account
from dtrain.swarm.averaging.contribution import PartLayout
from dtrain.swarm.averaging.kept import SentContribution
from dtrain.swarm.codecs import part_codec
from dtrain.swarm.commitments import CommittedChecks, commit
from dtrain.swarm.records import Outcome
from dtrain.swarm.round import RoundSettings, Stage, record_of
from dtrain.training.work import PageWork, WorkReport, work_nonce

pytestmark = pytest.mark.slow

SHAPES = [(700,), (20, 25)]  # two tensors, five parts of at most 300 values
VALUES_PER_PART = 300
SAMPLES = (4, 8, 12)  # each miner's committed samples: its averaging weight
_round_ids = itertools.count()


def honest_report(tensors, samples: int, nonce: str) -> WorkReport:
    """One page whose sketch is ``samples`` x the contribution's: the report it binds to."""
    sketch = gradient_sketch([t * samples for t in tensors], nonce, k=WORK_SKETCH_K).tolist()
    return WorkReport(epoch=5, pages=(PageWork(page=1, counter=0, samples=samples, loss=5.0, sketch=tuple(sketch)),))


def contributions(seed: int):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(*shape, generator=gen) for shape in SHAPES] for _ in SAMPLES]


def run_round(rounds, codec_name="none", *, sent=None, weights=None, checks_of=None, robust=False):
    """One announced round: miner m commits to ``contributions`` but averages ``sent[m]`` with
    ``weights[m]``; ``checks_of(m, checks)`` may swap a miner's checks for a cheat's. Returns (the
    rounds and their checks, the validator's first, what each miner committed, what each holds
    after, what the validator holds after)."""
    (validator, *miners), _ = rounds
    round_id = f"committed-{next(_round_ids)}"
    nonce = work_nonce("committed", 5)
    codec = part_codec(codec_name)
    honest = contributions(next(_round_ids))
    layout = PartLayout.of_values(honest[0], VALUES_PER_PART)
    sent = sent(honest) if sent else [[t.clone() for t in m] for m in honest]
    weights = weights or [float(s) for s in SAMPLES]
    settings = RoundSettings(window_s=2.0, sender_timeout_s=10, reducer_timeout_s=10, robust=robust)
    received = [torch.zeros(*shape) for shape in SHAPES]
    # the validator's first; everyone runs the result check after the butterfly, as production does
    checks = [CommittedChecks(layout, codec, nonce, WorkReport, robust=robust, questions=validator.kept)]
    announced = validator.announce(round_id, 5, layout.views(received), codec, settings, checks=checks[0])
    joined = []
    for m, miner in enumerate(miners[:len(SAMPLES)]):
        views = layout.views(sent[m])
        own = commit(layout.views(honest[m]), layout, codec, nonce, honest_report(honest[m], SAMPLES[m], nonce))
        miner.kept.keep(round_id, SentContribution.keep(honest[m], layout, codec))  # what it says it sent
        mine = CommittedChecks(layout, codec, nonce, WorkReport, own=own, parts=views, robust=robust,
                               questions=miner.kept, sent=miner.kept.sent(round_id))
        mine = checks_of(m, mine) if checks_of else mine
        checks.append(mine)
        joined.append(miner.join(validator.transport.peer_id, round_id, 5, views, codec, weight=weights[m],
                                 settings=settings, checks=mine, gather=own.gather()))
    for rnd in [announced, *joined]:
        rnd.result(timeout_s=90)
    return [announced, *joined], checks, honest, sent, received


def layout_sizes(honest) -> list[int]:
    return [n for _, _, n in PartLayout.of_values(honest[0], VALUES_PER_PART).parts]


def member_of(rnd, node) -> int:
    return rnd.membership.membership.index(node.transport.peer_id)


def sender_of(rnd, node) -> int:
    return rnd.membership.membership.sender_index(member_of(rnd, node))


def weighted_mean(tensors_by_miner, weights):
    total = sum(weights)
    return [sum(w * m[i] for m, w in zip(tensors_by_miner, weights)) / total for i in range(len(SHAPES))]


def test_an_honest_committed_round_averages_everyone_and_every_member_holds_the_same_bits(rounds):
    done, checks, honest, sent, received = run_round(rounds)
    assert all(r.stage == Stage.DONE for r in done), [(r.stage, r.reason) for r in done]
    expected = weighted_mean(honest, [float(s) for s in SAMPLES])
    for rnd in done:
        assert rnd.outcome.banned == {} and rnd.outcome.refused_reducers == {} and rnd.outcome.failed_reducers == {}
    for holder in [received, *sent]:
        for got, want in zip(holder, expected):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            assert torch.equal(got, received[SHAPES.index(tuple(got.shape))])
    assert all(c.accused == {} and c.refused == {} for c in checks)
    for c in checks:  # every receiver's result check asked every sender and confirmed every part it applied
        assert c.evidence.result_check.failed == {} and c.evidence.result_check.silent == []
        assert c.evidence.result_check.parts_checked == len(c.evidence.parts) > 0
    nodes = rounds[0]
    for rnd, node, c in zip(done, nodes, checks):
        record = record_of(rnd, node.transport.peer_id, layout_sizes(honest), c)
        assert record.ok and record.in_step and record.fraction_averaged == 1.0 and record.fraction_refused == 0.0
        assert [p.outcome for p in record.peers] == [Outcome.SUCCESS] * 4
        assert record.total_weight == sum(SAMPLES)
        # the validator reads every miner's committed report (its audits recompute them)
        assert set(record.work_reports) == {n.transport.peer_id for n in nodes[1:]}


def test_with_the_8bit_wire_the_claims_are_of_what_arrives_and_nobody_is_refused(rounds):
    done, checks, honest, sent, received = run_round(rounds, "8bit")
    assert all(r.stage == Stage.DONE for r in done)
    assert all(r.outcome.banned == {} and r.outcome.refused_reducers == {} for r in done)
    expected = weighted_mean(honest, [float(s) for s in SAMPLES])
    for got, want in zip(received, expected):
        assert float((got - want).norm() / want.norm()) < 0.05  # two passes of the 8-bit codec
    for holder in sent:
        assert all(torch.equal(a, b) for a, b in zip(holder, received))


def test_a_sender_that_sends_other_bytes_than_it_committed_is_left_out_and_its_own_share_refused(rounds):
    # miner 2 commits to its gradient and sends three times it
    # (copies: what is sent is averaged in place, and ``honest`` must stay what was committed)
    done, checks, honest, sent, received = run_round(
        rounds, sent=lambda h: [[t.clone() for t in h[0]], [t.clone() for t in h[1]], [3 * t for t in h[2]]])
    validator, *miners = done
    cheat, nodes = 2, rounds[0]
    cheat_member, cheat_sender = member_of(validator, nodes[cheat + 1]), sender_of(validator, nodes[cheat + 1])
    for m, rnd in enumerate(miners):
        if m != cheat:
            assert "other bytes than it committed" in rnd.outcome.banned[cheat_sender]
    # as a reducer it kept its own scaled part, which its account (and forwarded claims) cannot explain
    for rnd in [validator, *miners[:cheat]]:
        assert "account does not explain" in rnd.outcome.refused_reducers[cheat_member]
    for rnd, node, c in zip(done[:cheat + 1], nodes, checks):  # the validator's and honest miners' records
        record = record_of(rnd, node.transport.peer_id, layout_sizes(honest), c)
        assert record.outcome_of(nodes[cheat + 1].transport.peer_id) == Outcome.FAIL
        assert {p.outcome for p in record.peers if p.peer_id != nodes[cheat + 1].transport.peer_id} == {Outcome.SUCCESS}
        # its share, refused, is re-reduced by every receiver from the senders' bytes
        assert record.in_step and record.fraction_refused == 0 and 0 < record.fraction_recovered < 1
    # every honest receiver holds the honest miners' mean outside the cheat's share; inside it, the
    # re-reduction of all three committed contributions (the cheat answers with its committed bytes)
    layout = PartLayout.of_values(honest[0], VALUES_PER_PART)
    first, end = validator.membership.membership.share_of(cheat_member)
    mean = layout.views(weighted_mean(honest[:2], [float(s) for s in SAMPLES[:2]]))
    mean_all = layout.views(weighted_mean(honest, [float(s) for s in SAMPLES]))
    for holder in (received, sent[0], sent[1]):
        for g, got in enumerate(layout.views(holder)):
            torch.testing.assert_close(got, mean_all[g] if first <= g < end else mean[g], rtol=1e-5, atol=1e-6)


def test_a_weight_above_the_committed_samples_is_refused_by_every_member_alike(rounds):
    done, checks, honest, sent, received = run_round(rounds, weights=[4.0, 8.0, 100.0])
    inflated = sender_of(done[0], rounds[0][3])
    assert all(c.refused == {inflated: "claims weight 100 but committed 12 samples"} for c in checks)
    for rnd, node, c in zip(done, rounds[0], checks):
        record = record_of(rnd, node.transport.peer_id, layout_sizes(honest), c)
        inflated_result = record.result_of(rounds[0][3].transport.peer_id)
        assert inflated_result.outcome == Outcome.FAIL and inflated_result.proven  # anyone can check it
        assert inflated_result.weight_used == 0.0
    expected = weighted_mean(honest[:2], [4.0, 8.0])
    for holder in (received, sent[0], sent[1], sent[2]):
        for got, want in zip(holder, expected):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def cheat_at(cheat: int, kind):
    """``checks_of`` for run_round: miner ``cheat`` runs the checks of ``kind`` instead."""
    def swap(m, checks):
        return kind(checks.layout, checks.codec, checks.nonce, WorkReport, own=checks.own, parts=checks.parts,
                    questions=checks.questions, sent=checks.sent) if m == cheat else checks

    return swap


class _LyingAccount(CommittedChecks):
    """A reducer whose accounts say it gave the first sender no weight (it did)."""

    def note(self, j, account):
        if account is None:
            return b""
        c = np.array(account.coefficients, dtype=np.float64)
        c[1:] += c[0] / (len(c) - 1)
        c[0] = 0.0
        return Account(c, account.tau).to_bytes()


class _Censor(CommittedChecks):
    """A reducer that leaves the first sender other than itself out of its share, and accounts
    for what it combined honestly."""

    def victim(self) -> int:
        return 0 if self.my_sender != 0 else 1

    def accept_head(self, sender, head):
        return "censored" if sender == self.victim() else super().accept_head(sender, head)


def test_a_reducer_whose_account_lies_is_refused_by_every_receiver(rounds):
    liar = 1
    done, checks, honest, sent, received = run_round(rounds, checks_of=cheat_at(liar, _LyingAccount))
    validator, *miners = done
    liar_member = member_of(validator, rounds[0][liar + 1])
    for m, rnd in enumerate(done):
        if m != liar + 1:
            assert "account does not explain" in rnd.outcome.refused_reducers[liar_member]


def test_a_reducer_that_leaves_a_sender_out_is_named_by_that_sender_and_by_nobody_else(rounds):
    # The bound of today's rule (docs/protocol.md, "What is still trusted"): the account adds up,
    # so only the sender left out can tell; it names the reducer, every receiver applies the part.
    censor = 1
    done, checks, honest, sent, received = run_round(rounds, checks_of=cheat_at(censor, _Censor))
    validator, *miners = done
    nodes = rounds[0]
    censor_member = member_of(validator, nodes[censor + 1])
    victim = next(m for m in range(len(SAMPLES)) if sender_of(validator, nodes[m + 1]) == checks[censor + 1].victim())
    assert victim != censor
    assert all(rnd.outcome.refused_reducers == {} for rnd in done)
    assert "left our part out" in checks[victim + 1].accused[censor_member]
    assert all(c.accused == {} for m, c in enumerate(checks) if m != victim + 1)
    record = record_of(done[victim + 1], nodes[victim + 1].transport.peer_id, layout_sizes(honest), checks[victim + 1])
    assert record.outcome_of(nodes[censor + 1].transport.peer_id) == Outcome.FAIL
    for holder in (received, *sent):
        assert all(torch.equal(a, b) for a, b in zip(holder, received))


@pytest.mark.parametrize("codec_name", ["none", "8bit"])
def test_the_round_audit_confirms_every_part_and_names_a_sender_whose_secret_sketches_lie(rounds, codec_name):
    from dtrain.swarm.averaging.audit import audit_nonce, audit_round, draw_seed
    from dtrain.swarm.averaging.contribution import binding_rtol

    done, checks, honest, sent, received = run_round(rounds, codec_name)
    nodes, codec = rounds[0], part_codec(codec_name)
    layout = PartLayout.of_values(honest[0], VALUES_PER_PART)
    evidence = record_of(done[0], nodes[0].transport.peer_id, layout_sizes(honest), checks[0]).evidence
    assert sorted(evidence.parts) == list(range(len(layout)))  # the validator applied every part from a reducer
    kept = {nodes[m + 1].transport.peer_id: SentContribution.keep(honest[m], layout, codec) for m in range(3)}
    nonce = audit_nonce(draw_seed())
    reports = {peer: k.sketches(nonce) for peer, k in kept.items()}
    audit = audit_round(evidence, received, reports, nonce, binding_rtol(codec_name), lambda peer, g: kept[peer].wire(g))
    assert audit.problems == {} and audit.parts_checked == len(layout) and audit.disputes == 0
    assert all(audit.confirmed[peer] == set(range(len(layout))) for peer in kept)
    # a sender that answers the secret seed with the sketches of something else is named on its own bytes
    liar = nodes[2].transport.peer_id
    reports[liar] = SentContribution.keep([2 * t for t in honest[1]], layout, codec).sketches(nonce)
    audit = audit_round(evidence, received, reports, nonce, binding_rtol(codec_name), lambda peer, g: kept[peer].wire(g))
    assert set(audit.problems) == {liar} and liar in audit.proven
    assert "its own bytes contradict" in audit.problems[liar]


def null_space_change(values: torch.Tensor, tensor: int, start: int, nonce: str) -> torch.Tensor:
    """A change to ``values`` as large as they are that the public sketch of their range cannot see."""
    from dtrain.sketch import range_sketch

    n = values.numel()
    basis = torch.eye(n)
    sketch = torch.stack([range_sketch(basis[t], tensor, start, nonce, k=WORK_SKETCH_K) for t in range(n)], dim=1)
    v = torch.randn(n, dtype=torch.float64)
    v -= sketch.T @ torch.linalg.lstsq(sketch @ sketch.T, sketch @ v).solution
    return (v / v.norm() * values.norm()).float()


class _NullSpaceReducer(CommittedChecks):
    """A member that, as its own share's sender, hides a change in the public sketch's null space:
    every public check passes (its forwarded claim is its honest one); under the result seed its
    results do not add up with what it answers (its honest parts)."""

    def begin(self, membership, gathers, me):
        super().begin(membership, gathers, me)
        first, end = membership.share_of(me)
        for g in range(first, end):
            i, start, _ = self.layout.parts[g]
            self.parts[g].add_(null_space_change(self.parts[g], i, start, self.nonce))


def test_the_result_check_refuses_a_reducer_whose_results_hide_a_change_from_the_public_sketch(rounds):
    cheat = 0
    done, checks, honest, sent, received = run_round(rounds, checks_of=cheat_at(cheat, _NullSpaceReducer))
    validator, *miners = done
    cheat_member = member_of(validator, rounds[0][cheat + 1])
    for m, (rnd, c) in enumerate(zip(done, checks)):
        if m == cheat + 1:
            continue
        # no public check saw it: it is the result check that refused it, on every other receiver
        assert rnd.outcome.refused_reducers.get(cheat_member, "").startswith("returned a part that does not add up")
        assert {f.reducer for f in c.evidence.result_check.failed.values()} == {rounds[0][cheat + 1].transport.peer_id}
        # and re-reduced it from the senders' committed bytes: the round loses nothing
        first, end = validator.membership.membership.share_of(cheat_member)
        layout = PartLayout.of_values(honest[0], VALUES_PER_PART)
        holder = layout.views(received if m == 0 else sent[m - 1])
        mean = layout.views(weighted_mean(honest, [float(s) for s in SAMPLES]))
        assert rnd.outcome.recovered_parts == set(range(first, end)) and not rnd.outcome.zeroed_parts
        for g in range(first, end):
            torch.testing.assert_close(holder[g], mean[g], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["negating-reducer", "scaling-reducer", "nullspace-reducer"])
def test_the_sandboxs_cheating_reducers_are_refused_by_every_other_receiver(rounds, kind):
    """The sandbox's reducer cheats (dtrain/sandbox/adversary.py) on dtrain's round: each returns
    an altered result with the true account, to every member alike (itself too). The public
    check of the account refuses a negated or rescaled result; the null-space one passes it and
    the result check refuses it. Every other receiver then re-reduces the cheat's share from the
    senders' committed bytes: every member holds the weighted mean of the whole vector."""
    from dtrain.sandbox.adversary import MINERS

    cheat = 1
    cheating_checks = MINERS[kind]._mechanisms(None).round_checks
    done, checks, honest, sent, received = run_round(rounds, checks_of=cheat_at(cheat, cheating_checks))
    validator = done[0]
    cheat_member = member_of(validator, rounds[0][cheat + 1])
    first, end = validator.membership.membership.share_of(cheat_member)
    assert end > first
    layout = PartLayout.of_values(honest[0], VALUES_PER_PART)
    mean = layout.views(weighted_mean(honest, [float(s) for s in SAMPLES]))
    refused_for = "returned a part that does not add up" if kind == "nullspace-reducer" else "account does not explain"
    for m, rnd in enumerate(done):
        holder = layout.views(received if m == 0 else sent[m - 1])
        if m == cheat + 1:  # it holds what it published: the cheat hurts its own replica only
            assert rnd.stage == Stage.DONE and rnd.outcome.refused_reducers == {}
            assert not any(torch.allclose(holder[g], mean[g], atol=1e-5) for g in range(first, end))
            continue
        assert refused_for in rnd.outcome.refused_reducers.get(cheat_member, ""), (kind, rnd.outcome.refused_reducers)
        assert set(rnd.outcome.refused_reducers) == {cheat_member}
        assert rnd.outcome.recovered_parts == set(range(first, end)) and not rnd.outcome.zeroed_parts
        assert all(torch.allclose(holder[g], mean[g], atol=1e-5) for g in range(len(holder)))
    # FAIL in the validator's record; proven when its own bytes fail the public checks (every
    # receiver of them refuses it alike), not on the result check (it rests on senders' answers)
    record = record_of(validator, rounds[0][0].transport.peer_id, layout_sizes(honest), checks[0])
    found = record.result_of(rounds[0][cheat + 1].transport.peer_id)
    assert found.outcome == Outcome.FAIL and found.proven == (kind != "nullspace-reducer"), found
