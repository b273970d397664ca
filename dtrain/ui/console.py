"""Console helpers shared by every view.

Human messages go to stderr so that stdout stays a clean channel for ``--json`` documents.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from rich.console import Console

if TYPE_CHECKING:
    from rich.table import Table

_stderr_console: Console | None = None


def stderr_console() -> Console:
    """The process-wide console for messages, warnings and progress bars (never stdout)."""
    global _stderr_console
    if _stderr_console is None:
        _stderr_console = Console(stderr=True)
    return _stderr_console


def human_bytes(n: Any) -> str:
    """1536 -> '1.5 KiB'. Binary units, because payload sizes are computed in MiB elsewhere."""
    try:
        value = float(n)
    except (TypeError, ValueError):
        return "—"
    if not math.isfinite(value):
        return "—"
    sign = "-" if value < 0 else ""
    value = abs(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{sign}{int(value)} B" if unit == "B" else f"{sign}{value:.1f} {unit}"
        value /= 1024
    return "—"  # unreachable; keeps type checkers quiet


def short_hotkey(hotkey: Any, keep: int = 5) -> str:
    """'5GrwvaEF5zXb26Fz9rcQpDWS57CtERHpNehXCPcNoHGKutQY' -> '5Grwv…KutQY' (enough to tell keys apart)."""
    text = "" if hotkey is None else str(hotkey)
    if not text:
        return "—"
    if len(text) <= 2 * keep + 1:
        return text
    return f"{text[:keep]}…{text[-keep:]}"


def short_id(value: Any, keep: int = 6) -> str:
    """Peer ids share a long multihash prefix ('12D3KooW…'), so keep only the distinguishing tail."""
    text = "" if value is None else str(value)
    if not text:
        return "—"
    if len(text) <= keep + 1:
        return text
    return f"…{text[-keep:]}"


def ago(seconds: Any) -> str:
    """Age as an operator reads it: '4s ago', '3m 12s ago', '2h 5m ago', '3d 4h ago'."""
    try:
        s = float(seconds)
    except (TypeError, ValueError):
        return "never"
    if not math.isfinite(s):
        return "never"
    s = max(0.0, s)  # clocks of different processes can disagree by a little; never show negative ages
    return f"{duration(s)} ago"


def duration(seconds: Any) -> str:
    """Compact duration: '0.4s', '12s', '3m 12s', '2h 05m', '3d 4h'."""
    try:
        s = float(seconds)
    except (TypeError, ValueError):
        return "—"
    if not math.isfinite(s):
        return "—"
    s = max(0.0, s)
    if s < 10:
        return f"{s:.1f}s"
    if s < 60:
        return f"{int(s)}s"
    m, sec = divmod(int(s), 60)
    if m < 60:
        return f"{m}m {sec:02d}s"
    h, m = divmod(m, 60)
    if h < 24:
        return f"{h}h {m:02d}m"
    d, h = divmod(h, 24)
    return f"{d}d {h}h"


def fmt_num(value: Any, digits: int = 4) -> str:
    """A metric for a table cell: '—' when missing or non-finite, else ``digits`` significant digits."""
    if value is None or isinstance(value, bool):
        return "—" if value is None else str(value)
    try:
        f = float(value)
    except (TypeError, ValueError):
        return str(value)
    if not math.isfinite(f):
        return "nan" if math.isnan(f) else ("inf" if f > 0 else "-inf")
    if isinstance(value, int):
        return f"{value:,}"
    return f"{f:.{digits}g}"


def compact_table(title: str | None = None, **kwargs: Any) -> Table:
    """The table style every view shares: light rules, one space between columns, left title.

    Tight padding matters because operators run these on 80-column terminals and tmux panes.
    """
    from rich import box
    from rich.table import Table

    opts: dict[str, Any] = dict(box=box.SIMPLE_HEAD, padding=(0, 1), collapse_padding=True, pad_edge=False,
                                title_justify="left")
    opts.update(kwargs)
    return Table(title=title, **opts)
