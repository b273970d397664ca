"""One set of averaging defaults: AveragingConfig's are the config schema's ([allreduce])."""

from __future__ import annotations

import dataclasses

import pytest

from dtrain.config import AllReduceConfig, Config, ModelConfig
from dtrain.swarm.averaging import AveragingConfig, settings_from
from dtrain.swarm.averaging.settings import sender_timeout_for
from dtrain.swarm.deadlines import matchmaking_timeout_s



def test_the_library_defaults_are_what_a_default_neuron_runs():
    assert AveragingConfig() == settings_from(Config(), None)


def test_every_mapped_default_equals_the_schema():
    a, d = AllReduceConfig(), AveragingConfig()
    assert d.prefix == f"dtrain-{ModelConfig().run_id}"
    assert d.min_group_size == a.min_group_size
    assert d.target_group_size == a.target_group_size == 256
    assert d.min_matchmaking_time_s == a.matchmaking_time
    assert d.request_timeout_s == a.request_timeout
    assert d.allreduce_timeout_s == a.allreduce_timeout
    assert d.sender_timeout_s == sender_timeout_for(a.allreduce_timeout) == 30.0
    assert d.matchmaking_timeout_s == matchmaking_timeout_s(a)
    assert d.compression == a.compression
    assert d.aggregation == a.aggregation == "centered_clip"
    assert d.require_commitments is True
    assert d.log_path is None


def test_settings_follow_the_config(tmp_path):
    cfg = Config()
    cfg.model.run_id = "r7"
    a = cfg.allreduce
    a.min_group_size, a.target_group_size, a.matchmaking_time, a.request_timeout = 3, 9, 4.0, 1.5
    a.allreduce_timeout, a.compression, a.aggregation = 8.0, "8bit", "mean"
    s = settings_from(cfg, tmp_path / "rounds.jsonl")
    assert (s.prefix, s.min_group_size, s.target_group_size, s.min_matchmaking_time_s, s.request_timeout_s) == \
        ("dtrain-r7", 3, 9, 4.0, 1.5)
    assert (s.allreduce_timeout_s, s.sender_timeout_s, s.matchmaking_timeout_s) == (8.0, 5.0, 12.0)
    assert (s.compression, s.aggregation, s.require_commitments) == ("8bit", "mean", True)
    assert s.log_path == str(tmp_path / "rounds.jsonl")


def test_the_neurons_use_the_same_mapping(tmp_path):
    from dtrain.neurons.runtime import averaging_config

    cfg = Config()
    cfg.allreduce.target_group_size = 5
    assert averaging_config(cfg, tmp_path / "r.jsonl") == settings_from(cfg, tmp_path / "r.jsonl")


def test_sender_timeout_rule():
    assert sender_timeout_for(120.0) == 30.0
    assert sender_timeout_for(8.0) == 5.0
    assert sender_timeout_for(3.0) == 3.0  # never longer than the all-reduce itself


@pytest.mark.parametrize("field,value,message", [
    ("aggregation", "median", "aggregation must be 'mean' or 'centered_clip'"),
    ("compression", "4bit", "unknown compression '4bit'"),
])
def test_an_unknown_rule_or_codec_is_a_clear_error(field, value, message):
    with pytest.raises(ValueError, match=message):
        AveragingConfig(**{field: value})
    with pytest.raises(ValueError, match=message):
        AveragingConfig().replace(**{field: value})


def test_settings_are_frozen_and_replace_copies():
    d = AveragingConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.prefix = "x"  # type: ignore[misc]
    e = d.replace(prefix="x", aggregation="mean")
    assert (e.prefix, e.aggregation, d.prefix) == ("x", "mean", AveragingConfig().prefix)


def test_the_part_size_grows_with_the_vector():
    from dtrain.swarm.averaging.settings import MAX_PART_BYTES, MIN_PART_BYTES, PARTS_PER_VECTOR, part_size_for

    # a power of two within the bounds, never shrinking as the vector grows
    sizes = [1, 4096, 2**20, 3 * 2**20, 2**23, 2**23 + 4, 2**24 - 4, 2**24, 10**9, 4 * 124_439_808]
    got = [part_size_for(b) for b in sizes]
    assert all(MIN_PART_BYTES <= p <= MAX_PART_BYTES and p & (p - 1) == 0 for p in got)
    assert got == sorted(got)
    # hivemind's 512 KiB from 16 MiB up (every GPT-2 preset)
    assert (part_size_for(2**24), part_size_for(10**9), part_size_for(2**24 - 4)) == (2**19, 2**19, 2**18)
    # below that, a group of 32 (the size the rule was measured at) still gives every reducer a part
    for b in (2**22, 2**23, 2**24 - 4, 12 * 2**20):
        assert b // part_size_for(b) >= PARTS_PER_VECTOR == 32
    assert part_size_for(2**20) == MIN_PART_BYTES
    # unset in the settings: the swarm that knows its vector sets it (test_swarm_averaging.py)
    assert AveragingConfig().part_size_bytes is None


def test_derived_timeouts_follow_the_settings_they_derive_from():
    from dtrain.swarm.averaging.settings import sender_timeout_for

    short = AveragingConfig(allreduce_timeout_s=10.0, min_matchmaking_time_s=2.0)
    assert short.sender_timeout_s == sender_timeout_for(10.0) <= 10.0
    assert short.matchmaking_timeout_s == 6.0
    # replace() keeps a derived value derived, and an explicit one explicit
    longer = short.replace(allreduce_timeout_s=200.0, min_matchmaking_time_s=20.0)
    assert (longer.sender_timeout_s, longer.matchmaking_timeout_s) == (sender_timeout_for(200.0), 60.0)
    pinned = AveragingConfig(sender_timeout_s=7.0, matchmaking_timeout_s=99.0).replace(allreduce_timeout_s=200.0)
    assert (pinned.sender_timeout_s, pinned.matchmaking_timeout_s) == (7.0, 99.0)
    assert AveragingConfig(sender_timeout_s=None).sender_timeout_s is None  # no limit stays possible
