"""The secret-seed round audit (dtrain.swarm.averaging.audit; docs/protocol.md, "Round audit").

Real hivemind peers on loopback run real rounds; every peer keeps what it sent, and the audit
runs on a receiver's record with each peer's answers under a seed drawn after the round. The
cheats are the ones a miner who read the code would play: changes crafted into the null space
of the public sketch, which every check during the round passes.
"""

from __future__ import annotations

import itertools
import threading
import time

import numpy as np
import pytest
import torch

from dtrain.sandbox.adversary import nullspace_altered
from dtrain.swarm.averaging.audit import SenderAudit, audit_nonce, audit_round, batch_problem, draw_seed
from dtrain.swarm.averaging.contribution import PartLayout, binding_rtol
from dtrain.swarm.averaging.kept import SentContribution
from dtrain.swarm.wire import make_compression
from dtrain.swarm.loopback import local_nodes, run_concurrently
from dtrain.swarm.records import Outcome
from tests.faults import FaultInjection
from tests.faults import swarm as make_swarm
from tests.swarm_checks import loopback_config
from tests.test_swarm_commitments import NONCE, honest_report

pytestmark = pytest.mark.slow

_prefix = itertools.count()


@pytest.fixture(scope="module")
def nodes():
    with local_nodes(4) as started:
        yield started


def _cfg(group: int, **kw):
    return loopback_config(f"ra{next(_prefix)}", group, **{"require_commitments": True, "aggregation": "mean", **kw})


def _round(nodes, data, cfg, *, sent=None, faults=None, weights=None):
    """Run one round; returns (swarms, records, what each peer applied). The swarms stay up (the
    audit asks them what they sent); ``data``: each peer's honest contribution (its work
    report's), ``sent``: what it sends instead."""
    n = len(data)
    reports = [honest_report(t, 8) for t in data]
    swarms = [make_swarm(nodes[i].dht, data[i], "model-a", cfg, fault=(faults or {}).get(i)) for i in range(n)]
    applied = [[t.clone() for t in (sent or data)[i]] for i in range(n)]  # averaged in place
    weights = weights or [8] * n
    records = run_concurrently([
        lambda i=i: swarms[i].run_round(applied[i], weight=weights[i], cap=100, work=reports[i], work_nonce=NONCE)
        for i in range(n)])
    return swarms, records, applied


def _audit(swarms, record, result, *, lie=None, show=None):
    """Audit ``record`` (its receiver's ``result``) with every peer's honest answers, except
    ``lie``: peer index -> the sketches it reports instead, and ``show``: peer index -> a
    function (part, honest bytes) -> the bytes it shows."""
    seed = draw_seed()
    nonce = audit_nonce(seed)
    by_peer = {s.peer_id: i for i, s in enumerate(swarms)}
    reports = {}
    for s in swarms:
        i = by_peer[s.peer_id]
        reports[s.peer_id] = (lie[i](nonce) if lie and i in lie else s.sent_sketches(s.sent_round, nonce))

    def fetch(peer, part):
        i = by_peer[peer]
        wire = swarms[i].sent_wire(swarms[i].sent_round, part)
        return show[i](part, wire) if show and i in show else wire

    return audit_round(record.evidence, result, reports, nonce, binding_rtol(record.compression), fetch)


def _close(swarms):
    for s in swarms:
        s.shutdown()


@pytest.mark.parametrize("compression, aggregation", [("none", "mean"), ("8bit", "centered_clip")])
def test_an_honest_round_passes_the_audit_and_every_part_is_confirmed(nodes, compression, aggregation):
    torch.manual_seed(21)
    base = torch.randn(12000)
    data = [[base + 0.5 * torch.randn(12000)] for _ in range(4)]
    swarms, recs, applied = _round(nodes, data, _cfg(4, compression=compression, aggregation=aggregation,
                                                     part_size_bytes=2048))
    try:
        for r in recs:
            assert all(p.outcome == Outcome.SUCCESS for p in r.peers), [(p.outcome, p.reason) for p in r.peers]
        num_parts = len(recs[0].evidence.layout)
        assert num_parts >= 6
        for r, result_tensors in zip(recs, applied):
            result = _audit(swarms, r, result_tensors)
            assert result.problems == {} and result.disputes == 0
            assert result.parts_checked == num_parts  # every part, our own share's too
            assert all(result.confirmed[p] == set(range(num_parts)) for p in r.group)
    finally:
        _close(swarms)


