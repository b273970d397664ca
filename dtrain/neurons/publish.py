"""From a checkpoint to a model-store push: find it, export it, tag it.

The store receives a complete Hugging Face model repo, so anyone can load a tag with the
Auto classes or ``pipeline("text-generation")`` from the folder (or Hub revision) alone:

    config.json, generation_config.json, model.safetensors   model.save_pretrained
    tokenizer.json, tokenizer_config.json, ...               tokenizer.save_pretrained
    README.md                                                the model card (dtrain.hub.model_card)

The full training checkpoint (optimizer, page counter) stays local. The miner's
background pusher and ``dtrain push`` both go through :func:`write_model_repo`, so the two
produce the same repo; ``dtrain push`` takes the tokenizer and the card's facts from what
the miner recorded next to its checkpoint (dtrain.training.checkpoint.save_publish_info).
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path
from typing import Any

from dtrain.config import Config, expand
from dtrain.neurons.runtime import NeuronError

log = logging.getLogger("dtrain.publish")

# transformers' generate() falls back to a total length of 20 tokens when nothing says
# otherwise; a model with a shorter context must say so or generation indexes past it.
_GENERATE_DEFAULT_MAX_LENGTH = 20
# Kept per-tag export folders of a miner: the newest, and the two before it, which the
# pusher's snapshot thread may still be copying (it copies the latest tag it was given; a
# folder removed under it costs only that superseded snapshot, reported in its status).
EXPORTS_KEPT = 3


def open_configured_store(cfg: Config, target: str | None = None):
    """The model store named by ``hub.repo`` (or ``target``), with the configured retries."""
    from dataclasses import replace

    from dtrain.hub.retry import HUB_RETRY
    from dtrain.hub.targets import open_store

    target = target or cfg.hub.repo
    if not target:
        raise NeuronError("no model store configured: set hub.repo (hf://owner/repo or a directory) or pass --repo")
    retry = replace(HUB_RETRY, attempts=cfg.hub.push_retries, base_delay=cfg.hub.backoff_s)
    try:
        return open_store(target, retry=retry) if target.startswith("hf://") else open_store(target)
    except ValueError as exc:
        raise NeuronError(f"hub.repo: {exc}") from None


def find_checkpoint(cfg: Config, explicit: Path | None = None) -> Path:
    """The checkpoint directory to push: ``explicit``, else the newest miner checkpoint under the data dir."""
    if explicit is not None:
        path = Path(explicit).expanduser()
        if not (path / "LATEST").is_file():
            raise NeuronError(f"{path} is not a dtrain checkpoint directory (no LATEST file)")
        return path
    root = expand(cfg.node.data_dir)
    found = sorted(root.glob("miner-*/checkpoints/LATEST"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise NeuronError(f"no miner checkpoint under {root}; run `dtrain mine` first or pass --checkpoint")
    return found[-1].parent


# ---------------------------------------------------------------------------- the model card's facts


def _finite(x: Any) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def data_facts(cfg: Config) -> dict[str, Any]:
    """What the card says about the training data (no operator paths: the card is public)."""
    d = cfg.data
    if d.source == "fineweb":
        return {"dataset": d.dataset, "dataset_config": d.dataset_config or None,
                "dataset_revision": getattr(d, "dataset_revision", "") or None}
    what = "the sample corpus shipped with dtrain" if not d.local_path else "the operator's own files, not published"
    return {"data_description": f"local text ({what})"}


def card_facts(cfg: Config, *, target: str, tag: str, run_id: str, epoch: int, inner_step: int,
               tokens_seen: int | None, model: Any, param_count: int | None, tokenizer_name: str | None,
               last_round: dict | None = None):
    """CardFacts from real state. ``last_round`` (see :func:`round_facts`) counts only if it
    led to this very epoch; otherwise the round facts are unknown."""
    from dtrain import __version__
    from dtrain.hub.model_card import CardFacts
    from dtrain.hub.tags import parse_tag

    parse_tag(tag)
    r = last_round if last_round and last_round.get("epoch") == epoch else {}
    where: dict[str, Any] = {}
    if target.startswith("hf://"):
        from dtrain.hub.hf import parse_hf_target

        where["repo_id"] = parse_hf_target(target)
    else:
        from dtrain.hub.local import LocalStore

        where["local_path"] = str(LocalStore(target).tags_dir / tag)
    mc = getattr(model, "config", None)
    tok_name = tokenizer_name
    revision = getattr(cfg.data, "tokenizer_revision", "")
    if tok_name and revision:
        tok_name = f"{tok_name} (revision {revision})"
    initial = cfg.model.hub_id or None
    if initial and getattr(cfg.model, "revision", ""):
        initial = f"{initial} (revision {cfg.model.revision})"
    return CardFacts(
        tag=tag, run_id=run_id, epoch=int(epoch), inner_step=int(inner_step), **where,
        tokens_seen=None if tokens_seen is None else int(tokens_seen),
        last_loss=_finite(r.get("loss")), contributors=r.get("contributors"), round_id=r.get("round_id") or None,
        round_tokens=r.get("round_tokens"), preset=cfg.model.preset, initial_weights=initial,
        param_count=param_count, context_length=getattr(mc, "n_positions", None),
        vocab_size=getattr(mc, "vocab_size", None), tokenizer=tok_name, dtrain_version=__version__,
        **data_facts(cfg),
    )


def round_facts(record: Any, metrics: Any, *, epoch: int, seq_len: int) -> dict[str, Any]:
    """What the card says about the round that produced ``epoch`` (a RoundRecord and the
    StepMetrics of the step it led to), as plain JSON-able values."""
    from dtrain.hub.model_card import contributors_of

    return {"epoch": int(epoch), "round_id": record.round_id or None, "contributors": contributors_of(record),
            "round_tokens": int(round(float(record.total_weight) * seq_len)),
            "loss": _finite(getattr(metrics, "loss", None))}


# ---------------------------------------------------------------------------- the repo


def _edit_json(path: Path, edit) -> None:
    doc = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    edit(doc)
    path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_model_repo(dest: str | Path, model: Any, tokenizer: Any, facts: Any) -> Path:
    """Write a complete Hugging Face model repo for ``model`` into ``dest`` (created if needed).

    The tokenizer files come from the tokenizer's own ``save_pretrained``; then a few
    settings that make the folder work on its own are fixed up in the written files
    (the live tokenizer and model are not touched: the miner keeps training with them):

    - ``model_max_length`` = the model's context, so truncation works (the shipped
      tokenizer says "unlimited");
    - a pad token (the end-of-text token, as GPT-2 repos do) where the tokenizer has none;
    - ``tokenizer_class`` "PreTrainedTokenizerFast" instead of transformers 5's internal
      "TokenizersBackend", which transformers 4 cannot resolve;
    - ``generation_config.json`` with eos and pad ids, so generate() neither warns nor
      guesses, and a total length within the context.
    """
    from dtrain.hub.model_card import render_model_card

    if tokenizer is None:
        raise NeuronError("cannot export a model repo without its tokenizer")
    eos_id = tokenizer.eos_token_id
    if eos_id is None:
        raise NeuronError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no end-of-text token")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    n_ctx = getattr(model.config, "n_positions", None)
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(dest))
    tokenizer.save_pretrained(str(dest))

    def fix_tokenizer(doc: dict) -> None:
        if n_ctx and (not isinstance(doc.get("model_max_length"), int) or doc["model_max_length"] > n_ctx):
            doc["model_max_length"] = int(n_ctx)
        if doc.get("pad_token") is None:
            doc["pad_token"] = tokenizer.eos_token
        if doc.get("tokenizer_class") == "TokenizersBackend":
            doc["tokenizer_class"] = "PreTrainedTokenizerFast"

    def fix_generation(doc: dict) -> None:
        # No longer a plain copy of config.json: transformers must take these values as given.
        doc["_from_model_config"] = False
        doc["eos_token_id"] = int(eos_id)
        doc["pad_token_id"] = int(pad_id)
        if n_ctx and n_ctx < _GENERATE_DEFAULT_MAX_LENGTH and "max_length" not in doc:
            doc["max_length"] = int(n_ctx)

    _edit_json(dest / "tokenizer_config.json", fix_tokenizer)
    _edit_json(dest / "generation_config.json", fix_generation)
    (dest / "README.md").write_text(render_model_card(facts), encoding="utf-8")
    return dest


def export_for_push(export_root: str | Path, tag: str, model: Any, tokenizer: Any, facts: Any,
                    *, keep: int = EXPORTS_KEPT) -> Path:
    """Write the repo for ``tag`` into its own folder ``export_root/<tag>`` and return it.

    The folder is written under a temp name and renamed complete, and never rewritten, so
    the pusher's snapshot of a tag can never pick up the next round's files. Older export
    folders are removed, keeping the newest ``keep`` (the previous one may still be being
    snapshotted).
    """
    import os

    from dtrain.atomic import publish_dir
    from dtrain.hub.tags import parse_tag

    parse_tag(tag)
    root = Path(export_root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / tag
    tmp = root / f".tmp-{tag}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    if not final.is_dir():
        try:
            write_model_repo(tmp, model, tokenizer, facts)
            publish_dir(tmp, final)  # a folder is never rewritten once it has its name
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    tags = []
    for p in root.iterdir():
        if p.name.startswith(".tmp-"):
            if p != tmp:
                shutil.rmtree(p, ignore_errors=True)  # a killed writer's leftovers
            continue
        try:
            parse_tag(p.name)
        except ValueError:  # TagError
            continue  # not ours: leave it
        tags.append(p.name)
    for name in sorted(tags, key=parse_tag)[:-keep or None]:
        if name != tag:
            shutil.rmtree(root / name, ignore_errors=True)
    return final


def _load_saved_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - any failure: rebuild from the config instead
        log.warning("tokenizer saved with the checkpoint in %s is unreadable (%s); rebuilding it from the config",
                    folder, exc)
        return None


def export_checkpoint(cfg: Config, checkpoint_dir: Path, dest: Path, *, target: str | None = None) -> str:
    """Write the checkpoint as a complete Hugging Face model repo into ``dest``; return its tag.

    The tokenizer is the one the miner saved with the checkpoint when there is one (no Hub
    needed), else the configured one. The card's facts come from the checkpoint and the
    miner's recorded round info; whatever was not recorded is "unknown".
    """
    from dtrain.hub.tags import format_tag
    from dtrain.neurons.runtime import build_model, load_tokenizer_for
    from dtrain.training.checkpoint import load_checkpoint, read_publish_info
    from dtrain.training.models import count_parameters

    state = load_checkpoint(checkpoint_dir)
    published = read_publish_info(checkpoint_dir)
    saved_facts: dict = published[1] if published else {}
    tokenizer = _load_saved_tokenizer(published[0]) if published and published[0] else None
    if tokenizer is not None:
        tok_name = saved_facts.get("tokenizer") or getattr(tokenizer, "name_or_path", None)
        info = _SizeInfo(vocab_size=len(tokenizer), eos_token_id=int(tokenizer.eos_token_id))
    else:
        tokenizer, info = load_tokenizer_for(cfg)
        tok_name = info.name
    model = build_model(cfg, info)
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as exc:
        raise NeuronError(f"checkpoint {checkpoint_dir} does not fit model preset {cfg.model.preset!r}: "
                          f"{str(exc).splitlines()[0]}") from None
    run_id, epoch = str(state["run_id"]), int(state["epoch"])
    counters = state.get("counters") or {}
    tag = format_tag(run_id, epoch, int(counters["inner_step"]))
    last_round = saved_facts.get("last_round") if isinstance(saved_facts.get("last_round"), dict) else None
    facts = card_facts(cfg, target=target or cfg.hub.repo, tag=tag, run_id=run_id, epoch=epoch,
                       inner_step=int(counters["inner_step"]), tokens_seen=counters.get("tokens"), model=model,
                       param_count=count_parameters(model), tokenizer_name=tok_name, last_round=last_round)
    write_model_repo(dest, model, tokenizer, facts)
    return tag


class _SizeInfo:
    """The two tokenizer facts build_model reads, for a tokenizer loaded from a checkpoint."""

    def __init__(self, vocab_size: int, eos_token_id: int) -> None:
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id


def push_after_round(miner) -> None:
    """Export ``miner``'s model (dtrain.neurons.miner.Miner) at its new epoch, with its model
    card's facts, and queue it for the background pusher; a failed export skips one push."""
    from dtrain.hub.tags import format_tag

    bench, counters = miner.bench, miner.trainer.counters
    tag = format_tag(bench.run_id, miner.epoch, counters.inner_step)
    try:
        facts = card_facts(miner.cfg, target=miner.cfg.hub.repo, tag=tag, run_id=bench.run_id, epoch=miner.epoch,
                           inner_step=counters.inner_step, tokens_seen=counters.tokens, model=bench.model,
                           param_count=bench.param_count, tokenizer_name=bench.tokenizer_info.name,
                           last_round=miner._card_round)
        with miner.model_lock:
            folder = export_for_push(miner.dir / "export", tag, bench.model, bench.reader.tokenizer, facts)
    except Exception as exc:  # noqa: BLE001 - a failed export skips one push, never the training
        miner.tel.event(f"export of {tag} for the model store failed: {exc!r}")
        return
    miner.pusher.enqueue(folder, tag)

