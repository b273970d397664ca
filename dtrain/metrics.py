"""Prometheus metrics read from :class:`~dtrain.telemetry.Telemetry` at scrape time.

A custom collector turns the latest snapshot into gauges and counters when
Prometheus scrapes, so the training loop pays nothing per step. Miners expose it
on their API's ``GET /metrics``; validators on ``api.metrics_port``. Metric names
are listed in docs/metrics.md.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterator

from dtrain.telemetry import Snapshot, Telemetry

PREFIX = "dtrain_"


class TelemetryCollector:
    def __init__(self, telemetry: Telemetry):
        self.telemetry = telemetry

    def collect(self) -> Iterator:
        s = self.telemetry.snapshot()
        for metric in (*_node_gauges(s), *_counters(s), *_round_metrics(s), *_miner_metrics(s)):
            if metric is not None:
                yield metric


def _gauge(s: Snapshot, name: str, doc: str, value):
    """A gauge labelled with this node's role, or None when ``value`` is unknown."""
    from prometheus_client.core import GaugeMetricFamily

    if value is None:
        return None
    g = GaugeMetricFamily(PREFIX + name, doc, labels=["role"])
    g.add_metric([s.role], float(value))
    return g


def _node_gauges(s: Snapshot) -> list:
    return [
        _gauge(s, "epoch", "Global epoch (all-reduce rounds applied) of this replica.", s.epoch),
        _gauge(s, "inner_step", "Optimizer steps taken.", s.inner_step),
        _gauge(s, "loss", "Latest training (miner) or held-out (validator) loss.", s.loss),
        _gauge(s, "tokens_per_second", "Training throughput of the last step.", s.tokens_per_s),
        _gauge(s, "grad_norm", "Gradient norm before clipping at the last step.", s.grad_norm),
        _gauge(s, "learning_rate", "Current learning rate.", s.lr),
        _gauge(s, "samples_accumulated", "Samples in the local batch waiting for a round.", s.samples_accumulated),
        _gauge(s, "peers", "Peers in the DHT routing table.", s.peers_seen),
        _gauge(s, "chain_up", "1 when the last chain call succeeded.", int(s.chain.ok)),
        _gauge(s, "swarm_up", "1 while this node's DHT and averager processes answer.", int(s.swarm.ok)),
        _gauge(s, "swarm_restarts", "Times this node restarted its DHT and averager by itself.", s.swarm_restarts),
        # Validators never push: no hub gauge rather than a made-up "up".
        _gauge(s, "hub_up", "1 when the last model-store push succeeded (or none failed).",
               int(s.hub.ok) if s.role == "miner" else None),
    ]


def _counters(s: Snapshot) -> list:
    from prometheus_client.core import CounterMetricFamily

    samples = CounterMetricFamily(PREFIX + "samples", "Samples trained since start.", labels=["role"])
    samples.add_metric([s.role], float(s.samples))
    tokens = CounterMetricFamily(PREFIX + "tokens", "Tokens trained since start.", labels=["role"])
    tokens.add_metric([s.role], float(s.tokens))
    return [samples, tokens]


def _round_metrics(s: Snapshot) -> list:
    """Rounds this process remembers (the last few), by this node's own outcome."""
    from prometheus_client.core import GaugeMetricFamily

    outcomes: Counter[str] = Counter()
    sent = received = 0
    for r in s.rounds:
        mine = next((p.get("outcome") for p in r.get("peers", []) if p.get("peer_id") == r.get("local_peer_id")),
                    "FAIL" if r.get("error") else "SUCCESS")
        outcomes[str(mine)] += 1
        sent += int(r.get("bytes_sent") or 0)
        received += int(r.get("bytes_received") or 0)
    rounds = GaugeMetricFamily(PREFIX + "recent_rounds", "Recent all-reduce rounds by this node's outcome.",
                               labels=["role", "outcome"])
    for outcome, count in sorted(outcomes.items()):
        rounds.add_metric([s.role, outcome], count)
    out = [rounds,
           _gauge(s, "recent_round_bytes_sent", "Bytes sent in the recent rounds.", sent),
           _gauge(s, "recent_round_bytes_received", "Bytes received in the recent rounds.", received)]
    if s.rounds and s.rounds[-1].get("duration_s") is not None:
        out.append(_gauge(s, "last_round_seconds", "Duration of the last all-reduce round.",
                          s.rounds[-1]["duration_s"]))
    return out


def _miner_metrics(s: Snapshot) -> list:
    """A validator's smoothed score and weight per miner uid."""
    from prometheus_client.core import GaugeMetricFamily

    if not s.miners:
        return []
    score = GaugeMetricFamily(PREFIX + "miner_score", "Validator's smoothed score per miner.", labels=["uid"])
    weight = GaugeMetricFamily(PREFIX + "miner_weight", "Validator's weight per miner.", labels=["uid"])
    for row in s.miners:
        score.add_metric([str(row.uid)], row.ema)
        weight.add_metric([str(row.uid)], row.weight)
    return [score, weight]


def register(telemetry: Telemetry, registry) -> TelemetryCollector:
    collector = TelemetryCollector(telemetry)
    registry.register(collector)
    return collector


def serve(telemetry: Telemetry, host: str, port: int):
    """A standalone ``/metrics`` endpoint (validators have no API server)."""
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry(auto_describe=False)
    register(telemetry, registry)
    return start_http_server(port, addr=host, registry=registry)
