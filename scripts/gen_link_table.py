"""Regenerate the "What link do I need?" table of docs/operators.md.

    python scripts/gen_link_table.py          # rewrite the table
    python scripts/gen_link_table.py --check  # exit 1 if it is stale

Bytes per round follow from the model's size: a butterfly all-reduce of a D-byte vector
sends and receives 2·D·(n−1)/n bytes per peer. Round times divide that by the link rate
and by the efficiency measured with benchmarks/allreduce_netns.py (MEASURED_EFFICIENCY).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dtrain.config import AllReduceConfig  # noqa: E402
from dtrain.swarm.averaging.settings import part_size_for  # noqa: E402  (loads no hivemind)
from dtrain.swarm.codecs import BLOCK  # noqa: E402
from dtrain.training.models import GPT2_VOCAB_SIZE, PRESETS  # noqa: E402
from dtrain.training.work import WORK_SKETCH_K  # noqa: E402
from scripts.docgen import check_flag, write_or_check  # noqa: E402

DOC = ROOT / "docs" / "operators.md"
BEGIN, END = "<!-- link-table -->", "<!-- /link-table -->"
MODELS = ("gpt2-124m", "gpt2-250m", "gpt2-1b")
VOCAB = GPT2_VOCAB_SIZE  # the GPT-2 tokenizer (distilgpt2) the live subnet trains with
GROUP = 16  # peers in a round: (n-1)/n is within 7 % of 1 from here up
DEFAULT_H = AllReduceConfig().diloco_inner_steps
# Wire bytes per value: fp32 4; dtrain's blockwise 8-bit 1, plus one float32 scale per BLOCK
# values (dtrain/swarm/codecs.py, BlockwiseAbsmax8Bit: 0.266 of fp32).
WIRE_BYTES = {"fp32": 4.0, "8-bit": 1.0 + 4 / BLOCK}
CLAIM_BYTES = WORK_SKETCH_K * 4  # a work commitment's claim per part: WORK_SKETCH_K float32 values
NODE_BYTES = 32 + WORK_SKETCH_K * 8  # a claims tree node: its hash and its sum (float64)
# Bound ÷ measured of the butterfly as `dtrain mine` ships it (CenteredClip, work
# commitments, the result check, the production part size): benchmarks/allreduce_netns.py's
# link-bound setting, 8 peers on 25 Mbit, "dtrain", the median of three runs (docs/swarm.md,
# "Measured"). The other setting, 4 peers on 100 Mbit, measures the CPU of four peers
# sharing a 2-core VM (0.66 there), not what a link allows one peer per machine.
MEASURED_EFFICIENCY = 0.74


def gpt2_params(n_layer: int, n_embd: int, n_positions: int, vocab: int = VOCAB) -> int:
    """Trainable parameters of a GPT-2 with tied input/output embeddings."""
    per_layer = 12 * n_embd * n_embd + 13 * n_embd  # attention (4 d²+4 d), MLP (8 d²+5 d), 2 LayerNorms (4 d)
    return vocab * n_embd + n_positions * n_embd + n_layer * per_layer + 2 * n_embd


def _size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n / 1e3:.3g} kB"


def _time(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 60:
        return f"{seconds / 60:.1f} min"
    if seconds >= 1:
        return f"{seconds:.1f} s"
    return f"{seconds * 1000:.0f} ms"


def round_bytes(params: int, wire: str, n: int = GROUP) -> float:
    """Bytes one peer sends (and, as many, receives) in one round."""
    return 2 * params * WIRE_BYTES[wire] * (n - 1) / n


def commitment_bytes(params: int, wire: str, n: int = GROUP) -> float:
    """Bytes of work commitments a peer sends in a round: its claims, each to the reducer of
    its part, the tree nodes that prove each reducer's share (at most two per tree level),
    and its claims tree's root in the gather (docs/protocol.md, "The claims tree")."""
    parts = math.ceil(params * WIRE_BYTES[wire] / part_size_for(4 * params))
    levels = max(1, math.ceil(math.log2(parts)))
    return parts * CLAIM_BYTES + (n - 1) * 2 * levels * NODE_BYTES + NODE_BYTES


def round_seconds(params: int, wire: str, mbit: float, efficiency: float = MEASURED_EFFICIENCY) -> float:
    return round_bytes(params, wire) * 8 / (mbit * 1e6) / efficiency


def table() -> str:
    head = ("| model | parameters | wire | bytes per round, each way | round time, 100 Mbit/s | 1 Gbit/s "
            f"| DiLoCo, H = {DEFAULT_H}: bytes per inner step | work commitment per peer per round |")
    lines = [head, "|" + "---|" * 8]
    for name in MODELS:
        p = PRESETS[name]
        params = gpt2_params(p.n_layer, p.n_embd, p.n_positions)
        for wire in WIRE_BYTES:
            slow, fast = round_seconds(params, wire, 100), round_seconds(params, wire, 1000)
            lines.append(f"| {name} | {params / 1e6:.0f} M | {wire} | {_size(round_bytes(params, wire))} "
                         f"| {_time(slow)} | {_time(fast)} | {_size(round_bytes(params, wire) / DEFAULT_H)} "
                         f"| {_size(commitment_bytes(params, wire))} |")
    return "\n".join(lines)


def render(text: str) -> str:
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[:start] + "\n" + table() + "\n" + text[end:]


def main() -> int:
    check = check_flag(__doc__.splitlines()[0])
    return write_or_check(DOC, render(DOC.read_text()), check=check, what="link table is")


if __name__ == "__main__":
    raise SystemExit(main())
