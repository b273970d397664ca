"""`dtrain status`, sandbox summary and progress/benchmark views rendered from plain dicts."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
from rich.console import Console

from dtrain.ui.progress import CallbackProgress, benchmark_progress, benchmark_table, push_progress
from dtrain.ui.status_view import render_status
from dtrain.ui.summary import render_summary, verdict


def text_of(renderable, width: int = 160) -> str:
    console = Console(record=True, width=width, color_system=None)
    console.print(renderable)
    return console.export_text()


STATUS = {
    "network": "sandbox", "netuid": 38, "block": 48213,
    "global": {"epoch": 6, "samples": 300, "target_batch": 1200},
    "miners": [
        {"uid": 4, "hotkey": "5HminerFourAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA4444", "api": "127.0.0.1:9104",
         "peer_id": "12D3KooWpeer4444", "epoch": 6, "stake": 0.0, "weight": 0.3125, "validator_permit": False},
        {"uid": 2, "hotkey": "5HminerTwoBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBB2222", "api": None,
         "peer_id": "", "epoch": None, "stake": 0.0, "weight": 0.6875, "validator_permit": False},
    ],
    "validators": [{"uid": 0, "hotkey": "5VvalidatorZeroCCCCCCCCCCCCCCCCCCCCCCCCCC0000", "stake": 5000.0}],
    "rounds": [{"round_id": "aa11bb22cc33", "local_peer_id": "", "duration_s": 3.0, "group": ["x", "y"],
                "peers": [{"peer_id": "12D3KooWpeer4444", "outcome": "SUCCESS"},
                          {"peer_id": "12D3KooWpeer2222", "outcome": "NON_PARTICIPATING"}],
                "bytes_sent": 2048, "bytes_received": 4096, "fraction_averaged": 1.0, "error": ""}],
    "local": None,
    "chain_error": None,
}


def test_status_view_shows_miners_validators_rounds():
    text = text_of(render_status(STATUS))
    assert "sandbox" in text and "netuid 38" in text and "block 48,213" in text and "global epoch 6" in text
    assert "300/1,200 (25%)" in text
    rows = [line for line in text.splitlines() if re.match(r"\s+[24]\s+5Hmin", line)]
    assert [r.split()[0] for r in rows] == ["2", "4"]  # sorted by uid
    assert "127.0.0.1:9104" in rows[1] and "0.3125" in rows[1] and "…er4444" in rows[1]
    assert "no commitment" in rows[0] and "0.6875" in rows[0]
    assert "5Vval…C0000" in text and "5000" in text
    assert "aa11bb22" in text and "NON_PARTICIPATING" in text and "2.0 KiB" in text and "100%" in text
    assert "this node" not in text and "chain unreachable" not in text


def test_status_view_chain_error_and_local_health():
    doc = STATUS | {"chain_error": "ws://127.0.0.1:9944: connection refused", "miners": [], "rounds": [],
                    "local": {"role": "miner", "uid": 4, "state": "training", "epoch": 6, "loss": 3.25,
                              "chain": {"ok": False, "detail": "connection refused", "last_ok": 0.0,
                                        "last_error": "connection refused"},
                              "hub": {"ok": True, "detail": "", "last_ok": 0.0, "last_error": ""},
                              "last_push": "run.6.120", "unknown_future_key": 1}}
    text = text_of(render_status(doc))
    assert "chain unreachable" in text and "connection refused" in text
    assert "no miners registered" in text and "no rounds yet" in text
    assert "this node" in text and "miner uid 4" in text and "loss 3.25" in text
    assert "chain ✗ down" in text and "last ok never" in text and "hub ● ok" in text and "run.6.120" in text


def test_status_view_shows_only_what_was_measured():
    # A validator never pushes: its "this node" panel has no hub row and no "last push".
    validator = {"role": "validator", "uid": 0, "state": "validating", "epoch": 6, "loss": 3.25,
                 "chain": {"ok": True, "detail": "", "last_ok": 0.0, "last_error": ""},
                 "hub": {"ok": True, "detail": "", "last_ok": 0.0, "last_error": ""}, "last_push": ""}
    # Round byte counts an older summary did not record are unknown: shown as "—", never "0 B".
    unknown = dict(STATUS["rounds"][0], bytes_sent=None, bytes_received=None)
    text = text_of(render_status(STATUS | {"local": validator, "rounds": [unknown]}))
    assert "validator uid 0" in text and "chain ● ok" in text
    assert "hub" not in text and "last push" not in text
    row = next(line for line in text.splitlines() if "aa11bb22" in line)
    assert "0 B" not in row and row.count("—") >= 2
    assert "unknown / 1,200" in text_of(render_status(STATUS | {"global": {"epoch": 6, "samples": None,
                                                                          "target_batch": 1200}}))
    doc = STATUS | {"validator_state_error": "validator state file /x/state.json is unusable: bad"}
    assert "validator state not shown: validator state file /x/state.json is unusable" in text_of(render_status(doc))


def summary_doc(adversary_weight: float) -> dict:
    return {
        "wall_s": 312.0,
        "rounds": [
            {"round": 1, "status": "success", "participants": 4, "duration_s": 5.5, "bytes": 3 * 2**20,
             "outcomes": {1: "SUCCESS", 2: "SUCCESS", 3: "SUCCESS", 4: "WRONG_MODEL"}},
            {"round": 2, "status": "failed", "participants": 0, "duration_s": 30.0, "bytes": 0, "outcomes": {}},
        ],
        "miners": [
            {"uid": 1, "hotkey": "5Honest1" * 6, "kind": "honest", "score": 0.9, "weight": 0.40,
             "components": {"gradient": 0.95, "steps": 0.9, "bandwidth": 0.8, "allreduce": 1.0}},
            {"uid": 2, "hotkey": "5Honest2" * 6, "kind": "honest", "score": 0.8, "weight": 0.32,
             "components": {"gradient": 0.9}},
            {"uid": 3, "hotkey": "5Honest3" * 6, "kind": "honest", "score": 0.7, "weight": 0.24},
            {"uid": 4, "hotkey": "5Cheat44" * 6, "kind": "wrong_model", "score": 0.01, "weight": adversary_weight,
             "components": {"gradient": 0.0}},
        ],
        "loss": {"start": 10.8, "end": 7.1, "curve": [10.8 - i * 0.1 for i in range(38)]},
    }


def test_summary_passes_when_adversary_is_held_down():
    doc = summary_doc(0.04)  # weakest honest 0.24 -> bound 0.06
    ok, why = verdict(doc)
    assert ok and "≤ 25%" in why and "0.0600" in why
    text = text_of(render_summary(doc))
    assert "PASS" in text and "FAIL " not in text
    assert "10.8 → 7.1" in text and "▁" in text and "█" in text and "┤" in text  # sparkline and text plot
    assert "rounds 1/2 succeeded" in text and "4:WRONG_MODEL" in text and "3.0 MiB" in text
    order = [int(m.group(1)) for m in re.finditer(r"^\s+(\d)\s+5(?:Hon|Che)", text, re.M)]
    assert order == [1, 2, 3, 4]  # by weight, heaviest first
    assert "wrong_model" in text and "⚠" not in text


def test_summary_fails_and_names_the_adversary_that_slipped_through():
    doc = summary_doc(0.10)
    ok, why = verdict(doc)
    assert not ok and "uid 4 (wrong_model)" in why and "0.1000" in why
    text = text_of(render_summary(doc))
    assert "FAIL uid 4" in text and "0.1000 ⚠" in text
    order = [int(m.group(1)) for m in re.finditer(r"^\s+(\d)\s+5(?:Hon|Che)", text, re.M)]
    assert order == [1, 2, 3, 4]


def test_verdict_edge_cases():
    assert verdict({"miners": [{"uid": 1, "kind": "honest", "weight": 1.0}]}) == (True, "no adversaries in this run")
    assert verdict({"miners": [{"uid": 1, "kind": "free_rider", "weight": 0.0}]})[0] is False
    # an adversary exactly at the bound passes (≤), just above fails
    base = {"miners": [{"uid": 1, "kind": "honest", "weight": 0.4}, {"uid": 2, "kind": "x", "weight": 0.1}]}
    assert verdict(base)[0] is True
    base["miners"][1]["weight"] = 0.1001
    assert verdict(base)[0] is False
    text_of(render_summary({}))  # an empty document still renders


def test_push_progress_callback_accepts_all_engine_shapes():
    console = Console(record=True, width=120, color_system=None)
    with push_progress(console=console) as cb:
        assert isinstance(cb, CallbackProgress)
        cb("upload", 512, 1024)
        cb(SimpleNamespace(stage="retry", bytes_done=0, bytes_total=1024, attempt=2, message="HTTP 503"))
        cb("upload", 1024, 1024)
        cb(None, "junk", object())  # never raises
    assert cb.events[:3] == [("upload", 512, 1024), ("retry", 0, 1024), ("upload", 1024, 1024)]
    task = cb.progress.tasks[0]
    assert task.completed == 1024 and task.total == 1024
    out = console.export_text()
    assert "retry" in out and "HTTP 503 (attempt 2)" in out

    with benchmark_progress(console=console) as bcb:
        bcb("all-reduce", 0.6)
        bcb("done", 1.0)
    assert bcb.events == [("all-reduce", 600, 1000), ("done", 1000, 1000)]


@pytest.mark.parametrize("row", [
    {"peers": 4, "size_mb": 64.0, "seconds": 2.0, "algbw": 32.0, "busbw": 48.0, "max_abs_error": 2e-7, "bound": 1.5},
    {"peers": 4, "size_mb": 64.0, "seconds": 2.0, "algbw_mb_s": 32.0, "busbw_mb_s": 48.0, "max_abs_error": 2e-7,
     "bound_s": 1.5},
])
def test_benchmark_table(row):
    text = text_of(benchmark_table([row]))
    line = next(line for line in text.splitlines() if line.strip().startswith("4 "))
    assert line.split() == ["4", "64", "2", "32", "48", "2.00e-07", "1.5", "75%"]


def test_benchmark_table_without_link_speed():
    text = text_of(benchmark_table([{"peers": 2, "size_mb": 1, "seconds": 0.5, "max_abs_error": None}]))
    assert "no link speed" in text
    assert "no results" in text_of(benchmark_table([]))


def test_status_view_says_when_a_watch_refresh_failed():
    from rich.console import Console

    from dtrain.ui.status_view import render_status

    console = Console(record=True, width=100)
    console.print(render_status({"network": "finney", "netuid": 38, "miners": [], "validators": [], "rounds": [],
                                 "poll_error": "ChainUnavailable: timed out"}))
    text = console.export_text()
    assert "showing the last good data" in text and "ChainUnavailable: timed out" in text
