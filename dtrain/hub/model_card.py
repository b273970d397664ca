"""The model card (README.md) pushed with every checkpoint.

It renders only the facts it is given (an unknown one prints as "unknown", never guessed), so
the miner's background pusher and ``dtrain push`` write the same card. Hugging Face metadata
front matter plus a ``dtrain:`` block, written by hand as JSON-quoted YAML to stay
dependency-free (docs/model-store.md, "The model card").
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Iterable

# dtrain's own licence and the GPT-2 reference code's; a run from a Hub model also carries that
# model's terms, which the card's Limitations say (docs/model-store.md, "The model card").
LICENSE = "mit"
TAGS = ("dtrain", "bittensor", "subnet-38", "distributed-training", "gpt2", "text-generation")
UNKNOWN = "unknown"
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


@dataclass(frozen=True)
class CardFacts:
    """What the card states. ``None`` means unknown (printed as "unknown")."""

    tag: str
    run_id: str
    epoch: int
    inner_step: int
    repo_id: str | None = None  # "owner/name" on the Hub; None for a local directory store
    local_path: str | None = None  # the tag's folder in a local store
    tokens_seen: int | None = None  # tokens the pushing miner trained on since the run began
    last_loss: float | None = None  # the pushing miner's mean training loss before this step
    contributors: int | None = None  # miners whose gradients the last round averaged
    round_id: str | None = None
    round_tokens: int | None = None  # tokens behind the last round's average (all contributors)
    preset: str | None = None
    initial_weights: str | None = None  # model.hub_id when training started from a Hub model
    param_count: int | None = None
    context_length: int | None = None
    vocab_size: int | None = None
    tokenizer: str | None = None
    dataset: str | None = None  # a Hub dataset id; None for local text
    dataset_config: str | None = None
    dataset_revision: str | None = None
    data_description: str | None = None  # e.g. "local text files (the shipped sample corpus)"
    dtrain_version: str | None = None
    extra_tags: tuple[str, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["extra_tags"] = list(self.extra_tags)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CardFacts":
        """Facts saved by :meth:`to_dict` (e.g. next to a checkpoint); unknown keys are ignored."""
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        kw["extra_tags"] = tuple(kw.get("extra_tags") or ())
        return cls(**kw)


def contributors_of(record: Any) -> int:
    """Miners whose gradients a round's average used: SUCCESS with a weight above zero.

    Validators join rounds with weight 0, so they are not counted. ``record`` is a
    dtrain.swarm.records.RoundRecord (or anything with ``peers`` of that shape).
    """
    n = 0
    for p in getattr(record, "peers", ()) or ():
        outcome = getattr(p.outcome, "value", p.outcome)
        if str(outcome) == "SUCCESS" and float(p.weight_used) > 0:
            n += 1
    return n


def _q(value: Any) -> str:
    """A YAML scalar: JSON is a subset of YAML, and quoting every string avoids YAML's
    surprises (``no`` read as false, ``1e3`` as a number, ``:`` in values)."""
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, float) and not math.isfinite(value):
        return json.dumps(str(value))
    return json.dumps(value, ensure_ascii=False)


def _yaml_list(key: str, items: Iterable[str], indent: str = "") -> list[str]:
    return [f"{indent}{key}:"] + [f"{indent}- {_q(i)}" for i in items]


def card_metadata(f: CardFacts) -> dict[str, Any]:
    """The front matter as a dict (what ``huggingface_hub.ModelCard(text).data`` reads back)."""
    meta: dict[str, Any] = {
        "license": LICENSE,
        "language": ["en"],
        "library_name": "transformers",
        "pipeline_tag": "text-generation",
        "tags": list(dict.fromkeys([*TAGS, *f.extra_tags])),
    }
    if f.dataset and _HUB_ID.fullmatch(f.dataset):
        # Only Hub dataset ids: the Hub links each entry, and local text or a path has no page.
        meta["datasets"] = [f.dataset]
    # No ``base_model`` even when model.hub_id set the initial weights: the Hub checks it
    # against its models and may refuse a card naming a local path or a private repo (the
    # push then goes up without its card). The body and the dtrain block name it instead.
    facts = {
        "run_id": f.run_id,
        "epoch": f.epoch,
        "inner_step": f.inner_step,
        "tag": f.tag,
        "tokens_seen": f.tokens_seen,
        "last_loss": None if _loss(f) is None else round(_loss(f), 6),
        "contributors": f.contributors,
        "round_id": f.round_id,
        "preset": f.preset,
        "initial_weights": f.initial_weights,
        "parameters": f.param_count,
        "context_length": f.context_length,
        "tokenizer": f.tokenizer,
        "data": f.dataset or f.data_description,
        "dtrain_version": f.dtrain_version,
    }
    meta["dtrain"] = facts  # unknown facts stay null: absent would read as "not applicable"
    return meta


def _front_matter(meta: dict[str, Any]) -> str:
    lines = ["---"]
    for key, value in meta.items():
        if isinstance(value, list):
            lines += _yaml_list(key, value)
        elif isinstance(value, dict):
            lines.append(f"{key}:")
            lines += [f"  {k}: {_q(v)}" for k, v in value.items()]
        else:
            lines.append(f"{key}: {_q(value)}")
    lines.append("---")
    return "\n".join(lines)


def _loss(f: CardFacts) -> float | None:
    """The last loss, or None when unknown or not a number (nothing was trained)."""
    if f.last_loss is None:
        return None
    v = float(f.last_loss)
    return v if math.isfinite(v) else None


def _fmt_int(n: int | None) -> str:
    return UNKNOWN if n is None else f"{int(n):,}"


def _fmt(value: Any) -> str:
    return UNKNOWN if value is None or value == "" else str(value)


def _data_line(f: CardFacts) -> str:
    if f.dataset:
        parts = [f"[{f.dataset}](https://huggingface.co/datasets/{f.dataset})"]
        if f.dataset_config:
            parts.append(f"config `{f.dataset_config}`")
        if f.dataset_revision:
            parts.append(f"revision `{f.dataset_revision}`")
        return ", ".join(parts)
    return f.data_description or UNKNOWN


def _load_snippet(f: CardFacts) -> str:
    if f.repo_id:
        where = f'repo, revision = {_q(f.repo_id)}, {_q(f.tag)}  # the tag pins this checkpoint'
        kw = ", revision=revision"
    else:
        path = f.local_path or "path/to/this/folder"
        where = f"repo = {_q(path)}  # this folder"
        kw = ""
    budget = "" if f.context_length is None else \
        f"\n# The context window is {f.context_length} tokens: prompt + new tokens must fit in it."
    return (
        "```python\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline\n\n"
        f"{where}\n"
        f"tokenizer = AutoTokenizer.from_pretrained(repo{kw})\n"
        f"model = AutoModelForCausalLM.from_pretrained(repo{kw})\n"
        f"{budget}\n"
        'inputs = tokenizer("The history of", return_tensors="pt")\n'
        "out = model.generate(**inputs, max_new_tokens=20, do_sample=True, top_p=0.9)\n"
        "print(tokenizer.decode(out[0], skip_special_tokens=True))\n\n"
        "# or\n"
        f'generate = pipeline("text-generation", model=repo{kw})\n'
        'print(generate("The history of", max_new_tokens=20)[0]["generated_text"])\n'
        "```"
    )


def _initial_weights_terms(f: CardFacts) -> str:
    if not f.initial_weights:
        return ""
    return (f" Training started from the weights of `{f.initial_weights}`, whose own licence also "
            "applies to this model: check it before relying on the MIT licence above.")


def render_model_card(f: CardFacts) -> str:
    """README.md for one pushed checkpoint: front matter, the facts, how to load it."""
    name = f.repo_id or f"dtrain run {f.run_id}"
    loss = UNKNOWN if _loss(f) is None else f"{_loss(f):.4f}"
    preset = _fmt(f.preset)
    if f.initial_weights:
        preset += f" (initial weights from {f.initial_weights})"
    rows = [
        ("Push tag", f"`{f.tag}`"),
        ("Run id", f"`{f.run_id}`"),
        ("Epoch (global optimizer steps of the swarm)", str(f.epoch)),
        ("Inner optimizer steps of this replica", str(f.inner_step)),
        ("Tokens seen by the pushing miner", _fmt_int(f.tokens_seen)),
        ("Tokens averaged in the last round (all contributors)", _fmt_int(f.round_tokens)),
        ("Last training loss (pushing miner, before this step)", loss),
        ("Contributing miners in the last round", _fmt_int(f.contributors)),
        ("Last round id", f"`{f.round_id}`" if f.round_id else UNKNOWN),
        ("Model preset", preset),
        ("Parameters", _fmt_int(f.param_count)),
        ("Context length (tokens)", _fmt_int(f.context_length)),
        ("Vocabulary size", _fmt_int(f.vocab_size)),
        ("Tokenizer", _fmt(f.tokenizer)),
        ("Training data", _data_line(f)),
        ("dtrain version", _fmt(f.dtrain_version)),
    ]
    table = "| | |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows)
    body = f"""
# {name} — {f.tag}

A GPT-2-style causal language model trained by the miners of Bittensor subnet 38 with
dtrain: each miner trains on its own data pages and all miners average their gradients
every round, so every replica takes the same optimizer step. Each tag of this repo pins
one checkpoint, named `{{run_id}}.{{epoch}}.{{inner_step}}`.

{table}

Facts not recorded with the checkpoint are shown as "{UNKNOWN}".

## How to load

{_load_snippet(f)}

## Limitations

This is a research checkpoint of a run in progress: it has not been evaluated, aligned or
filtered, and it will produce incorrect and possibly offensive text. The training data
keeps its own licence terms.{_initial_weights_terms(f)}
"""
    return _front_matter(card_metadata(f)) + "\n" + body
