"""Chaos: a sandbox swarm keeps its round contract while miners crash, freeze and lose their DHT.

A real sandbox (chain, validator, miners as `dtrain mine` processes on loopback). While the
validator runs its rounds, one miner is killed with SIGKILL (process group and all, as the OOM
killer or a power cut would) and started again with its own command, one is frozen with
SIGSTOP for about a round and thawed, and the hivemind DHT process of a third is killed while
the miner itself runs on. The contract, per honest miner and round:

- a miner alive and not frozen through a whole round is never FAIL in it, and is SUCCESS
  unless it is rejoining (the two rounds after it came back);
- a miner that was disturbed is SUCCESS again within two rounds of coming back (the one
  whose DHT died heals itself, without a restart by hand);
- every round averages, and the loss falls.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass

import pytest

from dtrain.sandbox import layout
from dtrain.sandbox.orchestrator import Sandbox, SandboxOptions

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

MINERS = 4
ROUNDS = 10
REJOIN_ROUNDS = 2
# How long a miner stays frozen: a little more than a sandbox round (2 s slot, a few s of checks).
FREEZE_S = 12.0
# A hang guard for each wait on the swarm (a round, a restart), not a performance limit.
WAIT_S = 600.0


@dataclass
class Disturbance:
    name: str
    what: str
    start: float
    end: float | None = None  # when the miner was back (training again, or its swarm restarted)


def _state(box: Sandbox) -> dict:
    for path in layout.validator_state_files(box.root):
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            pass
    return {}


def _status(box: Sandbox, name: str) -> dict:
    path = layout.status_files(box.root).get(name)
    try:
        return json.loads(path.read_text()) if path is not None else {}
    except (OSError, ValueError):
        return {}


def _wait(what: str, predicate, box: Sandbox) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        if box.validators_done() is not None:
            raise AssertionError(f"the validator ended while waiting for {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"hang guard: no {what} within {WAIT_S:g} s")
        time.sleep(0.2)


def _rounds_done(box: Sandbox) -> int:
    return int(_state(box).get("round_counter") or 0)


def _child(box: Sandbox, name: str):
    return [c for c in box.children if c.member.name == name][-1]


def _children_of(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as fh:
                    if int(fh.read().rsplit(b")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    return out


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def _dht_process(neuron_pid: int) -> int:
    """The neuron's hivemind DHT process: the forked child that started p2pd (the averager
    process talks to that daemon but starts none)."""
    for child in _children_of(neuron_pid):
        if any(_comm(grandchild) == "p2pd" for grandchild in _children_of(child)):
            return child
    raise AssertionError(f"no DHT process under pid {neuron_pid}")


@pytest.fixture(scope="module")
def chaos(tmp_path_factory):
    box = Sandbox(SandboxOptions(miners=MINERS, rounds=ROUNDS, directory=tmp_path_factory.mktemp("chaos") / "box"))
    box.setup()
    events: list[Disturbance] = []
    try:
        box.start()
        _wait("first round", lambda: _rounds_done(box) >= 1, box)

        # 1. a crash: the whole process group, then the operator's supervisor starts it again
        victim = _child(box, "miner2")
        crash = Disturbance("miner2", "SIGKILL and restart", time.time())
        os.killpg(victim.process.pid, signal.SIGKILL)
        victim.process.wait(30)
        box._spawn(victim.member, [])
        _wait("miner2 training again", lambda: _status(box, "miner2").get("state") == "training"
              and _status(box, "miner2").get("started_at", 0) > crash.start, box)
        crash.end = time.time()
        events.append(crash)

        # 2. a freeze of about a round
        at = _rounds_done(box)
        _wait("a round after the restart", lambda: _rounds_done(box) > at, box)
        frozen = _child(box, "miner3")
        freeze = Disturbance("miner3", "SIGSTOP for a round", time.time())
        os.killpg(frozen.process.pid, signal.SIGSTOP)
        time.sleep(FREEZE_S)
        os.killpg(frozen.process.pid, signal.SIGCONT)
        freeze.end = time.time()
        events.append(freeze)

        # 3. the DHT process of a running miner dies; the miner must notice and heal itself
        at = _rounds_done(box)
        _wait("a round after the freeze", lambda: _rounds_done(box) > at, box)
        dht = _dht_process(_child(box, "miner4").process.pid)
        lost = Disturbance("miner4", "DHT process SIGKILL", time.time())
        os.kill(dht, signal.SIGKILL)
        _wait("miner4's swarm node restarted", lambda: _status(box, "miner4").get("swarm_restarts", 0) >= 1, box)
        lost.end = time.time()
        events.append(lost)

        code = box.wait_for_validator()
    finally:
        box.stop_all()
    assert code == 0, _state(box).get("recent_rounds")
    yield box, box.summary(), _state(box), events
    box.cleanup()


def _outcomes(state: dict) -> list[tuple[float, float, dict[str, str], dict[str, str]]]:
    """(start, end, outcome by uid, note by uid) per round; a round starts when the one before ended."""
    rounds = state["recent_rounds"]
    out, start = [], 0.0
    for r in rounds:
        end = float(r["time"])
        out.append((start, end, {str(m["uid"]): m["outcome"] for m in r["miners"]},
                    {str(m["uid"]): m.get("note", "") for m in r["miners"]}))
        start = end
    return out


def test_every_round_averages_and_the_loss_falls(chaos):
    _, doc, _, events = chaos
    assert [e.what for e in events] == ["SIGKILL and restart", "SIGSTOP for a round", "DHT process SIGKILL"]
    assert len(doc["rounds"]) == ROUNDS
    assert all(r["status"] == "success" for r in doc["rounds"]), [(r["round"], r["error"]) for r in doc["rounds"]]
    assert doc["loss"]["end"] < doc["loss"]["start"], doc["loss"]


def test_no_honest_miner_is_fail_in_a_round_it_was_alive_through(chaos):
    _, doc, state, events = chaos
    uid_of = {m["name"]: str(m["uid"]) for m in doc["miners"]}
    windows = {e.name: (e.start, e.end) for e in events}
    rounds = _outcomes(state)
    problems = []
    for name, uid in uid_of.items():
        start, end = windows.get(name, (None, None))
        rejoining = 0
        for i, (r_start, r_end, outcomes, notes) in enumerate(rounds, 1):
            disturbed = start is not None and r_start < end and r_end > start
            if disturbed:
                rejoining = REJOIN_ROUNDS
                continue
            outcome = outcomes.get(uid, "NOT_QUERIED")
            if rejoining:
                rejoining -= 1
                if outcome == "FAIL":
                    problems.append((name, i, outcome, notes.get(uid)))
                continue
            if outcome != "SUCCESS":
                problems.append((name, i, outcome, notes.get(uid)))
    assert not problems, (problems, [(e.name, e.what, e.start, e.end) for e in events],
                          [(a, b) for a, b, _, _ in rounds])


def test_each_disturbed_miner_is_success_again_within_two_rounds(chaos):
    _, doc, state, events = chaos
    uid_of = {m["name"]: str(m["uid"]) for m in doc["miners"]}
    rounds = _outcomes(state)
    for e in events:
        after = [outcomes.get(uid_of[e.name]) for start, _, outcomes, _ in rounds if start >= e.end]
        assert after, (e.name, "no round after it came back")
        assert "SUCCESS" in after[:REJOIN_ROUNDS], (e.name, e.what, after)


def test_the_miner_whose_dht_died_healed_itself_and_said_so(chaos):
    box, _, _, _ = chaos
    status = _status(box, "miner4")
    assert status.get("swarm_restarts") == 1, status.get("swarm")
    assert status["swarm"]["ok"] is True and "SIGKILL" in status["swarm"]["detail"], status["swarm"]
    log = (layout.neuron_dir(box.root, "miner4") / "log.txt").read_text(errors="replace")
    assert "restarting it" in log and "swarm node restarted" in log
    # the other miners never needed one
    for name in ("miner1", "miner2", "miner3"):
        assert _status(box, name).get("swarm_restarts", 0) == 0, name
