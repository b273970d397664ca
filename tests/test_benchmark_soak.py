"""benchmarks/soak.py: its pure parts (slope fit, budget verdict, the /proc tree walk).

No sandbox here: the walk runs on this test process and on real child processes it spawns.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import load_benchmark

soak = load_benchmark("soak")

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")


def test_slope_is_the_least_squares_fit():
    assert soak.slope([0, 1, 2, 3], [5, 7, 9, 11]) == pytest.approx(2.0)
    # noise around a line: the fit recovers it
    xs = list(range(100))
    ys = [1000 + 3 * x + (7 if x % 2 else -7) for x in xs]
    assert soak.slope(xs, ys) == pytest.approx(3.0, abs=0.01)
    assert soak.slope([1], [1]) == 0.0
    assert soak.slope([2, 2, 2], [1, 2, 3]) == 0.0


def _samples(rounds, pss, fds=10, threads=5, start_pss=None):
    out = []
    for r in range(rounds + 1):
        value = pss(r)
        # anon counts the pages the forks share twice: a constant above Pss, same slope
        mem = {"pss": value, "rss": value * 2, "anon": value + 200_000_000, "uss": value // 2}
        tree = {**mem, "fds": fds(r) if callable(fds) else fds,
                "threads": threads(r) if callable(threads) else threads, "procs": 4,
                "kinds": {"neuron": {**mem, "fds": 1, "threads": 1, "procs": 1}}}
        out.append({"round": r, "trees": {"miner1": tree}})
    return out


def test_flat_tree_passes_and_the_ratio_is_against_the_budget():
    base = 400_000_000
    # 0.01 %/round of the start after warm-up: a fifth of the 0.05 % budget
    samples = _samples(100, lambda r: base + (0 if r <= 10 else int(base * 0.0001 * (r - 11))))
    result = soak.analyse(samples, warmup=10)
    tree = result["trees"]["miner1"]
    assert tree["pss"]["pct_per_round"] == pytest.approx(0.01, rel=1e-3)
    assert tree["pss"]["ratio_to_budget"] == pytest.approx(0.2, rel=1e-3)
    # the judged slope (anon by default) is taken in % of the tree's starting Pss
    assert tree["budget"]["metric"] == "anon" and tree["budget"]["base"] == tree["pss"]["start"]
    assert tree["budget"]["ratio"] == pytest.approx(0.2, rel=1e-3)
    assert tree["kinds"]["neuron"]["anon"]["pct_of_tree_per_round"] == pytest.approx(0.01, rel=1e-3)
    assert tree["verdict"] == {"memory": True, "fds": True, "threads": True, "ok": True}
    assert result["ok"] and result["rounds_after_warmup"] == 90


def test_warmup_growth_is_left_out_but_later_growth_fails():
    base = 400_000_000
    # steep growth only during warm-up: passes
    warm = soak.analyse(_samples(60, lambda r: base + 10_000_000 * min(r, 10)), warmup=10)
    assert warm["ok"]
    # 0.1 %/round after warm-up: twice the budget
    leak = soak.analyse(_samples(60, lambda r: base + int(base * 0.001 * r)), warmup=10)
    assert not leak["ok"]
    assert leak["trees"]["miner1"]["verdict"]["memory"] is False
    assert leak["worst_ratio"] == pytest.approx(2.0, rel=0.02)
    for metric in ("pss", "rss"):  # a 2x leak fails whichever sum is judged
        assert not soak.analyse(_samples(60, lambda r: base + int(base * 0.001 * r)), warmup=10, metric=metric)["ok"]


def test_fds_and_threads_must_be_flat():
    base = 400_000_000
    fd_leak = soak.analyse(_samples(60, lambda r: base, fds=lambda r: 10 + r // 5), warmup=10)
    assert fd_leak["trees"]["miner1"]["verdict"]["fds"] is False and not fd_leak["ok"]
    thread_leak = soak.analyse(_samples(60, lambda r: base, threads=lambda r: 5 + r), warmup=10)
    assert thread_leak["trees"]["miner1"]["verdict"]["threads"] is False
    # a dip and a return to the same level is flat; so is a transient socket in one sample
    wobble = soak.analyse(_samples(60, lambda r: base, fds=lambda r: 10 - (r % 2)), warmup=10)
    assert wobble["trees"]["miner1"]["verdict"]["fds"] is True
    blip = soak.analyse(_samples(60, lambda r: base, fds=lambda r: 10 + 3 * (r == 58)), warmup=10)
    assert blip["trees"]["miner1"]["verdict"]["fds"] is True
    assert blip["trees"]["miner1"]["fds"]["window_rise"] == 3  # reported, not judged
    slack = soak.analyse(_samples(60, lambda r: base, fds=lambda r: 10 + (r > 50)), warmup=10, fd_slack=1)
    assert slack["trees"]["miner1"]["verdict"]["fds"] is True


def _with_p2pd(samples, p2pd_threads, p2pd_fds=17):
    """Add a p2pd process to every sample's tree (its threads counted in the tree's, as sampled)."""
    for s in samples:
        tree = s["trees"]["miner1"]
        n = p2pd_threads(s["round"])
        tree["kinds"]["p2pd"] = {"pss": 1, "rss": 1, "anon": 1, "uss": 1, "fds": p2pd_fds, "threads": n, "procs": 1}
        tree["threads"] += n
    return samples


def test_p2pd_threads_are_judged_against_gos_bound_and_python_threads_must_be_flat():
    base = 400_000_000
    # Go keeps every OS thread it made: p2pd's count steps up late, under the bound of what it can need
    steps = soak.analyse(_with_p2pd(_samples(60, lambda r: base), lambda r: 8 + (r > 30) + (r > 50)),
                         warmup=10, cpus=2)
    tree = steps["trees"]["miner1"]
    assert tree["verdict"]["threads"] is True and steps["ok"]
    assert tree["go_threads"] == {"min": 8, "max": 10, "rise": 2, "bound": 2 + 17 + 2, "cpus": 2}
    assert tree["python_threads"]["floor_rise"] == 0 and tree["threads"]["floor_rise"] == 2
    # past the bound (more threads than processors, descriptors and the runtime's own): not a high-water mark
    runaway = soak.analyse(_with_p2pd(_samples(60, lambda r: base), lambda r: 8 + r // 3), warmup=10, cpus=2)
    assert runaway["trees"]["miner1"]["verdict"]["threads"] is False
    # a Python process's thread that stays is a failure, whatever p2pd does
    python_leak = soak.analyse(_with_p2pd(_samples(60, lambda r: base, threads=lambda r: 5 + (r > 40)), lambda r: 8),
                               warmup=10, cpus=2)
    assert python_leak["trees"]["miner1"]["verdict"]["threads"] is False
    text = soak.render({"command": "c", "rounds_sampled": 60, "wall_s": 1.0, "samples": _samples(60, lambda r: base),
                        "analysis": steps, "ok": True})
    assert "p2pd (Go) threads 8-10 (rose 2), bound 21" in text


def test_the_last_round_is_left_out_with_until():
    # the validator shutting down after its last round: its tree collapses in that sample
    samples = _samples(60, lambda r: 400_000_000 if r < 60 else 100_000_000, fds=lambda r: 10 if r < 60 else 3)
    assert soak.analyse(samples, warmup=10, until=60)["ok"]
    assert soak.analyse(samples, warmup=10, until=60)["trees"]["miner1"]["pss"]["n"] == 49


def test_no_samples_after_warmup_is_not_a_pass():
    assert not soak.analyse(_samples(5, lambda r: 1000), warmup=10)["ok"]


def test_the_report_renders_with_a_sparkline():
    samples = _samples(40, lambda r: 400_000_000 + 1000 * r)
    result = {"command": "python benchmarks/soak.py", "rounds_sampled": 40, "wall_s": 1.0, "samples": samples,
              "analysis": soak.analyse(samples, warmup=10), "ok": True}
    text = soak.render(result)
    assert "python benchmarks/soak.py" in text and "miner1" in text and "PASS" in text
    assert any(ch in text for ch in "▁▂▃▄▅▆▇█")


def test_proc_stat_reads_this_process():
    st = soak.proc_stat(os.getpid())
    assert st["pid"] == os.getpid() and st["ppid"] == os.getppid()
    assert st["session"] == os.getsid(0)
    assert soak.proc_stat(2 ** 30) is None  # beyond pid_max: never a process


def _session_leader(script: str) -> tuple[subprocess.Popen, int]:
    """Run ``script`` as a session leader (as the sandbox starts neurons); returns it and the pid
    it prints first."""
    leader = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    return leader, int(leader.stdout.readline())


def test_tree_walk_finds_a_real_child_and_grandchild_and_their_resources():
    # A child in its own session (as the sandbox starts neurons) with a grandchild that holds a
    # pipe open, and a second python process that re-parents nothing.
    script = ("import os, subprocess, sys, time\n"
              "r, w = os.pipe()\n"
              "p = subprocess.Popen(['sleep', '30'])\n"
              "print(p.pid, flush=True)\n"
              "time.sleep(30)\n")
    child, grandchild = _session_leader(script)
    try:
        # the current process's tree holds the child and the grandchild
        mine = {st["pid"] for st in soak.process_tree(os.getpid())}
        assert {os.getpid(), child.pid, grandchild} <= mine
        tree = soak.process_tree(child.pid)
        assert {st["pid"] for st in tree} == {child.pid, grandchild}
        kinds = soak.classify(tree, child.pid)
        assert kinds[child.pid] == "neuron" and kinds[grandchild] == "other"
        sample = soak.tree_sample(child.pid)
        assert sample["procs"] == 2
        assert sample["threads"] >= 2
        assert sample["rss"] > 1_000_000 and 0 < sample["pss"] <= sample["rss"]
        # stdin/out/err and the pipe's two ends in the child, at least stdio in sleep
        assert sample["fds"] >= 5 + 3
        assert sample["kinds"]["neuron"]["procs"] == 1 and sample["kinds"]["other"]["procs"] == 1
        # the session keeps an orphan: kill the child's parent link by killing the child only
        # after checking the grandchild's session is the child's
        assert soak.proc_stat(grandchild)["session"] == child.pid
    finally:
        os.killpg(child.pid, 9)
        child.wait()
    deadline = time.monotonic() + 5
    while soak.tree_sample(child.pid) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert soak.tree_sample(child.pid) is None


def test_session_members_count_even_when_reparented():
    # The middle shell exits at once; its background sleep is re-parented away from the session
    # leader (to init or a subreaper) but stays in the session, so the leader's tree still holds
    # it, as it would a p2pd whose parent died.
    script = ("import subprocess, time\n"
              "p = subprocess.Popen(['sh', '-c', 'sleep 30 & echo $!'], stdout=subprocess.PIPE, text=True)\n"
              "pid = p.stdout.readline().strip()\n"
              "p.wait()\n"
              "print(pid, flush=True)\n"
              "time.sleep(30)\n")
    leader, orphan = _session_leader(script)
    try:
        st = soak.proc_stat(orphan)
        assert st["session"] == leader.pid and st["ppid"] != leader.pid
        assert orphan in {s["pid"] for s in soak.process_tree(leader.pid)}
        assert orphan not in {s["pid"] for s in soak.process_tree(leader.pid, session=False)}
    finally:
        os.killpg(leader.pid, 9)
        leader.wait()


def test_p2pd_and_forked_children_are_told_apart():
    # pids beyond pid_max: no real process, so every cmdline reads as empty, like the root's,
    # and both python children count as forks of the neuron's program
    r = 2 ** 30

    def proc(pid, comm, ppid, start):
        return {"pid": pid, "comm": comm, "ppid": ppid, "session": r, "start": start, "state": "S", "pgrp": r}

    table = {r: proc(r, "python", 1, 1), r + 1: proc(r + 1, "python", r, 2), r + 2: proc(r + 2, "python", r, 3),
             r + 3: proc(r + 3, "p2pd", r + 1, 4), r + 4: proc(r + 4, "python", r, 5),
             # torch's shm manager calls setsid: found as the neuron's child, not by session
             r + 5: proc(r + 5, "torch_shm_manag", r, 6) | {"session": r + 5},
             r + 9: proc(r + 9, "python", 1, 1) | {"session": r + 9}}
    tree = soak.process_tree(r, table)
    assert [st["pid"] for st in tree] == [r, r + 1, r + 2, r + 3, r + 4, r + 5]
    kinds = soak.classify(tree, r)
    assert kinds == {r: "neuron", r + 1: "dht", r + 2: "averager", r + 3: "p2pd", r + 4: "forked",
                     r + 5: "torch_shm"}


def test_open_descriptors_are_counted_by_type():
    import os
    import socket

    open_fd_types = soak.open_fd_types
    before = open_fd_types(os.getpid())
    r, w = os.pipe()
    a, b = socket.socketpair()
    try:
        after = open_fd_types(os.getpid())
    finally:
        os.close(r)
        os.close(w)
        a.close()
        b.close()
    assert after.get("pipe", 0) - before.get("pipe", 0) == 2
    assert after.get("socket", 0) - before.get("socket", 0) == 2
