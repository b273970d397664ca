"""Membership fixed by the round's announcer (dtrain/swarm/membership.py): real peers declare
over dtrain's protocol, the announcer signs one list with a real sr25519 hotkey, and every
member averages with exactly that group (dtrain/swarm/butterfly.py)."""

from __future__ import annotations

import time

import pytest
import torch

from dtrain.sandbox.orchestrator import create_wallet
from dtrain.swarm.butterfly import Membership, MembershipError
from dtrain.swarm.codecs import part_codec
from dtrain.swarm.loopback import run_concurrently
from dtrain.swarm.membership import (
    Announcer, Declaration, SignedMembership, announcer_order, declare, reducer_shares, sign,
)

NUM_PARTS = 6


@pytest.fixture(scope="module")
def wallets(tmp_path_factory):
    import bittensor as bt

    root = tmp_path_factory.mktemp("wallets")
    keys = {name: create_wallet(root, name) for name in ("validator", "stranger")}
    from dtrain.sandbox import layout

    wallet = {name: bt.Wallet(name=name, hotkey="default", path=str(layout.wallets_dir(root))) for name in keys}
    return wallet, keys


@pytest.fixture(scope="module")
def announcer(four_peers, wallets):
    wallet, keys = wallets
    return Announcer(four_peers[0].transport, wallet["validator"]), keys


def test_members_declare_and_all_average_with_the_one_signed_group(four_peers, announcer):
    desk, keys = announcer
    validator = four_peers[0].transport
    miners = [s.transport for s in four_peers[1:]]
    own = Declaration("m1", epoch=7, weight=0.0, reduces=False, gather=b"validator")
    window = validator.submit(desk.announce("m1", 7, NUM_PARTS, window_s=3.0, own=own))
    weights = (1.0, 2.0, 3.0)
    answers = run_concurrently([
        lambda t=t, w=w: t.run(declare(t, validator.peer_id, Declaration("m1", 7, w, True, f"gather-{w}".encode()),
                                       timeout_s=20), timeout_s=30)
        for t, w in zip(miners, weights)], timeout_s=40)
    signed_by_announcer = window.result(timeout=30)
    for membership, why in answers:
        assert why == "" and membership is not None
        assert membership.to_bytes() == signed_by_announcer.to_bytes()  # one list, the same for everyone
        membership.verify(lambda hotkey: hotkey == keys["validator"])
    m = signed_by_announcer.membership
    assert set(m.peers) == {validator.peer_id, *(t.peer_id for t in miners)}
    assert list(m.peers) == sorted(m.peers)
    assert m.shares[m.index(validator.peer_id)] == 0 and m.num_parts == NUM_PARTS  # the validator reduces nothing
    assert m.sender_index(m.index(validator.peer_id)) is None
    by_peer = {t.peer_id: w for t, w in zip(miners, weights)}
    assert sorted(m.weights) == sorted(weights)
    assert [m.weights[m.sender_index(m.index(p))] for p in by_peer] == list(by_peer.values())
    assert signed_by_announcer.gathers[m.index(validator.peer_id)] == b"validator"

    # the group averages with exactly that membership
    gen = torch.Generator().manual_seed(5)
    parts = {t.peer_id: [torch.randn(500, generator=gen) for _ in range(NUM_PARTS)] for t in [validator, *miners]}
    expected = [sum(by_peer[p] * parts[p][g] for p in by_peer) / sum(weights) for g in range(NUM_PARTS)]
    services = {s.transport.peer_id: s for s in four_peers}
    outcomes = run_concurrently([
        lambda p=p: services[p].transport.run(services[p].run(m, parts[p], part_codec("none"), sender_timeout_s=10,
                                                              reducer_timeout_s=10), timeout_s=60)
        for p in m.peers], timeout_s=90)
    assert all(not o.failed_reducers and not o.banned and not o.unaveraged_parts for o in outcomes)
    for p in m.peers:
        for g in range(NUM_PARTS):
            torch.testing.assert_close(parts[p][g], expected[g], rtol=1e-5, atol=1e-6)


