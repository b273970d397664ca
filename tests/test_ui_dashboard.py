"""The live dashboard rendered from a real Telemetry fed by a writer thread.

Synchronisation is by counts (frames drawn, updates written), never by the clock.
"""

from __future__ import annotations

import re
import threading
import time

from rich.console import Console

from dtrain.telemetry import MinerRow, Telemetry
from dtrain.ui.dashboard import LiveDashboard, as_snapshot, health_line, render_neuron

LOCAL = "12D3KooWLocalPeerAAAA1111"


def round_record(round_id: str = "9f3c2a71deadbeef", error: str = "") -> dict:
    """A record as dtrain.swarm.records.RoundRecord.to_dict() produces it."""
    return {
        "round_id": round_id, "local_peer_id": LOCAL, "started_at": 1_700_000_000.0, "duration_s": 4.25,
        "group": [LOCAL, "12D3KooWPeerB2222", "12D3KooWPeerC3333"],
        "peers": [
            {"peer_id": LOCAL, "outcome": "SUCCESS", "weight_claimed": 64.0, "weight_used": 64.0, "reason": ""},
            {"peer_id": "12D3KooWPeerB2222", "outcome": "WRONG_MODEL", "weight_claimed": 64.0, "weight_used": 0.0,
             "reason": "fingerprint differs"},
            {"peer_id": "12D3KooWPeerC3333", "outcome": "NOT_ALIVE", "weight_claimed": 0.0, "weight_used": 0.0,
             "reason": ""},
        ],
        "bytes_sent": 3 * 2**20, "bytes_received": 5 * 2**20, "allreduce_s": 3.9, "fraction_averaged": 0.5,
        "total_weight": 64.0, "num_elements": 1_000_000, "model_fingerprint": "abc", "compression": "none",
        "mode": "gradient", "tokens": 65536, "error": error,
    }


def render_text(renderable, width: int = 150) -> str:
    console = Console(record=True, width=width, color_system=None)
    console.print(renderable)
    return console.export_text()


def test_live_dashboard_shows_what_a_writer_thread_publishes():
    tel = Telemetry("validator")
    tel.update(uid=7, hotkey="5GrwvaEF5zXb26Fz9rcQpDWS57CtERHpNehXCPcNoHGKutQY", network="sandbox", netuid=38,
               peer_id=LOCAL, api="127.0.0.1:8091", state="training", target_batch=1024)
    console = Console(record=True, width=150, force_terminal=True, color_system=None)
    dash = LiveDashboard(tel, console=console, refresh_hz=50, redirect=False)
    written = []

    def writer() -> None:
        # Each phase waits for the dashboard to draw at least one more frame, so every state below
        # is actually rendered while the Live is running (not only at stop).
        for i in range(200):
            tel.train_metrics(loss=4.0 - i * 0.01, tokens_per_s=900.0 + i, grad_norm=0.75, lr=3e-4, epoch=5,
                              inner_step=i, samples=8 * i, samples_accumulated=8 * (i % 100), global_samples=800)
            written.append(i)
        dash.wait_frames(dash.frames + 2)
        tel.round_finished(round_record())
        tel.set_miners([MinerRow(uid=11, hotkey="5Fminer11" * 5, score=0.9, ema=0.8, weight=0.7311,
                                 last_outcome="SUCCESS"),
                        MinerRow(uid=12, hotkey="5Fminer12" * 5, score=0.1, ema=0.05, weight=0.0123,
                                 last_outcome="WRONG_MODEL", note="gradient mismatch")])
        dash.wait_frames(dash.frames + 2)
        tel.health("chain", ok=True)
        tel.health("chain", ok=False, detail="ws connection refused")
        dash.wait_frames(dash.frames + 2)

    with dash:
        t = threading.Thread(target=writer)
        t.start()
        t.join(timeout=30)
        assert not t.is_alive()
    assert len(written) == 200
    assert dash.frames >= 6 and dash.last_error is None

    text = console.export_text()
    assert "VALIDATOR" in text and "uid 7" in text and "5Grwv…KutQY" in text
    assert "2.01" in text  # last loss (4.0 - 199*0.01), 4 significant digits
    assert re.search(r"epoch\s+5\b", text)
    assert "inner step 199" in text
    assert "9f3c2a71" in text and "WRONG_MODEL" in text and "NOT_ALIVE" in text and "SUCCESS" in text
    assert "3.0 MiB" in text and "5.0 MiB" in text and "50%" in text
    assert re.search(r"\b11\b.*0\.7311", text) and re.search(r"\b12\b.*0\.0123", text)
    assert "chain ✗ down" in text and "ws connection refused" in text and "last ok" in text


def test_chain_outage_is_red_and_recovery_green():
    tel = Telemetry("miner")
    tel.health("chain", ok=True)
    tel.health("chain", ok=False, detail="timeout after 12s")
    now = tel.snapshot().chain.last_ok + 42
    line = health_line("chain", tel.snapshot().chain, now=now)
    assert "last ok 42s ago" in line.plain and "timeout after 12s" in line.plain
    console = Console(width=120)
    styles = {str(seg.style.color.name) for seg in console.render(line) if seg.style and seg.style.color}
    assert styles == {"red"}

    tel.health("chain", ok=True, detail="block 1234")
    ok = health_line("chain", tel.snapshot().chain)
    assert ok.plain.startswith("chain ● ok")
    assert {str(seg.style.color.name) for seg in console.render(ok) if seg.style and seg.style.color} <= {"green"}
    assert "green" in {str(s.style.color.name) for s in console.render(ok) if s.style and s.style.color}


