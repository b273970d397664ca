"""The contribution cheats of dtrain.sandbox.adversary join only a round they have trained for.

With nothing trained in the epoch (just caught up after a refused round left them an epoch
behind) their contribution would bring weight 0, which the swarm neither scale-checks nor
binds: they would pass as honest weight-0 peers, or not, by how the catch-up raced the
round (the flake of tests/test_diloco_e2e.py::test_each_cheat_is_caught_for_its_own_reason).
They sit such a round out; with trained steps they run the honest round, and cheat in it.
"""

from __future__ import annotations

import threading

import pytest

from tests.test_modes import _config, _train

KINDS = ("poisoner", "sign-flip", "zero", "rescale", "noisy", "replay")


def _request(epoch: int):
    from dtrain.api.messages import AllReduceRequest

    return AllReduceRequest(round_id="r", epoch=epoch, weight_cap=64.0, deadline_s=10.0)


@pytest.fixture(scope="module")
def bench():
    from dtrain.neurons.runtime import build_workbench

    return build_workbench(_config("diloco"))


def _cheat(kind: str, bench, epoch: int):
    from dtrain.sandbox.adversary import miner_class
    from dtrain.telemetry import Telemetry

    miner = miner_class(kind)(_config("diloco"), Telemetry("miner"), threading.Event())
    miner.bench, miner.trainer, miner.uid, miner.epoch = bench, bench.trainer, 3, epoch
    return miner


@pytest.mark.parametrize("kind", KINDS)
def test_a_contribution_cheat_sits_out_a_round_it_has_not_trained_for(kind, bench, monkeypatch):
    from dtrain.neurons.miner import Miner

    monkeypatch.setattr(Miner, "_do_round", lambda self, request: pytest.fail("joined with nothing to alter"))
    bench.mode.start_epoch(2)  # what a catch-up to epoch 2 does: the inner steps restart from nothing
    answer = _cheat(kind, bench, epoch=2)._do_round(_request(2))
    assert not answer.joined and answer.epoch == 2 and "nothing trained" in answer.reason


def test_with_trained_steps_it_runs_the_round_and_at_another_epoch_the_honest_path_answers(bench, monkeypatch):
    from dtrain.neurons.miner import Miner

    ran = []
    monkeypatch.setattr(Miner, "_do_round", lambda self, request: ran.append(request.epoch) or "honest path")
    bench.mode.start_epoch(0)
    _train(bench, uid=3, epoch=0)
    assert bench.mode.samples > 0
    assert _cheat("sign-flip", bench, epoch=0)._do_round(_request(0)) == "honest path"
    # a round for another epoch (behind: catch up and decline) is the honest miner's to answer
    bench.mode.start_epoch(1)
    assert _cheat("poisoner", bench, epoch=1)._do_round(_request(2)) == "honest path"
    assert ran == [0, 2]


def test_other_kinds_keep_the_honest_round():
    from dtrain.sandbox.adversary import InflatedWeight, Lazy, Sandbagger
    from dtrain.neurons.miner import Miner

    # an inflated weight with nothing trained is still its own cheat (claims more than committed)
    for cls in (InflatedWeight, Lazy, Sandbagger):
        assert cls._do_round is Miner._do_round