def test_a_reducer_that_hides_its_change_in_the_public_sketch_null_space_is_named(nodes):
    """A reducer returns every part of its share about negated, crafted so that the part's
    public sketch, and so every account check in the round, is unchanged. Every receiver's
    result check (under the round's result seed) refuses it before applying anything and
    re-reduces its share from the senders' bytes, bit for bit alike on both honest receivers;
    it is recorded FAIL. The audit then
    settles what the result check saw with the senders' committed bytes: every sender shows
    them, so it names the reducer, and only it, on evidence."""
    from dtrain.swarm.averaging import result_check

    torch.manual_seed(22)
    data = [[torch.randn(12000)] for _ in range(3)]
    swarms, recs, applied = _round(nodes, data, _cfg(3), faults={2: FaultInjection(nullspace_results=True)})
    try:
        cheat = swarms[2].peer_id
        for r in recs[:2]:
            assert r.outcome_of(cheat) == Outcome.FAIL and result_check.REASON in r.result_of(cheat).reason
            assert all(p.outcome == Outcome.SUCCESS for p in r.peers if p.peer_id != cheat)
            assert r.fraction_recovered > 0 and r.fraction_averaged == 1.0 and r.in_step
        assert torch.equal(applied[0][0], applied[1][0])  # the same values on every honest receiver
        mean = (data[0][0] + data[1][0] + data[2][0]) / 3
        torch.testing.assert_close(applied[0][0], mean, rtol=0, atol=1e-5)  # nothing altered applied
        for r, result_tensors in zip(recs[:2], applied[:2]):
            failed = r.evidence.result_check.failed
            assert failed and {f.reducer for f in failed.values()} == {cheat}
            assert not set(failed) & set(r.evidence.parts)  # refused parts are not in the applied evidence
            result = _audit(swarms, r, result_tensors)
            assert set(result.problems) == {cheat}, result.problems
            assert "not the combination its account states" in result.problems[cheat]
            assert result.proven == {cheat}  # on the evidence of the senders' committed bytes
            assert result.disputes == 1  # settled once: its other parts are not fetched again
    finally:
        _close(swarms)


@pytest.mark.parametrize("compression", ["none", "8bit"])
def test_a_sender_that_hides_its_change_in_the_null_space_is_caught_by_its_batch(nodes, compression):
    """A sender whose work report is its honest mean but which sends that mean reflected through
    each part's public null space (every claim, the binding check and the part checks pass).
    Answering the audit truthfully, its sketches confirm what it sent, and the recomputed batch
    (here: its honest mean) does not give it; every honest sender's batch does."""
    torch.manual_seed(23)
    data = [[torch.randn(12000)] for _ in range(3)]
    cfg = _cfg(3, compression=compression, part_size_bytes=2048)
    layout = PartLayout.of(data[0], make_compression(compression), 2048)
    sent = [data[0], data[1], nullspace_altered(data[2], layout, NONCE)]
    swarms, recs, applied = _round(nodes, data, cfg, sent=sent)
    try:
        for r in recs:
            assert all(p.outcome == Outcome.SUCCESS for p in r.peers), [(p.outcome, p.reason) for p in r.peers]
        result = _audit(swarms, recs[0], applied[0])
        assert result.problems == {}
        seed = draw_seed()
        for i, s in enumerate(swarms):
            nonce = audit_nonce(seed)
            sketches = s.sent_sketches(s.sent_round, nonce)
            claim = SenderAudit(nonce=nonce, sketches=sketches, confirmed=frozenset(result.confirmed[s.peer_id]),
                                 layout=layout, rtol=binding_rtol(compression))
            problem = batch_problem(data[i], claim)
            if i == 2:
                assert "its committed batch does not give" in problem
            else:
                assert problem == "", problem
    finally:
        _close(swarms)