def test_dashboard_never_blocks_the_writer():
    """While a frame is stuck mid-render, the training thread still completes all its updates."""
    tel = Telemetry("miner")
    in_render = threading.Event()
    release = threading.Event()

    def stuck_render(snapshot):
        in_render.set()
        release.wait(30)
        return render_neuron(snapshot)

    dash = LiveDashboard(tel, console=Console(record=True, width=100), refresh_hz=20, render=stuck_render,
                         redirect=False)
    done = []
    with dash:
        assert in_render.wait(10)

        def train() -> None:
            for i in range(1000):
                tel.train_metrics(loss=1.0, tokens_per_s=1.0, inner_step=i)
                done.append(i)

        t = threading.Thread(target=train)
        t.start()
        t.join(timeout=30)
        finished = not t.is_alive()
        release.set()
    assert finished and len(done) == 1000
    assert tel.snapshot().inner_step == 999


def test_render_error_is_shown_and_the_thread_keeps_drawing():
    tel = Telemetry("miner")
    calls = []

    def flaky(snapshot):
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("boom")
        return render_neuron(snapshot)

    dash = LiveDashboard(tel, console=Console(record=True, width=100), refresh_hz=50, render=flaky, redirect=False)
    with dash:
        assert dash.wait_frames(3)
    assert len(calls) >= 3 and dash.last_error is None


def test_stop_is_clean_and_prints_the_final_state():
    tel = Telemetry("miner")
    console = Console(record=True, width=120)  # not a terminal: Live prints only the final frame
    dash = LiveDashboard(tel, console=console, refresh_hz=10, redirect=False)
    with dash:
        dash.wait_frames(1)
        assert dash.running
        tel.train_metrics(loss=1.2345, tokens_per_s=10.0, epoch=3)
    assert not dash.running
    threads = [t.name for t in threading.enumerate()]
    assert "dtrain-dashboard" not in threads
    assert "1.234" in console.export_text() or "1.235" in console.export_text()


def test_miner_view_has_no_miner_table_and_dict_snapshot_renders_the_same():
    tel = Telemetry("miner")
    tel.train_metrics(loss=3.5, tokens_per_s=100.0, epoch=2, samples_accumulated=256, target_batch=1024)
    tel.round_finished(round_record(round_id="", error="could not find a group") | {"peers": [], "group": []})
    snap = tel.snapshot()
    now = time.time()
    text = render_text(render_neuron(snap, now=now))
    assert "MINER" in text and "last outcome" not in text  # the validator-only miner table is absent
    assert "256/1,024 (25%)" in text
    assert "no group" in text and "could not find a group" in text
    assert render_text(render_neuron(snap.to_dict(), now=now)) == text
    assert as_snapshot(snap.to_dict()).chain.ok is True


def test_live_dashboard_accepts_any_source_callable():
    """``dtrain status --watch`` drives the same Live wrapper from a document fetcher."""
    from dtrain.ui.status_view import render_status

    fetched = []

    def fetch() -> dict:
        fetched.append(1)
        return {"network": "sandbox", "netuid": 38, "block": len(fetched), "global": {}, "miners": [],
                "validators": [], "rounds": []}

    console = Console(record=True, width=100)
    with LiveDashboard(fetch, console=console, render=render_status, refresh_hz=50, redirect=False) as dash:
        assert dash.wait_frames(3)
    assert len(fetched) >= 4  # >= 3 frames plus the final one at stop
    assert f"block {len(fetched)}" in console.export_text()


def test_validator_miner_table_is_capped():
    from dtrain.ui.dashboard import miners_table

    rows = [MinerRow(uid=u, hotkey=f"5H{u:04d}" * 6, weight=u / 1000) for u in range(100)]
    text = render_text(miners_table(rows, limit=10))
    assert "90 more" in text and re.search(r"^\s*9\s", text, re.M) and not re.search(r"^\s*10\s", text, re.M)


def test_validator_view_shows_only_measured_values():
    from dtrain.ui.dashboard import miners_table

    tel = Telemetry("validator")
    tel.set_miners([MinerRow(uid=1, hotkey="5H0001" * 6, gradient=0.97, steps=1.0, bandwidth=0.5, allreduce=1.0,
                             score=0.9, ema=0.4, weight=0.6),
                    # Not queried in its last round: no component was measured.
                    MinerRow(uid=2, hotkey="5H0002" * 6, ema=0.2, weight=0.4, last_outcome="NOT_ALIVE")])
    text = render_text(render_neuron(tel.snapshot(), now=time.time()))
    assert "VALIDATOR" in text and "chain ● ok" in text
    assert "hub" not in text and "last push" not in text  # validators never push
    table = render_text(miners_table(tel.snapshot().miners))
    row = next(line for line in table.splitlines() if re.match(r"\s*2\s", line))
    assert "0.00" not in row and row.count("—") >= 5
    assert "0.97" in next(line for line in table.splitlines() if re.match(r"\s*1\s", line))
