"""Progress bars for ``dtrain push`` and ``dtrain benchmark-bandwidth``, and the benchmark table.

The engines report progress through plain callables so they never depend on Rich. The
callback here takes ``(event, done, total)``; it also accepts the two shapes the engines
already emit — a hub ``ProgressEvent`` (stage, bytes_done, bytes_total, attempt, message) and the
bandwidth engine's ``(stage, fraction)`` — so the CLI needs no glue code.
"""

from __future__ import annotations

import threading
from typing import Any, Iterable, Mapping

from rich.console import Console
from rich.progress import (
    BarColumn, DownloadColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn, TransferSpeedColumn,
)
from rich.table import Table
from rich.text import Text

from dtrain.ui.console import compact_table, fmt_num, stderr_console

FRACTION_SCALE = 1000  # a (stage, fraction) report is drawn as done/1000


class CallbackProgress:
    """A Rich Progress driven by a callback; use as a context manager, pass ``self`` as the callback.

    One bar, whose description follows the current event. Retry events are also printed as a
    line above the bar, so the operator sees that (and why) an attempt was repeated. The
    callback never raises: it is called from upload/benchmark code that must not fail on UI bugs.
    """

    def __init__(self, progress: Progress, description: str):
        self.progress = progress
        self.description = description
        self.events: list[tuple[str, int, int]] = []  # every report, for tests and for a final summary
        self._task: Any = None
        self._lock = threading.Lock()

    def __enter__(self) -> "CallbackProgress":
        self.progress.start()
        self._task = self.progress.add_task(self.description, total=None)
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    @staticmethod
    def _normalise(event: Any, done: Any, total: Any) -> tuple[str, int, int, str]:
        if hasattr(event, "stage"):  # dtrain.hub ProgressEvent
            msg = str(getattr(event, "message", "") or "")
            attempt = int(getattr(event, "attempt", 1) or 1)
            if attempt > 1:
                msg = f"{msg} (attempt {attempt})".strip()
            return str(event.stage), int(event.bytes_done or 0), int(event.bytes_total or 0), msg
        if total is None and isinstance(done, float):  # (stage, fraction in [0, 1])
            return str(event), int(round(max(0.0, min(1.0, done)) * FRACTION_SCALE)), FRACTION_SCALE, ""
        return str(event), int(done or 0), int(total or 0), ""

    def __call__(self, event: Any, done: Any = 0, total: Any = None) -> None:
        try:
            name, d, t, msg = self._normalise(event, done, total)
            with self._lock:
                self.events.append((name, d, t))
                label = f"{self.description}: {name}" + (f" — {msg}" if msg else "")
                if name.startswith("retry"):
                    self.progress.console.print(Text(f"↻ {label}", style="yellow"))
                self.progress.update(self._task, description=label, completed=d, total=t if t > 0 else None)
        except Exception:  # noqa: BLE001 - progress is cosmetic
            pass


def push_progress(console: Console | None = None, transient: bool = False) -> CallbackProgress:
    """Bar for ``dtrain push``: bytes done/total and speed (on stderr by default)."""
    progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
                        TransferSpeedColumn(), TimeElapsedColumn(), console=console or stderr_console(),
                        transient=transient)
    return CallbackProgress(progress, "push")


def benchmark_progress(console: Console | None = None, transient: bool = True) -> CallbackProgress:
    """Bar for ``dtrain benchmark-bandwidth`` stages (transient: the results table replaces it)."""
    progress = Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(), TimeElapsedColumn(),
                        console=console or stderr_console(), transient=transient)
    return CallbackProgress(progress, "benchmark")


def _pick(row: Mapping[str, Any], *keys: str) -> Any:
    for k in keys:
        if row.get(k) is not None:
            return row[k]
    return None


def benchmark_table(results: Iterable[Mapping[str, Any]]) -> Table:
    """peers, size, seconds, algbw, busbw, max |error|, bound, and measured-vs-bound efficiency.

    Accepts the brief's short keys and the engine's unit-suffixed ones (``algbw_mb_s``,
    ``busbw_mb_s``, ``bound_s``). The bound is the minimum time the link allows, so
    efficiency = bound / measured seconds (1.0 = running at link speed).
    """
    t = compact_table("Bandwidth benchmark")
    for name in ("peers", "size (MiB)", "seconds", "algbw (MiB/s)", "busbw (MiB/s)", "max |err|", "bound (s)",
                 "efficiency"):
        t.add_column(name, justify="right")
    rows = list(results)
    for r in rows:
        seconds, bound = _pick(r, "seconds"), _pick(r, "bound", "bound_s")
        eff = _pick(r, "efficiency")
        if eff is None and isinstance(bound, (int, float)) and isinstance(seconds, (int, float)) and seconds > 0:
            eff = bound / seconds
        err = _pick(r, "max_abs_error")
        err_text = Text("—", style="dim") if err is None else Text(
            f"{float(err):.2e}", style="green" if float(err) <= 1e-5 else "yellow")
        t.add_row(fmt_num(_pick(r, "peers")), fmt_num(_pick(r, "size_mb"), 4), fmt_num(seconds, 4),
                  fmt_num(_pick(r, "algbw", "algbw_mb_s"), 4), fmt_num(_pick(r, "busbw", "busbw_mb_s"), 4),
                  err_text, fmt_num(bound, 4) if bound is not None else Text("no link speed", style="dim"),
                  "—" if eff is None else f"{100 * float(eff):.0f}%")
    if not rows:
        t.add_row(Text("no results", style="dim"), *[""] * 7)
    return t
