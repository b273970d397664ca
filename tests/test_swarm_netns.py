"""Peers in separate network namespaces over rate-limited veth links (root + iproute2 only)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tests.conftest import load_benchmark

pytestmark = [pytest.mark.netns, pytest.mark.slow]

def _lab_module():
    return load_benchmark("allreduce_netns")


def _usable() -> bool:
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        return False
    probe = f"dtprobe{os.getpid() % 100000}"
    ok = subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode == 0
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ok


pytestmark.append(pytest.mark.skipif(not _usable(), reason="needs root, iproute2 and network namespaces"))


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def test_rate_limited_round_is_exact_and_cleans_up():
    mod = _lab_module()
    before = _namespaces()
    # dtrain-mean: the butterfly's weighted mean, checked against the exact mean
    res = mod.run_group(3, 2.0, 200.0, 1, "dtrain-mean", 2**17, matchmaking_s=3.0, timeout_s=120)
    assert res["dtrain-mean"]["all_ok"] and res["dtrain-mean"]["max_abs_error"] <= 1e-5
    assert res["dtrain-mean"]["seconds"] >= res["bound_s"] * 0.9  # the links really are limited
    assert _namespaces() == before  # every namespace we made is gone


def test_a_compressed_wire_is_measured_against_the_bound_of_its_own_bytes():
    """--wire: the dtrain implementations run another codec; besides the fp32 bound, the round is
    held to the bound of the bytes it put on the wire (what the codec makes of the link)."""
    mod = _lab_module()
    res = mod.run_group(3, 2.0, 200.0, 1, "dtrain-mean", 2**17, matchmaking_s=3.0, timeout_s=120, wire="8bit")
    s = res["dtrain-mean"]
    assert s["all_ok"] and res["dtrain_wire"] == "8bit"
    # 8-bit moves about a quarter of fp32's bytes, and its own bound shrinks with them
    assert 0.2 < s["wire_over_payload"] < 0.4
    assert s["own_bound_s"] == pytest.approx(s["wire_bytes_per_peer"]["median"] / (200e6 / 8))
    assert s["efficiency_own_bytes"] == pytest.approx(s["own_bound_s"] / s["seconds"])
    assert 0 < s["efficiency_own_bytes"] < s["efficiency"]


def test_throttled_straggler_is_banned_others_complete():
    mod = _lab_module()
    # Peer 2 gets a 0.2 Mbit/s link: a 128 KiB part takes ~5 s, longer than the 2 s sender
    # timeout. Matchmaking messages cross that link too, and a packet lost there costs a TCP
    # retransmission timeout; 5 s matchmaking (2.5 s request timeout) keeps a follower from
    # giving up on a leader that is merely slow. Should hivemind's matchmaking still split the
    # group (a fast peer's round then fails with "could not find a group"), the lab is run
    # once more: matchmaking over a throttled link is not what this test checks, banning is.
    failures = []
    for _attempt in range(2):
        raw: list = []
        res = mod.run_group(
            3, 1.0, 200.0, 1, "dtrain-mean", 2**17, matchmaking_s=5.0, timeout_s=180,
            peer_rates_mbit={2: 0.2}, sender_timeout_s=2.0, raw=raw,
        )
        rows = {row["peer_id"]: row for rows in raw for row in rows}
        slow_id = raw[2][0]["peer_id"]
        fast = [row for pid, row in rows.items() if pid != slow_id]
        assert len(fast) == 2
        errors = [row["error"] for row in fast if row["error"]]
        if not errors:
            break
        failures.append(errors)
    else:
        pytest.fail(f"the fast peers never formed a group: {failures}")
    for row in fast:
        assert row["outcomes"][slow_id] == "FAIL"
        assert row["max_abs_error"] < 10  # finite; the straggler's share stays local
        assert row["seconds"] < 20  # did not wait for the straggler's full upload (~60 s at 0.2 Mbit)
    assert res["bound_s"] > 0
