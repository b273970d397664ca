"""The sandbox's closing summary: loss curve, rounds, each miner's score and weight, and a verdict.

The verdict answers the one question an operator trying ``--adversary`` has: did scoring keep
every cheater well below the honest miners?
"""

from __future__ import annotations

from typing import Any, Mapping

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.text import Text

from dtrain.ui.console import compact_table, duration, fmt_num, human_bytes, short_hotkey
from dtrain.ui.dashboard import outcome_text
from dtrain.ui.sparkline import sparkline, text_plot

ADVERSARY_RATIO = 0.25  # an adversary may keep at most this share of the weakest honest miner's weight


def verdict(doc: Mapping[str, Any], ratio: float = ADVERSARY_RATIO) -> tuple[bool, str]:
    """(passed, one-line explanation), computed from the miners' kinds and weights."""
    miners = list(doc.get("miners") or [])
    honest = [m for m in miners if str(m.get("kind", "honest")) == "honest"]
    adversaries = [m for m in miners if str(m.get("kind", "honest")) != "honest"]
    if not adversaries:
        return True, "no adversaries in this run"
    if not honest:
        return False, "no honest miner to compare the adversaries with"
    weakest = min(float(m.get("weight") or 0.0) for m in honest)
    bound = ratio * weakest
    offenders = [m for m in adversaries if float(m.get("weight") or 0.0) > bound]
    pct = f"{ratio:.0%}"
    if not offenders:
        return True, (f"every adversary ≤ {pct} of the weakest honest miner's weight "
                      f"({weakest:.4f} → bound {bound:.4f})")
    names = ", ".join(f"uid {m.get('uid')} ({m.get('kind')}) weight {float(m.get('weight') or 0.0):.4f}"
                      for m in offenders)
    return False, f"{names} > {pct} of the weakest honest miner's weight ({weakest:.4f} → bound {bound:.4f})"


def _loss_panel(loss: Mapping[str, Any]) -> Panel:
    curve = list(loss.get("curve") or [])
    start, end = loss.get("start"), loss.get("end")
    head = Text()
    head.append(f"loss {fmt_num(start)} → {fmt_num(end)}", style="bold")
    try:
        delta = float(end) - float(start)  # type: ignore[arg-type]
        head.append(f"  ({delta:+.4g})", style="green" if delta < 0 else "red")
    except (TypeError, ValueError):
        pass
    parts: list[RenderableType] = [head]
    if curve:
        parts.append(Text(sparkline(curve, 60), style="cyan"))
        parts.append(Text("\n".join(text_plot(curve, width=60, height=8)), style="cyan"))
    else:
        parts.append(Text("no loss recorded", style="dim"))
    return Panel(Group(*parts), title="loss", title_align="left", border_style="cyan")


def _outcomes(outcomes: Mapping[Any, Any]) -> Text:
    text = Text()
    for i, (uid, outcome) in enumerate(sorted(outcomes.items(), key=lambda kv: str(kv[0]).zfill(6))):
        if i:
            text.append("  ")
        text.append(f"{uid}:")
        text.append_text(outcome_text(outcome))
    return text


def _rounds_table(rounds: list[Mapping[str, Any]]) -> RenderableType:
    t = compact_table("Rounds")
    for name, just in (("round", "right"), ("status", "left"), ("averaged", "right"), ("checked", "right"),
                       ("duration", "right"), ("bytes", "right"), ("outcomes of the checked (uid:outcome)", "left")):
        t.add_column(name, justify=just, no_wrap=not name.startswith("outcomes"))  # type: ignore[arg-type]
    for r in rounds:
        status = str(r.get("status", ""))
        averaged, outcomes = r.get("averaged"), r.get("outcomes") or {}
        t.add_row(str(r.get("round", "—")), Text(status, style="green" if status == "success" else "bold red"),
                  str(len(averaged)) if isinstance(averaged, (list, tuple)) else "—", str(len(outcomes)),
                  duration(r.get("duration_s")), human_bytes(r.get("bytes")), _outcomes(outcomes))
    if not rounds:
        t.add_row("", Text("no rounds ran", style="dim"), "", "", "", "", "")
    return t


