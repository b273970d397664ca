"""The neuron's own parts: job hand-off, state hand-over, query validation, discovery filtering."""

from __future__ import annotations

import threading

import pytest
import torch

from dtrain.neurons.base import CatchUpTarget
from dtrain.neurons.jobs import JobQueue


def test_jobs_run_on_the_thread_that_drains_the_queue():
    jobs = JobQueue()
    owner = threading.current_thread()
    results = []

    def handler():  # an API worker thread waiting for the training thread
        future = jobs.submit(lambda: threading.current_thread() is owner)
        results.append(future.result(timeout=10))

    t = threading.Thread(target=handler)
    t.start()
    while not results:
        jobs.run_pending(wait_s=0.1)
    t.join()
    assert results == [True]


def test_job_errors_reach_the_waiting_handler_and_cancel_all_fails_pending():
    jobs = JobQueue()
    failing = jobs.submit(lambda: 1 / 0)
    jobs.run_pending()
    with pytest.raises(ZeroDivisionError):
        failing.result(timeout=1)
    pending = jobs.submit(lambda: "never")
    jobs.cancel_all(RuntimeError("shutting down"))
    with pytest.raises(RuntimeError, match="shutting down"):
        pending.result(timeout=1)


def _trainer(seed: int):
    from dtrain.training.models import create_model
    from dtrain.training.trainer import Trainer, TrainerConfig

    model = create_model("tiny", vocab_size=300, n_positions=32, seed=seed)
    return Trainer(model, TrainerConfig(micro_batch_size=2, local_batch_size=4, lr=1e-2, warmup_steps=2))


def test_state_hand_over_makes_a_lagging_replica_identical():
    from dtrain.neurons.runtime import params_digest
    from dtrain.neurons.sync import export_state, import_state

    ahead, behind = _trainer(0), _trainer(0)
    x = torch.randint(0, 300, (4, 32))
    for _ in range(3):
        ahead.train_step(x)
    meta, tensors = export_state(ahead, epoch=3)
    assert import_state(behind, meta, tensors) == 3
    assert params_digest(behind) == params_digest(ahead)
    assert behind.lr == ahead.lr
    # Same moments and schedule: the next identical step keeps them identical.
    ahead.train_step(x)
    behind.train_step(x)
    assert params_digest(behind) == params_digest(ahead)


def test_diloco_outer_state_hand_over_keeps_the_nesterov_momentum():
    """DiLoCo's shared replica steps with SGD + Nesterov momentum: a caught-up peer needs the
    momentum buffer too, or its next outer step differs from everyone else's."""
    from dtrain.neurons.runtime import params_digest
    from dtrain.neurons.sync import export_state, import_state
    from dtrain.training.models import create_model
    from dtrain.training.trainer import Trainer, TrainerConfig

    def outer(seed):
        cfg = TrainerConfig(optimizer="nesterov", lr=0.7, momentum=0.9, weight_decay=0.0, warmup_steps=0,
                            total_steps=1, min_lr_ratio=1.0, grad_clip=None)
        return Trainer(create_model("tiny", vocab_size=300, n_positions=32, seed=seed), cfg)

    ahead, behind = outer(0), outer(0)
    g = [torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 1e-3 for i, p in enumerate(ahead.params)]
    for _ in range(2):
        ahead.set_gradients(g, num_samples=1)
        ahead.step()
    meta, tensors = export_state(ahead, epoch=2)
    assert import_state(behind, meta, tensors) == 2
    assert params_digest(behind) == params_digest(ahead)
    for t in (ahead, behind):
        t.set_gradients(g, num_samples=1)
        t.step()
    assert params_digest(behind) == params_digest(ahead)


# Fused AdamW keeps ``step`` on the parameters' device; dtrain's LAMB keeps it on the host, as
# it creates it (dtrain/training/lamb.py), like torch's unfused kernels. Moments always follow
# the parameters.
@pytest.mark.parametrize("optimizer,step_device", [("adamw", "meta"), ("lamb", "cpu")])
def test_a_caught_up_optimizer_keeps_its_state_on_the_parameters_device(optimizer, step_device):
    """The peer's state arrives as CPU tensors; fused AdamW (used on CUDA) refuses a CPU
    ``step`` beside parameters elsewhere. The meta device stands in for a GPU here: a
    state tensor left on the CPU is as visible on it as on CUDA, and it runs on any machine."""
    from dtrain.neurons.sync import export_state, import_state
    from dtrain.training.models import create_model
    from dtrain.training.trainer import Trainer, TrainerConfig

    ahead = _trainer(0)
    ahead.config.optimizer = optimizer
    x = torch.randint(0, 300, (4, 32))
    ahead.train_step(x)
    meta, tensors = export_state(ahead, epoch=1)
    assert meta["opt_step"] > 0
    assert all(t.device.type == "cpu" for t in tensors)

    model = create_model("tiny", vocab_size=300, n_positions=32, seed=0).to("meta")
    model.tie_weights()  # moving to meta unties lm_head from the embedding; a GPU move does not
    behind = Trainer(model, TrainerConfig(device="meta", optimizer=optimizer, fused=optimizer == "adamw" or None))
    import_state(behind, meta, tensors)
    placed = [(key, value.device) for p in behind.params for key, value in behind.optimizer.state[p].items()
              if torch.is_tensor(value)]
    assert {key for key, _ in placed} >= {"step", "exp_avg", "exp_avg_sq"}
    assert {str(device) for key, device in placed if key != "step"} == {"meta"}, placed
    assert {str(device) for key, device in placed if key == "step"} == {step_device}, placed
    assert all(p.device.type == "meta" for p in behind.params)


