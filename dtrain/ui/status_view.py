"""``dtrain status`` view, rendered from the same plain dict that ``--json`` prints.

Building from the JSON document (not from live objects) keeps the two outputs in step: what the
table shows is exactly what a script would read.
"""

from __future__ import annotations

import time
from typing import Any, Mapping

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from dtrain.ui.console import compact_table, fmt_num, short_hotkey, short_id
from dtrain.ui.dashboard import as_snapshot, progress_row, rounds_table, service_lines


def _header(doc: Mapping[str, Any]) -> RenderableType:
    g = doc.get("global") or {}
    head = Text()
    head.append(f"{doc.get('network') or '?'}", style="bold")
    head.append(f"  netuid {doc.get('netuid', '?')}")
    head.append(f"  block {doc['block']:,}" if isinstance(doc.get("block"), int) else
                f"  block {doc.get('block') if doc.get('block') is not None else '—'}")
    head.append(f"  global epoch {g.get('epoch', '—')}", style="bold cyan")
    if doc.get("mode") == "diloco":
        head.append(f"  DiLoCo, H = {doc.get('diloco_inner_steps') or '?'} inner steps per round")
    grid = Table.grid(padding=(0, 1))
    grid.add_row(head)
    bar = Table.grid(padding=(0, 1))
    bar.add_row(Text("samples toward target batch"), progress_row(g.get("samples"), g.get("target_batch")))
    grid.add_row(bar)
    return grid


def miners_status_table(miners: list[Mapping[str, Any]]) -> Table:
    t = compact_table("Miners")
    for name, just in (("uid", "right"), ("hotkey", "left"), ("api", "left"), ("peer id", "left"),
                       ("epoch", "right"), ("stake", "right"), ("weight", "right"), ("vpermit", "center")):
        # Only the API address may shrink (with "…"); ids and numbers stay whole.
        t.add_column(name, justify=just, no_wrap=name != "api", overflow="ellipsis")  # type: ignore[arg-type]
    for m in sorted(miners, key=lambda m: (m.get("uid") is None, m.get("uid") or 0)):
        weight = m.get("weight")
        t.add_row(str(m.get("uid", "—")), short_hotkey(m.get("hotkey")),
                  m.get("api") or Text("no commitment", style="dim"), short_id(m.get("peer_id")),
                  "—" if m.get("epoch") is None else str(m.get("epoch")), fmt_num(m.get("stake"), 6),
                  "—" if weight is None else f"{float(weight):.4f}",
                  Text("✓", style="green") if m.get("validator_permit") else "")
    if not miners:
        t.add_row(Text("no miners registered", style="dim"), *[""] * 7)
    return t


def validators_status_table(validators: list[Mapping[str, Any]]) -> Table:
    t = compact_table("Validators")
    t.add_column("uid", justify="right")
    t.add_column("hotkey")
    t.add_column("stake", justify="right")
    t.add_column("rounds", justify="right")
    t.add_column("weights set (uid: weight)", overflow="fold")
    for v in sorted(validators, key=lambda v: (v.get("uid") is None, v.get("uid") or 0)):
        weights = v.get("weights") if isinstance(v.get("weights"), Mapping) else {}
        shown = "  ".join(f"{uid}: {fmt_num(w, 3)}" for uid, w in list(weights.items())[:12])
        if len(weights) > 12:
            shown += f"  … {len(weights) - 12} more"
        rounds = v.get("rounds")
        t.add_row(str(v.get("uid", "—")), short_hotkey(v.get("hotkey")), fmt_num(v.get("stake"), 6),
                  "—" if rounds is None else str(rounds), shown or Text("none yet", style="dim"))
    if not validators:
        t.add_row(Text("no validators", style="dim"), "", "", "", "")
    return t


def local_health(local: Mapping[str, Any], now: float | None = None) -> Panel:
    """This node's own view: identity, progress and service health (from its status file)."""
    s = as_snapshot(local)
    now = time.time() if now is None else now
    line = Text()
    line.append(f"{s.role} uid {s.uid if s.uid is not None else '—'}", style="bold")
    line.append(f"  state {s.state}  epoch {s.epoch}  inner step {s.inner_step}")
    line.append(f"  loss {fmt_num(s.loss)}")
    lines, ok = service_lines(s, now)
    return Panel(Group(line, *lines), title="this node", title_align="left", border_style="green" if ok else "red")


def render_status(doc: Mapping[str, Any], now: float | None = None) -> RenderableType:
    """The full ``dtrain status`` screen."""
    parts: list[RenderableType] = []
    if doc.get("chain_error"):
        parts.append(Panel(Text(str(doc["chain_error"]), style="red"), title="chain unreachable",
                           title_align="left", border_style="red"))
    if doc.get("validator_state_error"):
        parts.append(Text(f"validator state not shown: {doc['validator_state_error']}", style="yellow"))
    if doc.get("poll_error"):
        # --watch keeps the last good picture on screen; say that it is stale and why.
        parts.append(Text(f"refresh failed, showing the last good data: {doc['poll_error']}", style="yellow"))
    parts.append(_header(doc))
    parts.append(miners_status_table(list(doc.get("miners") or [])))
    parts.append(validators_status_table(list(doc.get("validators") or [])))
    parts.append(rounds_table(list(doc.get("rounds") or []), title="Recent all-reduce rounds"))
    if doc.get("local"):
        parts.append(local_health(doc["local"], now))
    return Group(*parts)