def test_a_sender_that_lies_to_the_audit_is_named_by_its_committed_bytes(nodes):
    """The same null-space sender, answering the audit with the sketches of its honest mean (so
    its batch would check out): the results it is part of no longer add up, the audit asks
    every sender for the part's bytes, which must hash to the digests committed before the
    round, and its own bytes contradict its answer. It is named; the reducers are not."""
    torch.manual_seed(24)
    data = [[torch.randn(12000)] for _ in range(3)]
    cfg = _cfg(3)
    layout = PartLayout.of(data[0], make_compression("none"), 4096)
    sent = [data[0], data[1], nullspace_altered(data[2], layout, NONCE)]
    swarms, recs, applied = _round(nodes, data, cfg, sent=sent)
    try:
        liar = swarms[2].peer_id
        honest_answer = SentContribution([t.clone() for t in data[2]], layout, make_compression("none"))
        result = _audit(swarms, recs[0], applied[0], lie={2: honest_answer.sketches})
        assert set(result.problems) == {liar}, result.problems
        assert "its own bytes contradict" in result.problems[liar] and result.proven == {liar}
        # showing other bytes (its honest part's) instead does not help: they are not the committed ones
        result = _audit(swarms, recs[0], applied[0], lie={2: honest_answer.sketches},
                        show={2: lambda part, wire: honest_answer.wire(part)})
        assert set(result.problems) == {liar}
        assert "not the ones it committed" in result.problems[liar]
    finally:
        _close(swarms)


def test_a_part_sent_with_other_bytes_than_committed_bans_the_sender(nodes):
    """A sender that commits the digests of its honest parts and then sends each part changed in
    its public sketch's null space (so its claims still match) is banned by every reducer: the
    bytes are not the committed ones, which the audit's evidence rests on."""
    torch.manual_seed(25)
    data = [[torch.randn(12000)] for _ in range(3)]
    swarms, recs, _ = _round(nodes, data, _cfg(3), faults={2: FaultInjection(nullspace_parts=True)})
    try:
        cheat = swarms[2].peer_id
        for r in recs[:2]:
            assert r.outcome_of(cheat) == Outcome.FAIL
            assert next(p.reason for p in r.peers if p.peer_id == cheat) == "sent a part that contradicts its commitment"
    finally:
        _close(swarms)


def test_a_silent_member_is_named_only_when_its_parts_are_in_the_result(nodes):
    """A weighted sender that does not answer the audit is named (its parts are in every
    result); a weight-0 member (a validator's zeros: no coefficient anywhere) owes nothing."""
    torch.manual_seed(26)
    data = [[torch.randn(12000)] for _ in range(3)] + [[torch.zeros(12000)]]
    swarms, recs, applied = _round(nodes, data, _cfg(4), weights=[8, 8, 8, 0])
    try:
        r = recs[0]
        for silent, named in ((1, True), (3, False)):
            seed = draw_seed()
            nonce = audit_nonce(seed)
            reports = {s.peer_id: (None if i == silent else s.sent_sketches(s.sent_round, nonce))
                       for i, s in enumerate(swarms)}
            result = audit_round(r.evidence, applied[0], reports, nonce, binding_rtol("none"),
                                 lambda peer, part: None)
            if named:
                assert set(result.problems) == {swarms[silent].peer_id}
                assert "did not answer" in result.problems[swarms[silent].peer_id]
                assert result.proven == set()  # a fault can explain silence: no long bench
            else:
                assert result.problems == {}
    finally:
        _close(swarms)


def test_audit_seeds_are_fresh_and_sketches_differ_by_seed():
    a, b = draw_seed(), draw_seed()
    assert a != b and len(a) == 32
    x = [torch.randn(3000)]
    layout = PartLayout.of(x, make_compression("none"), 4096)
    sent = SentContribution(x, layout, make_compression("none"))
    s1, s2 = sent.sketches(audit_nonce(a)), sent.sketches(audit_nonce(b))
    assert s1.shape == (len(layout), 64) and not np.allclose(s1, s2)
    # the sketches of all parts add up to the sketch of the whole under the same nonce (linearity)
    from dtrain.sketch import gradient_sketch

    assert np.allclose(s1.astype(np.float64).sum(0), gradient_sketch(x, audit_nonce(a)).numpy(), rtol=1e-5, atol=1e-4)


