"""Prometheus metrics come from telemetry at scrape time, on a real HTTP endpoint."""

from __future__ import annotations

import socket
import urllib.request

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dtrain.metrics import register, serve
from dtrain.telemetry import MinerRow, Telemetry


def _values(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def _telemetry() -> Telemetry:
    tel = Telemetry("validator")
    tel.train_metrics(loss=3.25, tokens_per_s=1000.0, grad_norm=0.5, lr=1e-3, epoch=7, samples=64, tokens=8192)
    tel.round_finished({"round_id": "ab", "local_peer_id": "me", "duration_s": 2.5, "bytes_sent": 100,
                        "bytes_received": 50, "peers": [{"peer_id": "me", "outcome": "SUCCESS"}]})
    tel.round_finished({"round_id": "cd", "local_peer_id": "me", "duration_s": 1.0, "error": "no group formed",
                        "peers": []})
    tel.set_miners([MinerRow(uid=3, hotkey="5abc", ema=0.4, weight=0.75)])
    tel.health("chain", ok=False, detail="unreachable")
    return tel


def test_collector_reports_the_latest_snapshot():
    registry = CollectorRegistry()
    tel = _telemetry()
    register(tel, registry)
    values = _values(generate_latest(registry).decode())
    role = (("role", "validator"),)
    assert values[("dtrain_loss", role)] == 3.25
    assert values[("dtrain_epoch", role)] == 7
    assert values[("dtrain_samples_total", role)] == 64
    assert values[("dtrain_chain_up", role)] == 0
    assert values[("dtrain_recent_rounds", (("outcome", "SUCCESS"), ("role", "validator")))] == 1
    assert values[("dtrain_recent_rounds", (("outcome", "FAIL"), ("role", "validator")))] == 1
    assert values[("dtrain_miner_weight", (("uid", "3"),))] == 0.75
    # Scrapes read the current state, not a copy taken at registration.
    tel.train_metrics(loss=2.0, tokens_per_s=1.0)
    assert _values(generate_latest(registry).decode())[("dtrain_loss", role)] == 2.0


def test_standalone_endpoint_serves_metrics():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server, thread = serve(_telemetry(), "127.0.0.1", port)
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert "dtrain_loss" in body and "dtrain_miner_score" in body
    finally:
        server.shutdown()
