"""Live Rich dashboard of one neuron (miner or validator), drawn from telemetry snapshots.

The dashboard only *reads*: a background thread takes ``Telemetry.snapshot()`` (a copy made
under the telemetry lock) and renders it. It never calls into the training loop, so a slow
terminal can delay frames but never a training step.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Callable, Iterable, Mapping

from rich import box
from rich.console import Console, Group, RenderableType
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from dtrain.telemetry import Health, MinerRow, Snapshot, Telemetry
from dtrain.ui.console import ago, duration, fmt_num, human_bytes, short_hotkey, short_id
from dtrain.ui.sparkline import sparkline

OUTCOME_STYLES = {
    "SUCCESS": "green",
    "FAIL": "red",
    "NON_PARTICIPATING": "yellow",
    "NOT_ALIVE": "magenta",
    "WRONG_MODEL": "bold red",
}
SPARK_WIDTH = 32
MAX_ROUNDS_SHOWN = 6
MAX_EVENTS_SHOWN = 8


def outcome_text(outcome: Any) -> Text:
    label = str(getattr(outcome, "value", outcome) or "—")
    return Text(label, style=OUTCOME_STYLES.get(label, "dim"))


# --- snapshot normalisation ------------------------------------------------------


def as_snapshot(obj: Snapshot | Mapping[str, Any]) -> Snapshot:
    """Accept a live Snapshot or its ``to_dict()`` form (status files, ``dtrain status`` JSON).

    Unknown keys are dropped so a newer writer does not break an older reader.
    """
    if isinstance(obj, Snapshot):
        return obj
    known = {f.name for f in dataclasses.fields(Snapshot)}
    kwargs = {k: v for k, v in dict(obj).items() if k in known}
    for name in ("chain", "hub", "swarm"):
        if isinstance(kwargs.get(name), Mapping):
            hf = {f.name for f in dataclasses.fields(Health)}
            kwargs[name] = Health(**{k: v for k, v in kwargs[name].items() if k in hf})
    if isinstance(kwargs.get("miners"), list):
        mf = {f.name for f in dataclasses.fields(MinerRow)}
        kwargs["miners"] = [MinerRow(**{k: v for k, v in m.items() if k in mf}) if isinstance(m, Mapping) else m
                            for m in kwargs["miners"]]
    return Snapshot(**kwargs)


# --- building blocks (also used by dtrain.ui.status_view) ------------------------


def health_line(name: str, health: Health | Mapping[str, Any], now: float | None = None) -> Text:
    """'chain ● ok' in green, or 'chain ✗ <detail> · last error: … · last ok 42s ago' in red."""
    h = health if isinstance(health, Health) else as_snapshot({"chain": health}).chain
    now = time.time() if now is None else now
    text = Text()
    if h.ok:
        text.append(f"{name} ● ok", style="green")
        if h.detail:
            text.append(f"  {h.detail}", style="dim")
        return text
    text.append(f"{name} ✗ down", style="bold red")
    if h.detail:
        text.append(f"  {h.detail}", style="red")
    if h.last_error and h.last_error != h.detail:
        text.append(f"  · last error: {h.last_error}", style="red")
    text.append("  · last ok " + (ago(now - h.last_ok) if h.last_ok else "never"), style="red")
    return text


def progress_row(done: Any, total: Any, width: int = 30) -> RenderableType:
    """A bar with 'done/total (pct)' beside it; just the count when the total is unknown,
    and "unknown" (never a made-up 0) when the count itself is."""
    if done is None:
        return Text("unknown" + (f" / {int(total):,}" if isinstance(total, int) and total > 0 else ""), style="dim")
    try:
        d, t = int(done or 0), int(total or 0)
    except (TypeError, ValueError):
        return Text(f"{done}/{total}")
    if t <= 0:
        return Text(f"{d:,} / ?", style="dim")
    grid = Table.grid(padding=(0, 1))
    grid.add_row(ProgressBar(total=t, completed=min(d, t), width=width),
                 Text(f"{d:,}/{t:,} ({100 * d / t:.0f}%)"))
    return grid


def peer_outcomes(peers: Iterable[Mapping[str, Any]], local_peer_id: str = "") -> Text:
    """One line per peer: short id and its outcome, coloured; this node is marked '*'."""
    text = Text()
    for i, p in enumerate(peers):
        if i:
            text.append("\n")
        pid = str(p.get("peer_id", ""))
        mark = "*" if local_peer_id and pid == local_peer_id else " "
        text.append(f"{short_id(pid)}{mark}")
        text.append(" ")
        text.append_text(outcome_text(p.get("outcome")))
        if p.get("reason"):
            text.append(f" {p['reason']}", style="dim")
    return text if text.plain else Text("—", style="dim")


def rounds_table(rounds: list[Mapping[str, Any]], limit: int = MAX_ROUNDS_SHOWN,
                 title: str | None = "Last rounds") -> Table:
    """Most recent round records first (RoundRecord.to_dict() form)."""
    # Only the outcomes column may wrap: on an 80-column terminal Rich then narrows it (a reason
    # moves to the next line) instead of squeezing byte counts into "3…".
    table = Table(title=title, box=box.SIMPLE_HEAD, expand=False, title_justify="left", padding=(0, 1),
                  collapse_padding=True, pad_edge=False)
    table.add_column("round", no_wrap=True)
    table.add_column("dur", justify="right", no_wrap=True)
    table.add_column("group", justify="right", no_wrap=True)
    table.add_column("outcomes", overflow="fold")
    table.add_column("sent", justify="right", no_wrap=True)
    table.add_column("recv", justify="right", no_wrap=True)
    table.add_column("averaged", justify="right", no_wrap=True)
    for r in list(rounds)[-limit:][::-1]:
        error = str(r.get("error") or "")
        rid = str(r.get("round_id") or r.get("round") or "")
        outcomes = peer_outcomes(r.get("peers") or [], str(r.get("local_peer_id") or ""))
        if error:
            outcomes = Text(error, style="red") if not (r.get("peers") or []) else \
                Text.assemble(outcomes, "\n", (error, "red"))
        frac = r.get("fraction_averaged")
        frac_text = Text("—", style="dim") if frac is None else Text(
            f"{100 * float(frac):.0f}%", style="green" if float(frac) >= 0.999 else ("yellow" if frac else "red"))
        table.add_row(
            rid[:8] if rid else Text("no group", style="red"),
            duration(r.get("duration_s")),
            str(len(r.get("group") or [])),
            outcomes,
            # Unknown byte counts show as "—": a round record that lacks them was not measured.
            human_bytes(r.get("bytes_sent")),
            human_bytes(r.get("bytes_received")),
            frac_text,
        )
    if not rounds:
        table.add_row(Text("no rounds yet", style="dim"), "", "", "", "", "", "")
    return table


MAX_MINERS_SHOWN = 64  # a finney validator sees 256 uids; a terminal does not fit them all


def miners_table(rows: list[MinerRow], title: str | None = "Miners (this validator's view)",
                 limit: int = MAX_MINERS_SHOWN) -> Table:
    """Score components, EMA, weight and last outcome per miner, by uid."""
    table = Table(title=title, box=box.SIMPLE_HEAD, title_justify="left", padding=0, pad_edge=False)
    for name in ("uid", "hotkey", "grad", "steps", "bw", "ar", "score", "EMA", "weight"):
        table.add_column(name, justify="left" if name == "hotkey" else "right", no_wrap=True)
    table.add_column("last outcome", overflow="ellipsis", min_width=7)  # wrappable: narrowed first
    table.add_column("note", overflow="fold")
    ordered = sorted(rows, key=lambda r: r.uid)

    def cell(value, digits: int) -> str:  # a component not measured this round is "—", not 0.00
        return "—" if value is None else f"{value:.{digits}f}"

    for m in ordered[:limit]:
        table.add_row(str(m.uid), short_hotkey(m.hotkey, 4), cell(m.gradient, 2), cell(m.steps, 2),
                      cell(m.bandwidth, 2), cell(m.allreduce, 2), cell(m.score, 3), f"{m.ema:.3f}",
                      f"{m.weight:.4f}", outcome_text(m.last_outcome) if m.last_outcome else Text("—", style="dim"),
                      Text(m.note or "", style="yellow"))
    if len(ordered) > limit:
        table.add_row("…", Text(f"{len(ordered) - limit} more (dtrain status --json lists all)", style="dim"),
                      *[""] * 9)
    if not rows:
        table.add_row(Text("no miners scored yet", style="dim"), *[""] * 10)
    return table


# --- the neuron view ---------------------------------------------------------------


def _header(s: Snapshot, now: float) -> Text:
    # Two short lines rather than one long one, so an 80-column terminal does not wrap mid-field.
    state_style = {"training": "green", "averaging": "cyan", "stopping": "yellow", "error": "bold red"}
    t = Text()
    t.append(f" {s.role.upper()} ", style="bold reverse")
    t.append(f"  uid {s.uid if s.uid is not None else '—'}", style="bold")
    t.append(f"  hotkey {short_hotkey(s.hotkey)}")
    t.append(f"  {s.network or '?'}/{s.netuid}")
    t.append("  state ")
    t.append(s.state, style=state_style.get(s.state, "bold"))
    t.append(f"\n peer {short_id(s.peer_id)}  api {s.api or '—'}"
             f"  up {duration(now - s.started_at) if s.started_at else '—'}", style="dim")
    return t


def _training_panel(s: Snapshot) -> Panel:
    g = Table.grid(padding=(0, 2))
    g.add_column(style="bold")
    g.add_column(justify="right")
    g.add_column()
    g.add_row("loss", fmt_num(s.loss), Text(sparkline(s.loss_history, SPARK_WIDTH), style="cyan"))
    g.add_row("tokens/s", fmt_num(round(s.tokens_per_s, 1), 6) if s.tokens_per_s else "—",
              Text(sparkline(s.tps_history, SPARK_WIDTH), style="magenta"))
    g.add_row("grad norm", fmt_num(s.grad_norm), "")
    g.add_row("lr", fmt_num(s.lr, 3), "")
    g.add_row("epoch", str(s.epoch), f"inner step {s.inner_step:,}")
    g.add_row("samples", f"{s.samples:,}", f"tokens {s.tokens:,}")
    g.add_row("accumulated", "", progress_row(s.samples_accumulated, s.local_batch or s.target_batch))
    g.add_row("global batch", "", progress_row(s.global_samples, s.target_batch))
    return Panel(g, title="training", title_align="left", border_style="blue")


def last_round_throughput(rounds: list[Mapping[str, Any]]) -> float | None:
    """Bytes/s this node moved in its last completed all-reduce, or None if none was measured."""
    for r in reversed(rounds):
        seconds, moved = r.get("allreduce_s"), (r.get("bytes_sent") or 0) + (r.get("bytes_received") or 0)
        if not r.get("error") and isinstance(seconds, (int, float)) and seconds > 0 and moved > 0:
            return moved / seconds
    return None


def _swarm_panel(s: Snapshot, now: float) -> Panel:
    head = Text()
    head.append(f"peers seen {s.peers_seen}")
    head.append("   last round ")
    bps = last_round_throughput(s.rounds)
    head.append(f"{human_bytes(bps)}/s" if bps is not None else "not measured yet",
                style="" if bps is not None else "dim")
    parts: list[RenderableType] = [head]
    if s.current_round:
        cur = dict(s.current_round)
        line = Text("current round ", style="bold cyan")
        started = cur.pop("started_at", None)
        for key, value in cur.items():
            if isinstance(value, (list, tuple)):
                value = len(value)  # a group list is noise here; its size is what matters
            elif key in ("round_id", "peer_id", "local_peer_id"):
                value = str(value)[:8]
            line.append(f"{key}={value} ")
        if isinstance(started, (int, float)):
            line.append(f"running {duration(now - started)}", style="cyan")
        parts.append(line)
    parts.append(rounds_table(s.rounds))
    return Panel(Group(*parts), title="swarm", title_align="left", border_style="cyan")


def service_lines(s: Snapshot, now: float) -> tuple[list[RenderableType], bool]:
    """Health lines of the services this role uses, and whether all are up. Only miners push
    to the model store, so a validator shows no hub row and no "last push"."""
    lines: list[RenderableType] = [health_line("chain", s.chain, now), health_line("swarm", s.swarm, now)]
    ok = s.chain.ok and s.swarm.ok
    if s.role == "miner":
        push = Text("last push ", style="bold")
        push.append(s.last_push or "none yet", style="" if s.last_push else "dim")
        lines += [health_line("hub", s.hub, now), push]
        ok = ok and s.hub.ok
    return lines, ok


def _health_panel(s: Snapshot, now: float) -> Panel:
    lines, ok = service_lines(s, now)
    return Panel(Group(*lines), title="health", title_align="left", border_style="green" if ok else "red")


def _events_panel(s: Snapshot) -> Panel:
    lines = [Text(e, style="red" if "error" in e.lower() or "fail" in e.lower() else "")
             for e in s.events[-MAX_EVENTS_SHOWN:]] or [Text("none yet", style="dim")]
    return Panel(Group(*lines), title="recent events", title_align="left", border_style="dim")


def render_neuron(snapshot: Snapshot | Mapping[str, Any], now: float | None = None) -> RenderableType:
    """The whole neuron view. ``now`` is injectable so ages render deterministically in tests."""
    s = as_snapshot(snapshot)
    now = time.time() if now is None else now
    # Health sits right under the header: Live cuts a too-tall frame at the bottom, and an outage
    # must stay visible even when a validator's miner table is long.
    parts: list[RenderableType] = [_header(s, now), _health_panel(s, now), _training_panel(s),
                                   _swarm_panel(s, now)]
    if s.role == "validator":
        parts.append(Panel(miners_table(s.miners, title=None), title="miners", title_align="left",
                           border_style="magenta"))
    parts.append(_events_panel(s))
    return Group(*parts)


# --- live wrapper -------------------------------------------------------------------------


class LiveDashboard:
    """``with LiveDashboard(telemetry): run()`` — redraws from snapshots in its own thread.

    ``source`` is a Telemetry (its ``snapshot()`` is read) or any zero-argument callable whose
    result ``render`` draws, e.g. ``LiveDashboard(fetch_status_doc, render=render_status,
    refresh_hz=1 / interval)`` for ``dtrain status --watch``; a slow fetch then delays frames,
    never the caller.

    Frames are counted in ``frames`` (tests wait on it rather than on the clock). A render
    error is shown in place of the frame instead of killing the thread, because the
    operator still needs the process (and its training) to keep going.
    """

    def __init__(self, source: Telemetry | Callable[[], Any], *, console: Console | None = None,
                 refresh_hz: float = 4.0, render: Callable[[Any], RenderableType] = render_neuron,
                 transient: bool = False, screen: bool = False, redirect: bool = True):
        from rich.live import Live

        self.source = source
        snapshot = getattr(source, "snapshot", None)
        self._read: Callable[[], Any] = snapshot if callable(snapshot) else source  # type: ignore[assignment]
        self.render = render
        self.interval = 1.0 / max(0.01, float(refresh_hz))  # status --watch may refresh every 100 s
        self.frames = 0
        self.last_error: str | None = None
        self._stop = threading.Event()
        self._frame_cond = threading.Condition()
        self._thread: threading.Thread | None = None
        # auto_refresh off: our thread decides when to draw, so there is exactly one drawing thread.
        self._live = Live(Text("starting…", style="dim"), console=console, auto_refresh=False,
                          transient=transient, screen=screen, redirect_stdout=redirect,
                          redirect_stderr=redirect, vertical_overflow="ellipsis")

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def console(self) -> Console:
        return self._live.console

    def _frame(self) -> RenderableType:
        try:
            out = self.render(self._read())
            self.last_error = None
            return out
        except Exception as exc:  # noqa: BLE001 - a display bug must not take the neuron down
            self.last_error = f"{type(exc).__name__}: {exc}"
            return Text(f"dashboard render failed: {self.last_error}", style="bold red")

    def refresh(self) -> None:
        """Draw one frame now (also called by the thread)."""
        self._live.update(self._frame(), refresh=True)
        with self._frame_cond:
            self.frames += 1
            self._frame_cond.notify_all()

    def wait_frames(self, n: int, timeout: float = 10.0) -> bool:
        """Block until at least ``n`` frames were drawn; for tests and for the CLI's first paint."""
        with self._frame_cond:
            return self._frame_cond.wait_for(lambda: self.frames >= n, timeout=timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.refresh()
            except Exception:  # noqa: BLE001 - e.g. a closed terminal; keep trying until stopped
                pass
            self._stop.wait(self.interval)

    def start(self) -> "LiveDashboard":
        self._live.start(refresh=False)
        self._thread = threading.Thread(target=self._run, name="dtrain-dashboard", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread, draw the final state once, and give the terminal back."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None
        try:
            self._live.update(self._frame(), refresh=False)
        finally:
            self._live.stop()

    def __enter__(self) -> "LiveDashboard":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
