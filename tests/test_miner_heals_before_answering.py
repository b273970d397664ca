"""A miner whose replica drifted apart answers a validator's Train query from the swarm's state.

A replica can drift apart through no fault of its own (a round that lost a part on its way
to it). At the validator's epoch, the miner then resynchronises within the query (at most
once per epoch, for at most HEAL_IN_QUERY_S) and answers from the caught-up replica, instead
of failing the query and being paid less for someone else's fault. When no peer serves the
state the validator named, it answers 409 and the training loop keeps trying. A miner a
whole round behind answers 409 at once and catches up from the training loop.

Real workbenches (model, local data, mode) on both sides; the peer that serves state is the
one stand-in, as in tests/test_neuron_parts.py.
"""

from __future__ import annotations

import threading

import pytest
import torch

from dtrain.neurons.catch_up import HEAL_IN_QUERY_S
from tests.test_modes import _config, _train
from tests.test_neuron_parts import _PeerWithState


class _TimedPeer(_PeerWithState):
    """Also records how long each catch-up was allowed to wait."""

    def __init__(self, meta, tensors):
        super().__init__(meta, tensors)
        self.timeouts = []

    def load_state_from_peers(self, timeout_s=None, stop=None):
        self.timeouts.append(timeout_s)
        return super().load_state_from_peers(timeout_s, stop)


def _miner(bench):
    from dtrain.neurons.miner import Miner
    from dtrain.telemetry import Telemetry

    miner = Miner(bench_config(), Telemetry("miner"), threading.Event())
    miner.bench, miner.trainer, miner.uid = bench, bench.trainer, 3
    miner._refresh_digest()
    return miner


def bench_config():
    return _config("gradient")


def _query(epoch: int, sketch) -> object:
    from dtrain.api.messages import TrainRequest

    return TrainRequest(nonce="ab12", epoch=epoch, pages=1, micro_batch_size=2, params_sketch=tuple(sketch))


def _swarm_one_step_ahead():
    """The swarm's replica after one round: the validator's, and what an honest peer serves."""
    from dtrain.neurons.runtime import build_workbench

    swarm = build_workbench(bench_config())
    _train(swarm, uid=1)
    swarm.trainer.step()
    return swarm


@pytest.fixture
def swarm():
    return _swarm_one_step_ahead()


def test_a_miner_a_round_behind_answers_409_at_once_and_the_loop_catches_up(swarm):
    from dtrain.api.server import HandlerError
    from dtrain.neurons.runtime import build_workbench
    from dtrain.neurons.sync import export_state
    from dtrain.training.replica import params_sketch

    miner = _miner(build_workbench(bench_config()))
    miner.swarm = _PeerWithState(*export_state(swarm.trainer, epoch=1))
    target = params_sketch(swarm.trainer.params)
    with pytest.raises(HandlerError) as behind:
        miner._do_train(_query(1, target))
    assert behind.value.status == 409 and miner.epoch == 0  # the query did not wait for a whole round's state
    miner.catch_up.run_pending()
    assert miner.epoch == 1 and miner._near(target) and miner._checkpoint_due
    assert miner._do_train(_query(1, target)).epoch == 1


def test_a_drifted_miner_at_the_validators_epoch_resyncs_and_answers(swarm):
    from dtrain.neurons.runtime import build_workbench
    from dtrain.neurons.sync import export_state
    from dtrain.training.replica import params_sketch

    miner = _miner(build_workbench(bench_config()))
    miner.epoch = 1
    with torch.no_grad():  # e.g. a part of the last round kept this miner's own values
        for p in miner.trainer.params:
            p.add_(1e-3 * torch.randn_like(p))
    target = params_sketch(swarm.trainer.params)
    assert not miner._near(target)
    miner.swarm = _TimedPeer(*export_state(swarm.trainer, epoch=1))
    answer = miner._do_train(_query(1, target))
    assert answer.epoch == 1 and miner._near(target) and len(answer.microbatches) >= 1
    assert miner.swarm.timeouts == [HEAL_IN_QUERY_S]  # the query waited at most this long for the state
    assert miner.catch_up.pending is None and miner._checkpoint_due  # the loop checkpoints, not the query