def test_the_miner_answers_the_audit_of_its_last_round_over_the_signed_api(tmp_path):
    """The miner's real handler behind the real server, asked by the real client with real
    sr25519 hotkeys: the sketches of its last round's parts under the seed (asked while that
    round is still ending, it waits for it), one part's bytes (which hash to the committed
    digest), 404 for another round at once, 422 for a part it has not."""
    bt = pytest.importorskip("bittensor")
    import base64
    import functools
    import types

    from dtrain.api.client import ApiError, MinerClient
    from dtrain.api.messages import RoundAuditRequest
    from dtrain.api.server import Handlers, MinerApiServer
    from dtrain.neurons.miner_api import MinerApi
    from dtrain.swarm.averaging.claims_tree import part_digest
    from dtrain.swarm.averaging.contribution import commit_parts
    from dtrain.swarm.sent_round import SentRound

    wallets = {}
    for name in ("validator", "miner"):
        w = bt.Wallet(name, "hot", path=str(tmp_path))
        w.create_new_coldkey(use_password=False, suppress=True)
        w.create_new_hotkey(use_password=False, suppress=True)
        wallets[name] = w
    x = [torch.randn(5000), torch.randn(300)]
    compression = make_compression("8bit")
    layout = PartLayout.of(x, compression, 2048)
    sent = SentContribution(x, layout, compression, round_id="ab12")
    # what the handler reads of the swarm: the kept round, its parts, and the answers about it
    last_sent = SentRound()
    last_sent.begin()  # our round is still ending when the first audit arrives
    kept = types.SimpleNamespace(wait_for_sent=last_sent.wait_for, num_parts=len(layout),
                                 sent_sketches=lambda round_id, nonce: sent.sketches(nonce),
                                 sent_wire=lambda round_id, part: sent.wire(part))
    neuron = types.SimpleNamespace(round_swarm=kept)  # what the handler reads (the swarm or the model rounds)
    unused = functools.partial(pytest.fail, "not this endpoint")
    server = MinerApiServer(
        Handlers(status=unused, train=unused, allreduce=unused, state_slice=unused,
                 round_audit=MinerApi(neuron).round_audit),
        self_hotkey=wallets["miner"].hotkey.ss58_address,
        is_allowed=lambda hotkey: hotkey == wallets["validator"].hotkey.ss58_address).start()
    try:
        client = MinerClient(wallets["validator"], timeout=30)
        api, miner = f"127.0.0.1:{server.port}", server.self_hotkey
        seed = draw_seed()
        ends = threading.Timer(1.0, last_sent.end, args=("ab12",))
        ends.start()
        t0 = time.monotonic()
        answer = client.round_audit(api, miner, RoundAuditRequest(group="ab12", seed=seed.hex()))
        assert time.monotonic() - t0 >= 0.9  # it waited for the round to end, then answered for it
        ends.join()
        got = np.frombuffer(base64.b64decode(answer.sketches), dtype="<f4").reshape(answer.parts, 64)
        assert answer.parts == len(layout) and np.array_equal(got, sent.sketches(audit_nonce(seed)))
        _, digests = commit_parts(x, layout, NONCE, compression)
        for part in (0, len(layout) - 1):
            wire = base64.b64decode(client.round_audit(api, miner, RoundAuditRequest(group="ab12", seed=seed.hex(),
                                                                                     part=part)).wire)
            assert part_digest(wire) == bytes(digests[part])
        t0 = time.monotonic()
        with pytest.raises(ApiError) as other_round:
            client.round_audit(api, miner, RoundAuditRequest(group="cd34", seed=seed.hex()))
        assert other_round.value.status == 404 and "only the last round" in str(other_round.value)
        assert time.monotonic() - t0 < 5  # no round of ours runs: nothing to wait for
        with pytest.raises(ApiError) as no_part:
            client.round_audit(api, miner, RoundAuditRequest(group="ab12", seed=seed.hex(), part=len(layout)))
        assert no_part.value.status == 422 and "'part'" in str(no_part.value)
    finally:
        server.stop()


def test_an_answer_of_the_wrong_shape_or_with_non_finite_values_is_named():
    """Unit-level: the audit's answers are untrusted. A NaN would make a sketch compare unequal
    to everything and confirm nothing (a way out of the batch audit), so it names the sender."""
    from dtrain.swarm.averaging.audit import ReducedPart, RoundEvidence

    x = [torch.randn(3000)]
    layout = PartLayout.of(x, make_compression("none"), 4096)
    evidence = RoundEvidence(senders=["a"], layout=layout, compression="none",
                             parts={g: ReducedPart("r", (1.0,), (None,)) for g in range(len(layout))})
    nonce = audit_nonce(draw_seed())
    honest = SentContribution(x, layout, make_compression("none")).sketches(nonce)
    assert audit_round(evidence, x, {"a": honest}, nonce, 1e-4, lambda p, g: None).problems == {}
    bad = honest.copy()
    bad[0, 3] = np.nan
    assert "non-finite" in audit_round(evidence, x, {"a": bad}, nonce, 1e-4, lambda p, g: None).problems["a"]
    short = honest[:-1]
    assert "parts, expected" in audit_round(evidence, x, {"a": short}, nonce, 1e-4, lambda p, g: None).problems["a"]