def test_a_late_or_off_epoch_declaration_sits_the_round_out(four_peers, announcer):
    desk, _ = announcer
    validator, miner = four_peers[0].transport, four_peers[1].transport
    window = validator.submit(desk.announce("m2", 3, NUM_PARTS, window_s=1.5))
    membership, why = miner.run(declare(miner, validator.peer_id, Declaration("m2", 4, 1.0, True), 10), timeout_s=20)
    assert membership is None and why == "round m2 is for epoch 3, not 4"
    time.sleep(2.0)
    with pytest.raises(MembershipError, match="nobody declared"):
        window.result(timeout=10)
    membership, why = miner.run(declare(miner, validator.peer_id, Declaration("m2", 3, 1.0, True), 10), timeout_s=20)
    assert membership is None and ("has closed" in why or "no round m2" in why)
    membership, why = miner.run(declare(miner, validator.peer_id, Declaration("nope", 3, 1.0, True), 10), timeout_s=20)
    assert membership is None and why == "no round nope is open here"


def test_a_declaration_an_instant_before_the_window_opens_is_held_for_it(four_peers, announcer):
    desk, _ = announcer
    validator, miner = four_peers[0].transport, four_peers[1].transport
    early = miner.submit(declare(miner, validator.peer_id, Declaration("m-early", 3, 1.0, True), 20))
    time.sleep(1.0)  # the round is announced after the miner declared
    window = validator.submit(desk.announce("m-early", 3, NUM_PARTS, window_s=1.0))
    membership, why = early.result(timeout=20)
    assert why == "" and miner.peer_id in membership.membership.peers
    assert window.result(timeout=10).membership.peers == membership.membership.peers


def test_a_forged_or_altered_membership_is_refused(wallets):
    wallet, keys = wallets
    m = Membership("m3", ("a", "b", "c"), senders=(1, 2), weights=(1.0, 1.0), shares=(0, 3, 3))
    signed = sign(m, 2, [b"", b"g1", b"g2"], wallet["validator"])
    back = SignedMembership.from_bytes(signed.to_bytes())
    back.verify(lambda hotkey: hotkey == keys["validator"])
    with pytest.raises(MembershipError, match="may not announce rounds"):
        back.verify(lambda hotkey: hotkey == keys["stranger"])
    # signed by a hotkey that may announce, then one weight changed: the signature no longer holds
    altered = SignedMembership(Membership("m3", m.peers, m.senders, (1.0, 100.0), m.shares), 2, back.announcer,
                               back.gathers, back.signature)
    with pytest.raises(MembershipError, match="is not signed by"):
        SignedMembership.from_bytes(altered.to_bytes()).verify(lambda hotkey: True)
    # a stranger's signature under the validator's name
    forged = sign(m, 2, [b"", b"g1", b"g2"], wallet["stranger"])
    claimed = SignedMembership(m, 2, keys["validator"], forged.gathers, forged.signature)
    with pytest.raises(MembershipError, match="is not signed by"):
        claimed.verify(lambda hotkey: True)
    with pytest.raises(MembershipError, match="malformed"):
        SignedMembership.from_bytes(b"\x93junk")


