"""The pure figures of benchmarks/swarm_scale.py (the benchmark itself runs whole sandboxes)."""

from __future__ import annotations

import math

import pytest

from tests.conftest import REPO, load_benchmark

_BENCH = REPO / "benchmarks" / "swarm_scale.py"


@pytest.fixture(scope="module")
def scale():
    return load_benchmark("swarm_scale")


def test_rounds_to_tolerance_is_the_first_round_from_which_every_miner_stays_in_step(scale):
    assert scale.rounds_to_tolerance([True, True, True]) == 1
    assert scale.rounds_to_tolerance([False, True, True]) == 2
    assert scale.rounds_to_tolerance([True, False, True]) == 3  # a relapse restarts the count
    assert scale.rounds_to_tolerance([True, True, False]) is None
    assert scale.rounds_to_tolerance([]) is None


def test_participation_counts_every_miner_in_every_round(scale):
    rows = [{"outcomes": {"miner1": "SUCCESS", "miner2": "SUCCESS"}},
            {"outcomes": {"miner1": "SUCCESS", "miner2": "FAIL"}},
            {"outcomes": {"miner1": "SUCCESS"}}]
    got = scale.participation(rows, ["miner1", "miner2"])
    assert got["participation"] == pytest.approx(4 / 6)
    assert got["ever_failed"] == ["miner2"]
    assert got["outcomes"] == {"FAIL": 1, "SUCCESS": 4, scale.ABSENT: 1}


def test_spread_is_the_median_and_range_of_the_finite_numbers(scale):
    assert scale.spread([3.0, None, 1.0, math.nan, 2.0, True]) == {"median": 2.0, "min": 1.0, "max": 3.0}
    assert scale.spread([None]) is None


def test_help_needs_no_torch(scale):
    import subprocess
    import sys

    code = ("import runpy, sys; sys.argv = ['swarm_scale.py', '--help']\n"
            "try:\n    runpy.run_path(%r, run_name='__main__')\nexcept SystemExit:\n    pass\n"
            "assert 'torch' not in sys.modules and 'hivemind' not in sys.modules" % str(_BENCH))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "--miners" in result.stdout
