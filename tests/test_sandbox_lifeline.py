"""A sandbox that dies takes its neurons with it, however it dies (dtrain/lifeline.py).

The sandbox starts each neuron in a session of its own, so no signal of the sandbox's reaches
them; ``kill -9`` of the sandbox once left all of them running. Each neuron now holds the
read end of a pipe only the sandbox writes to, and stops when it closes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dtrain.lifeline import LIFELINE_ENV, lifeline_fd, watch_lifeline
from tests.conftest import REPO


def _processes_under(root: Path) -> dict[int, str]:
    """pid -> command line of every process whose working directory is inside ``root`` (each
    neuron runs in its own directory there, and its hivemind processes and p2pd inherit it)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cwd = os.readlink(f"/proc/{entry}/cwd")
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                cmd = fh.read().replace(b"\0", b" ").decode(errors="replace").strip()
            with open(f"/proc/{entry}/stat", "rb") as fh:
                state = fh.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if state not in (b"Z", b"X") and Path(cwd).is_relative_to(root):
            found[int(entry)] = cmd
    return found


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/cwd").exists(), reason="needs Linux /proc")
def test_kill_9_of_the_sandbox_ends_every_neuron(tmp_path):
    root = tmp_path / "box"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DTRAIN_", "BT_"))}
    log = open(tmp_path / "sandbox.log", "wb")
    sandbox = subprocess.Popen([sys.executable, "-m", "dtrain", "sandbox", "--miners", "1", "--rounds", "50",
                                "--dir", str(root), "--no-dashboard"], cwd=str(REPO), env=env,
                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        # Up: the miner and the validator are running (the validator starts once the miner committed).
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and sandbox.poll() is None:
            names = {cmd.split(" --config ")[1].split("/config.toml")[0].rsplit("/", 1)[-1]
                     for cmd in _processes_under(root / "neurons").values() if " --config " in cmd}
            if {"miner1", "validator"} <= names:
                break
            time.sleep(0.5)
        else:
            pytest.fail(f"the sandbox did not come up: {(tmp_path / 'sandbox.log').read_text()[-2000:]}")
        time.sleep(3)  # the validator's DHT and averager processes are forked by now
        before = _processes_under(root / "neurons")
        assert len(before) >= 4, before  # two neurons, each with its own helper processes

        os.kill(sandbox.pid, signal.SIGKILL)
        sandbox.wait(10)
        deadline = time.monotonic() + 60
        left = before
        while time.monotonic() < deadline:
            left = _processes_under(root / "neurons")
            if not left:
                break
            time.sleep(0.5)
        assert not left, f"still running after the sandbox was killed: {left}"
        logs = "".join((root / "neurons" / n / "log.txt").read_text(errors="replace")
                       for n in ("miner1", "validator"))
        assert "the supervisor is gone" in logs  # they stopped on the lifeline, not by chance
    finally:
        if sandbox.poll() is None:
            os.killpg(sandbox.pid, signal.SIGKILL)
        for pid in _processes_under(root):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        log.close()


def test_the_lifeline_ends_when_its_write_end_closes_and_not_before():
    read, write = os.pipe()
    lost = threading.Event()
    try:
        watch_lifeline(read, lost.set, grace_s=3600)
        assert not lost.wait(0.5)
        os.write(write, b"x")  # data is no reason to stop
        assert not lost.wait(0.3)
    finally:
        os.close(write)
    assert lost.wait(5)


def test_a_bad_lifeline_variable_is_named():
    assert lifeline_fd({}) is None
    with pytest.raises(ValueError, match=f"{LIFELINE_ENV} must be a file descriptor number, got 'x'"):
        lifeline_fd({LIFELINE_ENV: "x"})
    read, write = os.pipe()
    os.close(read)
    os.close(write)
    with pytest.raises(ValueError, match=f"{LIFELINE_ENV}={read} names no open file descriptor"):
        lifeline_fd({LIFELINE_ENV: str(read)})
