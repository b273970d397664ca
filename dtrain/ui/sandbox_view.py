"""The live table ``dtrain sandbox`` shows while its neurons run."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from rich.console import Group
from rich.table import Table
from rich.text import Text

from dtrain.ui.console import fmt_num


def render_sandbox(rows: Sequence[Mapping[str, Any]], events: Sequence[str], *, rounds: int,
                   elapsed_s: float) -> Group:
    table = Table(title=f"dtrain sandbox: {rounds} round(s), {elapsed_s:.0f}s elapsed", expand=False)
    for column in ("neuron", "kind", "uid", "state", "epoch", "loss", "peers", "last event"):
        table.add_column(column)
    for row in rows:
        kind = row.get("kind", "")
        style = "red" if kind not in ("honest", "validator") else ("cyan" if kind == "validator" else "green")
        state = row.get("state") or ""
        if not row.get("alive") and state not in ("stopped", "not started"):
            state = f"exited ({state})" if state else "exited"
        last = (row.get("events") or [""])[-1]
        table.add_row(row.get("name", ""), Text(kind, style=style), str(row.get("uid", "")), state,
                      fmt_num(row.get("epoch")), fmt_num(row.get("loss")), fmt_num(row.get("peers")),
                      Text(str(last)[:60], style="dim"))
    tail = Text("\n".join(events[-6:]), style="dim")
    return Group(table, tail)
