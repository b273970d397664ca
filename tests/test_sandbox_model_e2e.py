"""End to end: ``dtrain sandbox --model gpt2-124m`` trains a real-size model on this machine's
CPU cores (86.9M parameters with the shipped tokenizer), every round SUCCESS with a falling loss,
and its summary shows the parameter count and every neuron's peak memory.

Gradient mode: it is the issue's own run (``--rounds 3``) and the quicker mode at this size on
2 cores (about 3 minutes; DiLoCo's replays make it about 4). DiLoCo's memory at this size is
what ``benchmarks/memory.py`` measures (docs/operators.md, "Memory")."""

from __future__ import annotations

import json
import shutil
import tempfile

import pytest

from tests.conftest import run_dtrain

# Three neurons each keep two checkpoints of the model and its AdamW moments (12 bytes per
# parameter, about 1 GB each at this size), the store keeps the pushed models: about 8 GB.
NEEDS_DISK = 12 << 30
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400),
              pytest.mark.skipif(shutil.disk_usage(tempfile.gettempdir()).free < NEEDS_DISK,
                                 reason="a gpt2-124m sandbox writes about 8 GB of checkpoints; less than 12 GB free")]

GPT2_124M_SHIPPED_TOKENIZER = 86_913_792  # shipped tokenizer, 64 positions (the sandbox scale)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("sandbox") / "box"
    result = run_dtrain("sandbox", "--model", "gpt2-124m", "--miners", "2", "--rounds", "3", "--dir", str(root),
                        "--json", timeout=2000)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def test_a_gpt2_124m_sandbox_succeeds_every_round_and_lowers_the_loss(run):
    assert [r["status"] for r in run["rounds"]] == ["success"] * 3, run["rounds"]
    assert all(len(r["averaged"]) == 2 for r in run["rounds"])
    loss = run["loss"]
    assert len(loss["curve"]) == 4 and loss["end"] < loss["start"], loss
    assert all(m["weight"] > 0 for m in run["miners"])


def test_the_summary_shows_the_parameters_and_each_neurons_peak_memory(run):
    assert run["model"] == {"preset": "gpt2-124m", "parameters": GPT2_124M_SHIPPED_TOKENIZER}
    rows = {r["name"]: r for r in run["memory"]}
    assert set(rows) == {"validator", "miner1", "miner2"}
    for row in rows.values():
        procs = row["processes"]
        assert {"neuron", "averager", "dht", "p2pd"} <= set(procs), procs
        # the neuron holds at least the fp32 model; no single process exceeds its tree's peak
        assert procs["neuron"] > 4 * GPT2_124M_SHIPPED_TOKENIZER
        assert all(v <= row["peak_pss"] for v in procs.values())