def test_shares_go_to_the_members_that_reduce_by_their_bandwidth():
    def d(reduces, bandwidth=None):
        return Declaration("r", 0, 1.0, reduces, b"", bandwidth)

    assert reducer_shares([d(False), d(True), d(True), d(True)], 10) == (0, 4, 3, 3)
    assert reducer_shares([d(False), d(False)], 3) == (2, 1)  # nobody offered: everyone reduces
    assert sum(reducer_shares([d(True)] * 7, 1000)) == 1000
    # four reducers, one with a tenth of the others' upload: it reduces least (the LP's optimum)
    shares = reducer_shares([d(True, 10.0), d(True, 10.0), d(True, 10.0), d(True, 1.0)], 100)
    assert sum(shares) == 100 and shares[3] < min(shares[:3])
    # a benched member reduces nothing and the others take its share; benching every reducer benches none
    assert reducer_shares([d(False), d(True), d(True), d(True)], 10, benched={2}) == (0, 5, 0, 5)
    assert reducer_shares([d(False), d(True), d(True)], 10, benched={1, 2}) == (0, 5, 5)
    back = Declaration.from_bytes(d(True, 2.5).to_bytes())
    assert back.bandwidth == 2.5 and Declaration.from_bytes(d(True).to_bytes()).bandwidth is None


def test_every_peer_derives_the_same_announcer_and_the_duty_rotates():
    validators = [f"5Validator{i}" for i in range(5)]
    first = announcer_order("run", 12, validators)
    assert first == announcer_order("run", 12, list(reversed(validators)) + validators[:2])  # order-free, deduplicated
    assert sorted(first) == sorted(validators)
    leaders = {announcer_order("run", e, validators)[0] for e in range(60)}
    assert len(leaders) == 5  # over 60 epochs every validator announces some
    assert announcer_order("other-run", 12, validators) != first or announcer_order("run", 13, validators) != first


def test_balanced_fractions_finish_every_reducer_together_and_match_the_program():
    import numpy as np

    from dtrain.swarm.load_balance import balanced_fractions, optimize_parts_highs

    b = np.array([10.0, 20.0, 30.0, 40.0, 25.0])
    w = balanced_fractions(b)
    n = len(b)
    times = (1 + (n - 2) * w) / b
    active = w > 0
    assert abs(w.sum() - 1) < 1e-9 and np.ptp(times[active]) < 1e-6
    # its makespan is the program's optimum (the slowest member's own upload included)
    lp = optimize_parts_highs(100, b)
    lp = lp / lp.sum()
    assert max(times.max(), (1 / b).max()) <= max(((1 + (n - 2) * lp) / b).max(), (1 / b).max()) + 1e-6


def test_a_validator_behind_the_first_joins_the_round_announced_at_its_epoch_or_announces_itself():
    import threading
    import time

    from dtrain.neurons.validation_round import round_to_join
    from dtrain.swarm.round_notices import RoundNotice

    validators = [f"5Validator{i}" for i in range(3)]
    first, second, third = announcer_order("run", 7, validators)
    stop = threading.Event()

    def ask(hotkey, notices, wait_s=0.05):
        return round_to_join(lambda: notices, validators=validators, own_hotkey=hotkey, own_peer="me", run_id="run",
                             epoch=7, stop=stop, wait_s=wait_s)

    theirs = RoundNotice("peer-of-first", 7, "run-7-3")
    noise = [RoundNotice("me", 7, "run-7-9"), RoundNotice("peer-of-first", 6, "run-6-2")]  # ours; another epoch
    assert ask(first, [theirs]) is None  # the first announces, whatever it reads
    assert ask(second, noise + [theirs]) == theirs
    assert ask(third, [theirs]) == theirs
    assert ask("5NotAValidator", [theirs]) is None
    # nobody ahead announced: the one k places behind announces itself after k waits
    for hotkey, places in ((second, 1), (third, 2)):
        started = time.monotonic()
        assert ask(hotkey, noise, wait_s=0.3) is None
        assert 0.3 * places - 0.05 <= time.monotonic() - started < 0.3 * places + 1.0
    # a notice that comes while it waits is taken; a DHT that fails is looked at again
    reads = iter([RuntimeError("dht down"), [], [theirs]])

    def read():
        item = next(reads)
        if isinstance(item, Exception):
            raise item
        return item

    assert round_to_join(read, validators=validators, own_hotkey=third, own_peer="me", run_id="run", epoch=7,
                         stop=stop, wait_s=5.0) == theirs
