"""Plain structured line logs for pm2/systemd, when there is no terminal for the live dashboard.

One line per telemetry event: ``2026-01-01T12:00:00.123Z INFO train loss=3.21 epoch=4`` (text,
logfmt-style key=value) or one JSON object per line (json). "train" events come every step, so
they are rate-limited; everything else (rounds, health changes, events) is always written.
A logger must never break training: every failure is swallowed (and counted in ``errors``).
"""

from __future__ import annotations

import json
import math
import sys
import threading
import time
from collections import Counter
from datetime import datetime, timezone
from typing import Any, Callable, TextIO

from dtrain import jsonutil
from dtrain.telemetry import Telemetry

FORMATS = ("text", "json")


def utc_timestamp(t: float | None = None) -> str:
    """ISO-8601 UTC with milliseconds and a 'Z' suffix (what log shippers parse without config)."""
    dt = datetime.fromtimestamp(time.time() if t is None else t, tz=timezone.utc)
    return dt.strftime("%Y-%m-%dT%H:%M:%S.") + f"{dt.microsecond // 1000:03d}Z"


def _level(kind: str, fields: dict[str, Any]) -> str:
    if isinstance(fields.get("level"), str):
        return fields["level"].upper()
    if kind == "health":
        return "INFO" if fields.get("ok") else "ERROR"
    if kind == "round" and fields.get("error"):
        return "WARNING"
    return "INFO"


def _round_summary(rec: dict[str, Any]) -> dict[str, Any]:
    """A round record is nested (peers, group); text lines get the part an operator greps for."""
    outcomes = Counter(str(p.get("outcome")) for p in rec.get("peers") or [] if isinstance(p, dict))
    out: dict[str, Any] = {
        "round_id": str(rec.get("round_id") or "")[:16] or "-",
        "duration_s": rec.get("duration_s"),
        "group": len(rec.get("group") or []),
        "outcomes": ",".join(f"{k}={v}" for k, v in sorted(outcomes.items())) or "-",
        "bytes_sent": rec.get("bytes_sent"),
        "bytes_received": rec.get("bytes_received"),
        "fraction_averaged": rec.get("fraction_averaged"),
    }
    if rec.get("error"):
        out["error"] = rec["error"]
    return out


def _text_value(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return f"{v:.6g}" if math.isfinite(v) else str(v)
    if isinstance(v, (list, tuple, dict)):
        v = json.dumps(v, default=str, separators=(",", ":"))
    s = str(v)
    # Quote anything that would split the key=value grammar, so lines stay machine-parseable.
    if s == "" or any(c in s for c in ' ="\n\t'):
        return json.dumps(s)
    return s


class LineLogger:
    """The listener ``attach_line_logger`` subscribes. ``close()`` silences it (Telemetry has no unsubscribe)."""

    def __init__(self, stream: TextIO, fmt: str = "text", min_interval_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic, wallclock: Callable[[], float] = time.time):
        if fmt not in FORMATS:
            raise ValueError(f"log format must be one of {FORMATS}, got {fmt!r}")
        self.stream = stream
        self.fmt = fmt
        self.min_interval_s = float(min_interval_s)
        self._clock = clock
        self._wallclock = wallclock
        self._lock = threading.Lock()  # events arrive from the trainer and swarm threads; keep lines whole
        self._last_train: float | None = None
        self.suppressed = 0  # train events skipped since the last train line (reported on it)
        self.lines = 0
        self.errors = 0
        self.closed = False

    def close(self) -> None:
        self.closed = True

    def format(self, kind: str, fields: dict[str, Any], suppressed: int = 0) -> str:
        level = _level(kind, fields)
        body = _round_summary(fields) if kind == "round" and self.fmt == "text" else dict(fields)
        body.pop("level", None)
        if suppressed:
            body["suppressed"] = suppressed
        ts = utc_timestamp(self._wallclock())
        if self.fmt == "json":
            # Strict JSON: a NaN loss is logged as null (unknown), as in every machine output.
            return jsonutil.dumps({"ts": ts, "level": level, "kind": kind, **body})
        parts = [ts, level, kind]
        message = body.pop("message", None)
        if message is not None:
            parts.append(f"msg={_text_value(message)}")
        parts.extend(f"{k}={_text_value(v)}" for k, v in body.items())
        return " ".join(parts)

    def __call__(self, kind: str, fields: dict[str, Any]) -> None:
        if self.closed:
            return
        try:
            with self._lock:
                suppressed = 0
                if kind == "train":
                    now = self._clock()
                    if self._last_train is not None and now - self._last_train < self.min_interval_s:
                        self.suppressed += 1
                        return
                    self._last_train, suppressed, self.suppressed = now, self.suppressed, 0
                line = self.format(kind, fields if isinstance(fields, dict) else {"value": fields}, suppressed)
                self.stream.write(line + "\n")
                self.stream.flush()
                self.lines += 1
        except Exception:  # noqa: BLE001 - a full disk or closed pipe must not stop training
            self.errors += 1


def attach_line_logger(telemetry: Telemetry, stream: TextIO | None = None, fmt: str = "text",
                       min_interval_s: float = 10.0, *, clock: Callable[[], float] = time.monotonic) -> LineLogger:
    """Subscribe a plain line logger to ``telemetry``; returns it (``close()`` to silence).

    ``stream`` defaults to stderr so that stdout stays free for machine output. ``clock`` is
    the monotonic clock used for rate limiting (injectable for tests).
    """
    logger = LineLogger(stream if stream is not None else sys.stderr, fmt, min_interval_s, clock=clock)
    telemetry.subscribe(logger)
    return logger
