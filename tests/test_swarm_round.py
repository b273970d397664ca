"""One round, one object (dtrain/swarm/round.py): a validator announces, miners declare and
average, a late miner sits out; real peers, a real hotkey, dtrain's own protocols."""

from __future__ import annotations

import time

import pytest
import torch

from dtrain.swarm.codecs import part_codec
from dtrain.swarm.round import Rounds, RoundSettings, Stage
from dtrain.swarm.transport import Transport

NUM_PARTS = 4


def _parts(seed: int):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(300, generator=gen) for _ in range(NUM_PARTS)]


@pytest.mark.slow
def test_announced_round_averages_its_members_and_a_late_one_sits_out(rounds):
    nodes, _ = rounds
    validator, miners = nodes[0], nodes[1:]
    settings = RoundSettings(window_s=2.0, sender_timeout_s=10, reducer_timeout_s=10)
    codec = part_codec("none")
    parts = {i: _parts(i) for i in range(4)}
    originals = {i: [p.clone() for p in parts[i]] for i in range(4)}
    announced = validator.announce("e9", 9, parts[0], codec, settings)
    joined = [miners[i].join(validator.transport.peer_id, "e9", 9, parts[i + 1], codec, weight=float(i + 1),
                             settings=settings) for i in range(2)]
    assert announced.stage == Stage.DECLARING and not announced.finished  # it runs off our thread
    time.sleep(settings.window_s + 1.0)
    late = miners[2].join(validator.transport.peer_id, "e9", 9, parts[3], codec, weight=3.0, settings=settings)
    for rnd in [announced, *joined, late]:
        rnd.result(timeout_s=60)
    assert late.stage == Stage.SAT_OUT and "closed" in late.reason
    assert all(parts[3][g].equal(originals[3][g]) for g in range(NUM_PARTS))  # a sitter keeps its values
    expected = [(1 * originals[1][g] + 2 * originals[2][g]) / 3 for g in range(NUM_PARTS)]
    for i, rnd in ((0, announced), (1, joined[0]), (2, joined[1])):
        assert rnd.stage == Stage.DONE, (rnd.stage, rnd.reason)
        assert rnd.membership.membership.peers == announced.membership.membership.peers
        assert list(rnd.times) == ["declaring", "averaging", "done"]
        for g in range(NUM_PARTS):
            torch.testing.assert_close(parts[i][g], expected[g], rtol=1e-5, atol=1e-6)
    assert len(announced.membership.membership.peers) == 3


@pytest.mark.slow
def test_a_membership_from_a_hotkey_that_may_not_announce_fails_the_round(rounds, four_peers):
    nodes, _ = rounds
    validator = nodes[0]
    doubting = Rounds(Transport(four_peers[1].transport.dht, prefix="doubt").start(), may_announce=lambda key: False)
    doubtful_validator = Rounds(Transport(four_peers[0].transport.dht, prefix="doubt").start(),
                                may_announce=lambda key: True, wallet=validator.desk.wallet)
    try:
        settings = RoundSettings(window_s=1.5, sender_timeout_s=5, reducer_timeout_s=5)
        codec = part_codec("none")
        announced = doubtful_validator.announce("e1", 1, _parts(7), codec, settings)
        joined = doubting.join(doubtful_validator.transport.peer_id, "e1", 1, _parts(8), codec, 1.0, settings)
        joined.result(timeout_s=60)
        announced.result(timeout_s=60)
        assert joined.stage == Stage.FAILED and "may not announce rounds" in joined.reason
    finally:
        doubting.transport.shutdown()
        doubtful_validator.transport.shutdown()
