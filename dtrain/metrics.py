"""Prometheus metrics read from :class:`~dtrain.telemetry.Telemetry` at scrape time.

A custom collector turns the latest snapshot into gauges and counters when
Prometheus scrapes, so the training loop pays nothing per step. Miners expose it
on their API's ``GET /metrics``; validators on ``api.metrics_port``. Metric names
are listed in docs/metrics.md.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterator

from dtrain.telemetry import Telemetry

PREFIX = "dtrain_"


class TelemetryCollector:
    def __init__(self, telemetry: Telemetry):
        self.telemetry = telemetry

    def collect(self) -> Iterator:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.telemetry.snapshot()
        labels = ["role"]

        def gauge(name: str, doc: str, value) -> GaugeMetricFamily | None:
            if value is None:
                return None
            g = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            g.add_metric([s.role], float(value))
            return g

        for metric in (
            gauge("epoch", "Global epoch (all-reduce rounds applied) of this replica.", s.epoch),
            gauge("inner_step", "Optimizer steps taken.", s.inner_step),
            gauge("loss", "Latest training (miner) or held-out (validator) loss.", s.loss),
            gauge("tokens_per_second", "Training throughput of the last step.", s.tokens_per_s),
            gauge("grad_norm", "Gradient norm before clipping at the last step.", s.grad_norm),
            gauge("learning_rate", "Current learning rate.", s.lr),
            gauge("samples_accumulated", "Samples in the local batch waiting for a round.", s.samples_accumulated),
            gauge("peers", "Peers in the DHT routing table.", s.peers_seen),
            gauge("chain_up", "1 when the last chain call succeeded.", int(s.chain.ok)),
            gauge("swarm_up", "1 while this node's DHT and averager processes answer.", int(s.swarm.ok)),
            gauge("swarm_restarts", "Times this node restarted its DHT and averager by itself.", s.swarm_restarts),
            # Validators never push: no hub gauge rather than a made-up "up".
            gauge("hub_up", "1 when the last model-store push succeeded (or none failed).",
                  int(s.hub.ok) if s.role == "miner" else None),
        ):
            if metric is not None:
                yield metric
        samples = CounterMetricFamily(PREFIX + "samples", "Samples trained since start.", labels=labels)
        samples.add_metric([s.role], float(s.samples))
        yield samples
        tokens = CounterMetricFamily(PREFIX + "tokens", "Tokens trained since start.", labels=labels)
        tokens.add_metric([s.role], float(s.tokens))
        yield tokens
        # Rounds this process remembers (the last few), by this node's own outcome.
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
        yield rounds
        yield gauge("recent_round_bytes_sent", "Bytes sent in the recent rounds.", sent)
        yield gauge("recent_round_bytes_received", "Bytes received in the recent rounds.", received)
        if s.rounds and s.rounds[-1].get("duration_s") is not None:
            yield gauge("last_round_seconds", "Duration of the last all-reduce round.", s.rounds[-1]["duration_s"])
        if s.miners:
            score = GaugeMetricFamily(PREFIX + "miner_score", "Validator's smoothed score per miner.",
                                      labels=["uid"])
            weight = GaugeMetricFamily(PREFIX + "miner_weight", "Validator's weight per miner.", labels=["uid"])
            for row in s.miners:
                score.add_metric([str(row.uid)], row.ema)
                weight.add_metric([str(row.uid)], row.weight)
            yield score
            yield weight


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