def test_state_for_another_model_is_refused():
    from dtrain.neurons.sync import export_state, import_state
    from dtrain.training.models import create_model
    from dtrain.training.trainer import Trainer, TrainerConfig

    other = Trainer(create_model("tiny", vocab_size=300, n_positions=64, seed=0), TrainerConfig())
    meta, tensors = export_state(other, epoch=1)
    with pytest.raises(ValueError):
        import_state(_trainer(0), meta, tensors)


def test_discovery_keeps_only_addresses_of_the_committed_peer(monkeypatch):
    from dtrain.chain.commitment import MinerCommitment
    from dtrain.neurons import discovery

    honest = MinerCommitment(peer_id="QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N", api="127.0.0.1:1", repo="x")
    from dtrain.api.messages import StatusResponse

    docs = {"127.0.0.1:1": StatusResponse(maddrs=("/ip4/127.0.0.1/tcp/5/p2p/" + honest.peer_id,
                                                  "/ip4/6.6.6.6/tcp/5/p2p/QmSomeoneElse"))}
    monkeypatch.setattr(discovery, "_status", lambda api, timeout: docs.get(api))
    assert discovery.peer_maddrs([honest]) == ["/ip4/127.0.0.1/tcp/5/p2p/" + honest.peer_id]
    assert discovery.peer_maddrs([honest], exclude_peer=honest.peer_id) == []


def test_state_slice_wraps_and_matches_the_flat_parameters():
    from dtrain.neurons.sync import state_slice

    trainer = _trainer(0)
    flat = trainer.flat_parameters().numpy().tobytes()
    assert state_slice(trainer, 0, 64) == flat[:64]
    assert state_slice(trainer, 10, 7) == flat[10:17]  # not aligned to a float
    tail = len(flat) - 5
    assert state_slice(trainer, tail, 12) == flat[tail:] + flat[:7]  # wraps around
    assert state_slice(trainer, len(flat) + 3, 4) == flat[3:7]  # offsets are taken modulo the size
    assert len(state_slice(trainer, 0, 3 * len(flat))) == 3 * len(flat)


class _PeerWithState:
    """Stands in for the hivemind swarm: hands out whatever state a peer would serve."""

    def __init__(self, meta, tensors):
        self.loaded = (meta, tensors)

    def load_state_from_peers(self, timeout_s=None, stop=None):
        return self.loaded

    def set_state_priority(self, priority):
        self.priority = priority


def _neuron(trainer):
    import threading

    from dtrain.config import Config
    from dtrain.neurons.base import NeuronBase
    from dtrain.telemetry import Telemetry

    neuron = NeuronBase(Config(), Telemetry("miner"), threading.Event())
    neuron.trainer = trainer
    neuron._refresh_digest()
    return neuron


def test_catch_up_keeps_a_state_that_matches_and_refuses_one_that_does_not():
    from dtrain.neurons.runtime import params_digest
    from dtrain.neurons.sync import export_state
    from dtrain.training.replica import params_sketch

    swarm_state = _trainer(0)
    x = torch.randint(0, 300, (4, 32))
    swarm_state.train_step(x)
    good_meta, good_tensors = export_state(swarm_state, epoch=1)
    target = CatchUpTarget(epoch=1, sketch=params_sketch(swarm_state.params))

    poisoned = _trainer(0)
    with torch.no_grad():
        poisoned.params[0].mul_(100.0)
    bad_meta, bad_tensors = export_state(poisoned, epoch=1)

    lagging = _neuron(_trainer(0))
    own_digest = lagging._digest
    lagging.swarm = _PeerWithState(bad_meta, [t.clone() for t in bad_tensors])
    assert lagging._catch_up(target) is False
    assert lagging.epoch == 0 and params_digest(lagging.trainer) == own_digest  # own state put back

    lagging.swarm = _PeerWithState(good_meta, [t.clone() for t in good_tensors])
    assert lagging._catch_up(target) is True
    assert lagging.epoch == 1 and lagging._digest == params_digest(swarm_state)
    assert lagging.swarm.priority == 1


