"""From a checkpoint to a model-store push: find it, export it, tag it.

The store receives a Hugging Face folder (``config.json`` + weights, via
``save_pretrained``), so anyone can ``from_pretrained`` a tag; the full training
checkpoint (optimizer, page counter) stays local.
"""

from __future__ import annotations

from pathlib import Path

from dtrain.config import Config, expand
from dtrain.neurons.runtime import NeuronError


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


def export_checkpoint(cfg: Config, checkpoint_dir: Path, dest: Path) -> str:
    """Write the checkpoint's model as a Hugging Face folder into ``dest``; return its tag."""
    from dtrain.hub.tags import format_tag
    from dtrain.neurons.runtime import build_model, load_tokenizer_for
    from dtrain.training.checkpoint import load_checkpoint

    state = load_checkpoint(checkpoint_dir)
    # The tokenizer is read only for the vocabulary size the model is built with.
    _, info = load_tokenizer_for(cfg)
    model = build_model(cfg, info)
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as exc:
        raise NeuronError(f"checkpoint {checkpoint_dir} does not fit model preset {cfg.model.preset!r}: "
                          f"{str(exc).splitlines()[0]}") from None
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(dest))
    return format_tag(str(state["run_id"]), int(state["epoch"]), int(state["counters"]["inner_step"]))
