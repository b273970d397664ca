"""Plain line logs (pm2/systemd): text and JSON formats, rate limiting of train events, never raising."""

from __future__ import annotations

import io
import json
import re
import shlex

from dtrain.telemetry import Telemetry
from dtrain.ui.loglines import attach_line_logger, utc_timestamp

TS = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def parse_text(line: str) -> tuple[str, str, str, dict[str, str]]:
    ts, level, kind, *pairs = shlex.split(line)
    return ts, level, kind, dict(p.split("=", 1) for p in pairs)


def record() -> dict:
    return {"round_id": "0123456789abcdef0123", "local_peer_id": "A", "started_at": 1.0, "duration_s": 2.5,
            "group": ["A", "B"], "peers": [{"peer_id": "A", "outcome": "SUCCESS"}, {"peer_id": "B", "outcome": "FAIL"}],
            "bytes_sent": 100, "bytes_received": 200, "fraction_averaged": 0.5, "error": ""}


def test_text_lines_parse():
    tel, out = Telemetry("miner"), io.StringIO()
    attach_line_logger(tel, out, fmt="text", min_interval_s=0)
    tel.train_metrics(loss=2.5, tokens_per_s=1234.5, grad_norm=None, lr=0.0003, epoch=4)
    tel.round_finished(record())
    tel.health("hub", ok=False, detail="upload failed: 503")
    tel.event("pushed model", tag="run.4.10")
    lines = out.getvalue().splitlines()
    assert len(lines) == 4
    parsed = [parse_text(line) for line in lines]
    assert all(TS.match(p[0]) for p in parsed)
    ts, level, kind, kv = parsed[0]
    assert (level, kind) == ("INFO", "train")
    assert kv["loss"] == "2.5" and kv["epoch"] == "4" and kv["grad_norm"] == "-" and kv["lr"] == "0.0003"
    _, level, kind, kv = parsed[1]
    assert (level, kind) == ("INFO", "round")
    assert kv["round_id"] == "0123456789abcdef" and kv["group"] == "2" and kv["outcomes"] == "FAIL=1,SUCCESS=1"
    _, level, kind, kv = parsed[2]
    assert (level, kind, kv["service"], kv["ok"], kv["detail"]) == ("ERROR", "health", "hub", "false",
                                                                    "upload failed: 503")
    _, level, kind, kv = parsed[3]
    assert (kind, kv["msg"], kv["tag"]) == ("event", "pushed model", "run.4.10")


def test_json_lines_parse_and_keep_the_full_round():
    tel, out = Telemetry("validator"), io.StringIO()
    attach_line_logger(tel, out, fmt="json", min_interval_s=0)
    tel.train_metrics(loss=float("nan"), tokens_per_s=10.0)
    tel.round_finished(record() | {"error": "could not find a group"})
    tel.event("weights set", level="warning", uids=[1, 2])
    docs = [json.loads(line, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
            for line in out.getvalue().splitlines()]
    assert [d["kind"] for d in docs] == ["train", "round", "event"]
    assert all(TS.match(d["ts"]) for d in docs)
    assert docs[0]["loss"] is None  # strict JSON: a NaN loss is null (unknown), never a bare NaN
    assert docs[1]["level"] == "WARNING" and docs[1]["peers"][1]["outcome"] == "FAIL"
    assert docs[2]["level"] == "WARNING" and docs[2]["uids"] == [1, 2] and docs[2]["message"] == "weights set"


def test_train_events_are_rate_limited_but_others_are_not():
    tel, out, clock = Telemetry("miner"), io.StringIO(), FakeClock()
    logger = attach_line_logger(tel, out, fmt="text", min_interval_s=5.0, clock=clock)
    for i in range(10):  # t = 0..9: lines at t=0 and t=5 only
        clock.t = float(i)
        tel.train_metrics(loss=1.0, tokens_per_s=1.0, inner_step=i)
        tel.event(f"step {i}")
    kinds = [parse_text(line)[2] for line in out.getvalue().splitlines()]
    assert kinds.count("event") == 10
    trains = [parse_text(line)[3] for line in out.getvalue().splitlines() if " train " in line]
    assert [kv["inner_step"] for kv in trains] == ["0", "5"]
    assert "suppressed" not in trains[0] and trains[1]["suppressed"] == "4"
    assert logger.suppressed == 4  # t=6..9, reported on the next train line


def test_logger_never_raises_and_close_silences():
    class Broken(io.StringIO):
        def write(self, s):  # noqa: ARG002
            raise OSError("disk full")

    tel = Telemetry("miner")
    logger = attach_line_logger(tel, Broken(), fmt="json", min_interval_s=0)
    logger("train", {"loss": object()})  # called directly: Telemetry's own guard is not what protects us
    logger("event", {"message": "x"})
    assert logger.errors == 2 and logger.lines == 0

    out = io.StringIO()
    logger = attach_line_logger(tel, out, min_interval_s=0)
    tel.event("one")
    logger.close()
    tel.event("two")
    assert "one" in out.getvalue() and "two" not in out.getvalue()


def test_utc_timestamp_format():
    assert utc_timestamp(0) == "1970-01-01T00:00:00.000Z"
    assert utc_timestamp(1.2345) == "1970-01-01T00:00:01.234Z"