def test_a_replica_that_drifted_at_the_same_epoch_resyncs_within_tolerance():
    """Honest replicas differ in the last bits (fused vs plain AdamW): a peer's state within the
    replica tolerance of the target is accepted, one a step away is not."""
    from dtrain.neurons.sync import export_state
    from dtrain.training.replica import REPLICA_RTOL, params_distance, params_sketch

    reference = _trainer(0)
    x = torch.randint(0, 300, (4, 32))
    reference.train_step(x)
    target = CatchUpTarget(epoch=1, sketch=params_sketch(reference.params))

    other_hardware = _trainer(0)  # bits differ from the reference, well inside the tolerance
    other_hardware.train_step(x)
    with torch.no_grad():
        for p in other_hardware.params:
            p.mul_(1 + 1e-7)
    assert 0 < params_distance(other_hardware.params, reference.params) < REPLICA_RTOL

    one_step_off = _trainer(0)
    one_step_off.train_step(x)
    one_step_off.train_step(torch.randint(0, 300, (4, 32)))

    drifted = _neuron(_trainer(0))
    drifted.epoch = 1
    with torch.no_grad():
        for p in drifted.trainer.params:
            p.add_(1e-3 * torch.randn_like(p))
    assert not drifted._near(target.sketch)
    drifted.trainer.accumulate(torch.randint(0, 300, (4, 32)))
    batch = [g.clone() for g in drifted.trainer.gradients()]
    drifted.swarm = _PeerWithState(*export_state(one_step_off, epoch=1))
    assert drifted._catch_up(target) is False and not drifted._near(target.sketch)
    # a refused state does not cost the local batch trained so far
    assert drifted.trainer.accumulated_samples == 4
    assert all(torch.equal(a, b) for a, b in zip(batch, drifted.trainer.gradients()))
    drifted.swarm = _PeerWithState(*export_state(other_hardware, epoch=1))
    assert drifted._catch_up(target) is True and drifted._near(target.sketch) and drifted.epoch == 1


def test_catch_up_never_goes_back_to_an_older_state():
    from dtrain.neurons.runtime import params_digest
    from dtrain.neurons.sync import export_state

    old = _trainer(0)
    meta, tensors = export_state(old, epoch=2)
    ahead = _neuron(_trainer(0))
    ahead.epoch = 5
    before = params_digest(ahead.trainer)
    ahead.swarm = _PeerWithState(meta, [t.clone() for t in tensors])
    assert ahead._catch_up() is False
    assert ahead.epoch == 5 and params_digest(ahead.trainer) == before


def test_swarm_fingerprint_tells_apart_peers_whose_swarm_wide_settings_differ():
    from dtrain.config import Config
    from dtrain.neurons.runtime import swarm_fingerprint

    base = Config()
    fp = swarm_fingerprint(base, "model-a")
    assert fp == swarm_fingerprint(Config(), "model-a")  # deterministic across processes
    assert fp != swarm_fingerprint(base, "model-b")       # another architecture
    for section, key, value in [("training", "lr", 1e-3), ("data", "page_sequences", 4),
                                ("training", "local_batch_size", 32), ("model", "run_id", "other"),
                                ("allreduce", "mode", "diloco")]:
        cfg = Config()
        setattr(getattr(cfg, section), key, value)
        assert swarm_fingerprint(cfg, "model-a") != fp, f"{section}.{key}"
    # a machine's own choices do not split the swarm
    for section, key, value in [("training", "device", "cuda"), ("training", "precision", "bf16"),
                                ("training", "micro_batch_size", 2), ("api", "port", 9000)]:
        cfg = Config()
        setattr(getattr(cfg, section), key, value)
        assert swarm_fingerprint(cfg, "model-a") == fp, f"{section}.{key}"
    # Hub dataset names are not read for local text
    local, local_other = Config(), Config()
    local.data.source = local_other.data.source = "local"
    local_other.data.dataset = "someone/else"
    assert swarm_fingerprint(local, "m") == swarm_fingerprint(local_other, "m")


def test_a_validator_names_the_fellow_validators_of_its_last_group_and_only_them():
    from dtrain.neurons.validator import fellow_validators
    from dtrain.swarm.records import Outcome, PeerResult, RoundRecord

    peers = [PeerResult("me", Outcome.SUCCESS, 0.0), PeerResult("v2", Outcome.SUCCESS, 0.0),
             PeerResult("m1", Outcome.SUCCESS, 64.0), PeerResult("lazy", Outcome.SUCCESS, 0.0),
             PeerResult("v3", Outcome.SUCCESS, 0.0)]
    record = RoundRecord(round_id="g", local_peer_id="me", started_at=0.0, duration_s=1.0, peers=peers)
    # a miner with no weight (it trained nothing) is a committed miner, not a validator
    assert fellow_validators(record, {"m1", "lazy"}, "me") == {"v2", "v3"}
    failed = RoundRecord(round_id="", local_peer_id="me", started_at=0.0, duration_s=1.0, error="no group")
    assert fellow_validators(failed, {"m1"}, "me") == set()