def test_no_matching_peer_state_gives_409_and_the_loop_keeps_trying(swarm):
    from dtrain.api.server import HandlerError
    from dtrain.neurons.catch_up import CATCH_UP_ATTEMPTS
    from dtrain.neurons.runtime import build_workbench
    from dtrain.neurons.sync import export_state
    from dtrain.training.replica import params_sketch

    miner = _miner(build_workbench(bench_config()))
    miner.epoch = 1  # at the validator's epoch, but still holding the pre-round parameters
    stale = build_workbench(bench_config())  # a peer that serves the same stale state
    miner.swarm = _PeerWithState(*export_state(stale.trainer, epoch=1))
    query = _query(1, params_sketch(swarm.trainer.params))
    with pytest.raises(HandlerError) as failed:
        miner._do_train(query)
    assert failed.value.status == 409 and "replica tolerance" in str(failed.value)
    assert miner.catch_up.pending is not None and miner.catch_up.attempts == CATCH_UP_ATTEMPTS

    # A second query at the same epoch does not wait on another catch-up: it only schedules one.
    attempts_before = []
    miner._catch_up = lambda target, **_: attempts_before.append(target) or False
    with pytest.raises(HandlerError):
        miner._do_train(query)
    assert attempts_before == []

    # The training loop's attempts: failures count down, then it stops until the next query.
    for _ in range(CATCH_UP_ATTEMPTS):
        miner.catch_up.run_pending()
    assert len(attempts_before) == CATCH_UP_ATTEMPTS and miner.catch_up.pending is None


def test_the_loops_retry_reaches_the_swarm_once_a_peer_serves_it(swarm):
    from dtrain.neurons.base import CatchUpTarget
    from dtrain.neurons.runtime import build_workbench
    from dtrain.neurons.sync import export_state
    from dtrain.training.replica import params_sketch

    miner = _miner(build_workbench(bench_config()))
    stale = build_workbench(bench_config())
    miner.swarm = _PeerWithState(*export_state(stale.trainer, epoch=0))  # nobody has applied the round yet
    target = CatchUpTarget(epoch=1, sketch=params_sketch(swarm.trainer.params))
    miner.catch_up.schedule(target)
    miner.catch_up.run_pending()
    assert miner.epoch == 0 and miner.catch_up.pending == target
    miner.swarm = _PeerWithState(*export_state(swarm.trainer, epoch=1))  # now one has
    miner.catch_up.at = 0.0
    miner.catch_up.run_pending()
    assert miner.epoch == 1 and miner.catch_up.pending is None and miner._near(target.sketch)
    # and a pending target the miner has already reached is dropped without loading anything
    miner.catch_up.schedule(CatchUpTarget(epoch=1))
    miner.swarm = None
    miner.catch_up.run_pending()
    assert miner.catch_up.pending is None


def test_a_miner_the_group_averaged_without_catches_up_at_once():
    # Refused or left out of a round that the others averaged: the swarm is at the next epoch,
    # so the miner schedules that catch-up itself instead of waiting for the next Train query
    # to find it a round behind (and to be scored down for it).
    from dtrain.neurons.miner import Miner
    from dtrain.swarm.records import Outcome, PeerResult, RoundRecord
    from dtrain.telemetry import Telemetry

    miner = Miner(bench_config(), Telemetry("miner"), threading.Event())

    def record(mine: Outcome, others_weight: float, group=("me", "a", "b")) -> RoundRecord:
        r = RoundRecord(round_id="r", local_peer_id="me", started_at=0.0, duration_s=1.0, num_elements=10,
                        model_fingerprint="fp", compression="none", mode="gradient")
        r.group = list(group)
        r.peers = [PeerResult("me", mine, 8.0, 8.0 if mine == Outcome.SUCCESS else 0.0)]
        r.peers += [PeerResult(p, Outcome.SUCCESS, 8.0, others_weight / 2) for p in group if p != "me"]
        return r

    assert miner._group_went_on_without_us(record(Outcome.FAIL, 16.0))
    assert not miner._group_went_on_without_us(record(Outcome.SUCCESS, 16.0))  # we took the step too
    assert not miner._group_went_on_without_us(record(Outcome.FAIL, 0.0))  # nobody averaged anything
    assert not miner._group_went_on_without_us(record(Outcome.FAIL, 16.0, group=("me",)))  # no group at all
