"""benchmarks/utilization.py: what it computes from two reads of a miner's status, what one
miner trains alone, and the previous release's rule it runs beside the release's."""

from __future__ import annotations

import pytest

from tests.conftest import load_benchmark

utilization = load_benchmark("utilization")


def test_busy_fraction_and_rate_are_over_the_wall_time_between_two_reads():
    first = {"t": 100.0, "train_busy_s": 10.0, "tokens": 1000}
    last = {"t": 160.0, "train_busy_s": 67.0, "tokens": 61000}
    got = utilization.busy_window(first, last)
    assert got == {"wall_s": 60.0, "busy_fraction": 0.95, "tokens_per_s": 1000.0}
    # a miner that waited for the round after one local batch: a few seconds of sixty
    idle = utilization.busy_window(first, {"t": 160.0, "train_busy_s": 11.2, "tokens": 2000})
    assert idle["busy_fraction"] == 0.02
    with pytest.raises(ValueError):
        utilization.busy_window(last, first)


def test_scaling_is_the_swarm_rate_over_the_miners_rates_alone():
    assert utilization.scaling(2700.0, 1000.0, 3) == pytest.approx(0.9)
    assert utilization.scaling(0.0, 1000.0, 3) == 0.0


def test_the_previous_arm_is_the_previous_release_rule(tmp_path):
    # capped: target_batch_size = local_batch_size, so gradient mode stops at one local batch
    from dtrain.config.loading import load_config
    from dtrain.sandbox.orchestrator import Sandbox, SandboxOptions
    from dtrain.sandbox import layout
    from dtrain.modes.base import ModeSettings

    sandbox = Sandbox(SandboxOptions(miners=1, rounds=1, directory=tmp_path / "box"))
    members = sandbox.setup()
    for capped in (True, False):
        utilization._configure(sandbox.root, members, round_interval=60.0, capped=capped)
        for member in members:
            cfg, _ = load_config(layout.neuron_dir(sandbox.root, member.name) / "config.toml", env={})
            assert cfg.validator.round_interval_s == 60.0
            assert (cfg.training.local_batch_size, cfg.data.page_sequences, cfg.allreduce.diloco_inner_steps) == \
                (64, 8, 500)  # the shipped values, not the sandbox's
            assert cfg.model.preset == "tiny"
            limit = ModeSettings.from_config(cfg)
            want = 64 if capped else 32768
            assert cfg.allreduce.target_batch_size == want == max(limit.target_batch_size, limit.local_batch_size)


def test_one_miner_alone_trains_at_a_positive_rate():
    assert utilization.alone_tokens_per_s("gradient", 1.0) > 0
