"""Shared fixtures. Tests run real parts: real processes, real sockets, real files."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import HealthCheck, settings

REPO = Path(__file__).resolve().parent.parent

# CI must never refuse a landing by chance: there, hypothesis draws the same examples on
# every run (derandomize) and keeps no example database between runs. Locally it explores
# fresh examples each time, which is how a bug like an overflowing sum is found at all.
# HYPOTHESIS_PROFILE=ci reproduces a CI run locally. Wall-clock limits (the per-example
# deadline, the too-slow health check) measure the shared 2-core machine, not the code, so
# they are off there too.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "default"))


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a module (benchmarks are scripts, not a package), for the
    tests of their pure figures."""
    spec = importlib.util.spec_from_file_location(f"dtrain_bench_{name}", REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_dtrain(*args: str, env: dict | None = None, cwd: Path | None = None, timeout: float = 120,
               input: str | None = None) -> subprocess.CompletedProcess:
    """Run the CLI in a fresh interpreter, as an operator would."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "dtrain", *args], env=full_env, cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, input=input)


@pytest.fixture
def clean_env(tmp_path, monkeypatch):
    """No operator config or DTRAIN_/BT_ variables leak in from the machine running the tests."""
    for var in list(os.environ):
        if var.startswith(("DTRAIN_", "BT_")):
            monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return tmp_path


def drive_prompts(argv: list[str], answers: list[str], env: dict | None = None) -> tuple[int, str]:
    """Run ``dtrain argv`` on a real pseudo-terminal and answer its prompts (text ending in
    ':') in order, as an operator would; (exit code, transcript). Unasked answers are left."""
    import pty
    import select

    pid, fd = pty.fork()
    if pid == 0:  # child: the CLI on a TTY
        os.execvpe(sys.executable, [sys.executable, "-m", "dtrain", *argv], {**os.environ, "TERM": "dumb",
                                                                              **(env or {})})
    pending = iter(answers)
    transcript, answered_at = b"", 0
    while True:
        ready, _, _ = select.select([fd], [], [], 30)
        if not ready:
            break
        try:
            chunk = os.read(fd, 4096)
        except OSError:
            break
        if not chunk:
            break
        transcript += chunk
        # A new prompt: text since the last answer (not just the echo of an empty answer) ending in ':'.
        fresh = transcript[answered_at:].strip()
        if fresh and fresh.endswith(b":"):
            answer = next(pending, None)
            if answer is None:
                os.kill(pid, 9)
                break
            os.write(fd, answer.encode() + b"\n")
            transcript += b"\n"
            answered_at = len(transcript)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), transcript.decode(errors="replace")


@pytest.fixture(scope="session")
def four_peers():
    """Four real peers on loopback (each a hivemind DHT with its own p2pd), each with dtrain's
    transport and butterfly service started, shared by the tests of the fixed-membership round
    (each of their rounds has an id of its own)."""
    from dtrain.swarm.butterfly import ButterflyService
    from dtrain.swarm.loopback import local_nodes
    from dtrain.swarm.transport import Transport

    with local_nodes(4) as nodes:
        transports = [Transport(node.dht, prefix="test").start() for node in nodes]
        try:
            yield [ButterflyService(t, start_timeout_s=10) for t in transports]
        finally:
            for t in transports:
                t.shutdown()


@pytest.fixture(scope="session")
def rounds(four_peers, tmp_path_factory):
    """dtrain's rounds on the four peers (transports of their own, prefix "rounds"): node 0 a
    validator with a real hotkey that may announce, nodes 1-3 miners; (nodes, its ss58)."""
    import bittensor as bt

    from dtrain.sandbox import layout
    from dtrain.sandbox.orchestrator import create_wallet
    from dtrain.swarm.round import Rounds
    from dtrain.swarm.transport import Transport

    root = tmp_path_factory.mktemp("round-wallets")
    hotkey = create_wallet(root, "validator")
    wallet = bt.Wallet(name="validator", hotkey="default", path=str(layout.wallets_dir(root)))
    # transports of their own (another prefix) on the same real DHTs as the other swarm tests
    transports = [Transport(s.transport.dht, prefix="rounds").start() for s in four_peers]
    try:
        nodes = [Rounds(transports[0], may_announce=lambda key: key == hotkey, wallet=wallet)]
        nodes += [Rounds(t, may_announce=lambda key: key == hotkey) for t in transports[1:]]
        yield nodes, hotkey
    finally:
        for t in transports:
            t.shutdown()
