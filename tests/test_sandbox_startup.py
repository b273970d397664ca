"""How the sandbox says why it could not start (dtrain/sandbox/orchestrator.py)."""

from __future__ import annotations

import subprocess
import sys

from dtrain.sandbox.layout import Member
from dtrain.sandbox.orchestrator import Child, Sandbox, SandboxOptions


def _child(tmp_path, name: str, code: str) -> Child:
    log = tmp_path / f"{name}.log"
    with open(log, "w") as fh:
        process = subprocess.Popen([sys.executable, "-c", code], stdout=fh, stderr=subprocess.STDOUT)
    return Child(Member(name, "miner", "honest", 1, "5F" + name), process, log)


def test_the_neuron_that_exited_is_named_not_the_one_waited_for(tmp_path):
    # Any neuron that exits stops the wait for commitments; the error must name that neuron
    # and its last words, not the one that was being waited for when it happened.
    box = Sandbox(SandboxOptions(directory=tmp_path / "box"))
    waiting = _child(tmp_path, "miner2", "import time; time.sleep(60)")
    crashed = _child(tmp_path, "miner3", "print('dtrain: error: the DHT did not start within 120 s'); raise SystemExit(2)")
    box.children = [waiting, crashed]
    try:
        crashed.process.wait(30)
        message = str(box._not_up("miner2", waiting.log))
    finally:
        waiting.process.kill()
        waiting.process.wait()
    assert message.startswith("miner3 exited (code 2) before the sandbox was up")
    assert "the DHT did not start within 120 s" in message and str(crashed.log) in message


def test_a_neuron_that_is_alive_but_never_committed_is_named(tmp_path):
    box = Sandbox(SandboxOptions(directory=tmp_path / "box"))
    waiting = _child(tmp_path, "miner2", "import time; time.sleep(60)")
    box.children = [waiting]
    try:
        message = str(box._not_up("miner2", waiting.log))
    finally:
        waiting.process.kill()
        waiting.process.wait()
    assert message == f"miner2 did not come up; see {waiting.log}"
