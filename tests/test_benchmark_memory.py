"""benchmarks/memory.py's figures: the worst miner tree and the validator tree of a sandbox
summary, and bytes per parameter beyond the tiny preset's tree (the runtime), as medians with
their spread. The runs themselves are real sandboxes (minutes each); here, the arithmetic."""

from __future__ import annotations

import pytest

from tests.conftest import load_benchmark

memory = load_benchmark("memory")
GB = 1e9


def _summary(miners: list[float], validator: float, params: int, statuses=("success", "success")) -> dict:
    return {"model": {"preset": "x", "parameters": params},
            "miners": [{"name": f"miner{i}"} for i in range(1, len(miners) + 1)],
            "memory": [{"name": "validator", "peak_pss": validator * GB, "processes": {"neuron": 1}}]
            + [{"name": f"miner{i}", "peak_pss": m * GB, "processes": {"neuron": i}} for i, m in enumerate(miners, 1)],
            "rounds": [{"status": s} for s in statuses], "loss": {"curve": [2.0, 1.0]}}


def test_the_worst_miner_tree_counts_and_failed_rounds_are_flagged():
    peaks = memory.peaks_of(_summary([3.0, 3.5], 4.0, 100, statuses=("success", "failed")))
    assert peaks["miner"] == 3.5 * GB and peaks["miner_processes"] == {"neuron": 2}
    assert peaks["validator"] == 4.0 * GB and not peaks["rounds_ok"]
    with pytest.raises(RuntimeError, match="no memory rows"):
        memory.peaks_of({"miners": [], "memory": []})


def test_bytes_per_parameter_are_beyond_the_runtime_trees_median():
    tiny = [memory.peaks_of(_summary([1.0], 1.2, 1_000)), memory.peaks_of(_summary([0.9], 1.1, 1_000)),
            memory.peaks_of(_summary([1.1], 1.3, 1_000))]
    big = [memory.peaks_of(_summary([m], v, 100_000_000)) for m, v in ((3.0, 4.2), (3.4, 4.0), (3.2, 4.6))]
    figures = memory.summarise({"tiny": tiny, "gpt2-124m": big})
    f = figures["gpt2-124m"]
    assert f["miner_peak"]["median"] == 3.2 * GB
    # (3.2 GB - the tiny miner's median 1.0 GB) / 1e8 parameters = 22 bytes per parameter
    assert f["miner_bytes_per_param"]["median"] == pytest.approx(22.0)
    spread = f["miner_bytes_per_param"]
    assert spread["min"] == pytest.approx(20.0) and spread["max"] == pytest.approx(24.0)
    assert f["validator_bytes_per_param"]["median"] == pytest.approx((4.2 - 1.2) * GB / 1e8)
    assert f["ratio_to_adamw"] == pytest.approx(22.0 / 16.0)
    assert "miner_bytes_per_param" not in figures["tiny"] and f["rounds_ok"]
    assert "gpt2-124m" in memory.render({"figures": {"diloco": figures}})