def _miners_table(miners: list[Mapping[str, Any]], ratio: float) -> RenderableType:
    honest_weights = [float(m.get("weight") or 0.0) for m in miners if str(m.get("kind", "honest")) == "honest"]
    bound = ratio * min(honest_weights) if honest_weights else None
    comp_keys: list[str] = []
    for m in miners:
        for k in (m.get("components") or {}):
            if k not in comp_keys:
                comp_keys.append(str(k))
    t = compact_table("Miners by weight")
    t.add_column("uid", justify="right", no_wrap=True)
    t.add_column("hotkey", no_wrap=True)
    t.add_column("kind", no_wrap=True)
    t.add_column("score", justify="right", no_wrap=True)
    t.add_column("weight", justify="right", no_wrap=True)
    for k in comp_keys:  # score components shrink first on a narrow terminal
        t.add_column(k, justify="right", overflow="ellipsis")
    for m in sorted(miners, key=lambda m: float(m.get("weight") or 0.0), reverse=True):
        kind = str(m.get("kind", "honest"))
        weight = float(m.get("weight") or 0.0)
        adversary = kind != "honest"
        # Adversaries are always red; one that slipped past the bound gets a yellow warning on its weight.
        over = adversary and bound is not None and weight > bound
        comps = m.get("components") or {}
        t.add_row(str(m.get("uid", "—")), short_hotkey(m.get("hotkey"), 4),
                  Text(kind, style="bold red" if adversary else "green"), fmt_num(m.get("score")),
                  Text(f"{weight:.4f}" + (" ⚠" if over else ""), style="bold yellow" if over else ""),
                  *[fmt_num(comps.get(k)) for k in comp_keys])
    if not miners:
        t.add_row(Text("no miners", style="dim"), "", "", "", "")
    return t


def _validators_table(doc: Mapping[str, Any]) -> RenderableType | None:
    """One row per validator: rounds run and the weights it set. Shown when there are several."""
    validators = list(doc.get("validators") or [])
    if len(validators) < 2:
        return None
    names = {str(uid): name for uid, name in (doc.get("uids") or {}).items()}
    t = compact_table("Validators (independent; each sets its own weights)")
    t.add_column("validator", no_wrap=True)
    t.add_column("uid", justify="right", no_wrap=True)
    t.add_column("rounds", justify="right", no_wrap=True)
    t.add_column("weights set (miner: weight)", overflow="fold")
    for v in validators:
        weights = v.get("weights") or {}
        shown = "  ".join(f"{names.get(str(uid), uid)}: {float(w):.3f}" for uid, w in weights.items())
        t.add_row(str(v.get("name")), str(v.get("uid")), str(v.get("round_counter")),
                  shown or Text("no weights set", style="dim"))
    spread = doc.get("validator_spread")
    if isinstance(spread, (int, float)):
        t.caption = f"largest difference between validators' weights for one miner: {spread:.4f}"
    return t


def _memory_table(doc: Mapping[str, Any]) -> RenderableType | None:
    """One row per neuron: the peak Pss of its process tree and of each process in it."""
    rows = list(doc.get("memory") or [])
    if not rows:
        return None
    kinds = [k for k in ("neuron", "averager", "dht", "p2pd")
             if any(k in (r.get("processes") or {}) for r in rows)]
    t = compact_table("Peak memory (Pss) per neuron")
    t.add_column("neuron", no_wrap=True)
    t.add_column("tree", justify="right", no_wrap=True)
    for k in kinds:
        t.add_column(k, justify="right", no_wrap=True)
    params = (doc.get("model") or {}).get("parameters")
    if params:
        t.add_column("bytes/param", justify="right", no_wrap=True)
    for r in rows:
        procs = r.get("processes") or {}
        cells = [str(r.get("name")), human_bytes(r.get("peak_pss")), *[human_bytes(procs.get(k)) for k in kinds]]
        if params:
            cells.append(f"{float(r.get('peak_pss') or 0) / params:.1f}")
        t.add_row(*cells)
    t.caption = "each column is its own peak; bytes/param counts the whole tree, runtime included"
    return t


def render_summary(doc: Mapping[str, Any], ratio: float = ADVERSARY_RATIO) -> RenderableType:
    """The whole closing summary of ``dtrain sandbox``."""
    ok, why = verdict(doc, ratio)
    rounds = list(doc.get("rounds") or [])
    n_ok = sum(1 for r in rounds if r.get("status") == "success")
    head = Text()
    head.append("sandbox summary", style="bold")
    head.append(f"  wall {duration(doc.get('wall_s'))}  rounds {n_ok}/{len(rounds)} succeeded")
    model = doc.get("model") or {}
    if model.get("preset"):
        params = model.get("parameters")
        head.append(f"  model {model['preset']}" + (f" ({params / 1e6:.1f}M parameters)" if params else ""))
    line = Text()
    line.append("PASS " if ok else "FAIL ", style="bold green" if ok else "bold red")
    line.append(why, style="green" if ok else "red")
    parts: list[RenderableType] = [head, _loss_panel(doc.get("loss") or {}), _rounds_table(rounds),
                                   _miners_table(list(doc.get("miners") or []), ratio)]
    parts += [t for t in (_validators_table(doc), _memory_table(doc)) if t is not None]
    return Group(*parts, line)
