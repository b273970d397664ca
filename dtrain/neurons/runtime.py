"""Turn a :class:`~dtrain.config.Config` into the running parts a neuron needs.

Miners and validators must build *the same* model, tokenizer and data pages, or
verification cannot work; keeping that construction in one place is the point of
this module.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtrain.config import Config, expand

log = logging.getLogger("dtrain.neuron")

# data.tokenizer value that selects the shipped byte-level BPE without trying the Hub.
SHIPPED_TOKENIZER = "shipped"


class NeuronError(Exception):
    """A problem that stops a neuron, with a message that says what to do."""


@dataclass
class Workbench:
    """Model, tokenizer, data pages and trainer of one neuron."""

    model: Any
    trainer: Any
    reader: Any
    tokenizer_info: Any
    fingerprint: str  # the model's architecture and shapes (checkpoints are checked against it)
    swarm_fingerprint: str  # the model fingerprint plus every swarm-wide setting (the swarm's identity)
    run_id: str
    param_count: int


def node_dir(cfg: Config, role: str, hotkey: str) -> Path:
    """Per-neuron state directory: checkpoints, the hivemind identity, records."""
    path = expand(cfg.node.data_dir) / f"{role}-{hotkey[:12]}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def load_wallet(cfg: Config):
    """The bittensor wallet named by config; a clear error if its hotkey is missing."""
    from dtrain.wallets import check_wallet, create_command

    check = check_wallet(cfg.wallet.path, cfg.wallet.name, cfg.wallet.hotkey)
    if not check.hotkey_exists:
        raise NeuronError(
            f"hotkey {cfg.wallet.name}/{cfg.wallet.hotkey} not found under {cfg.wallet.path}; create it with: "
            + create_command(cfg.wallet.path, cfg.wallet.name, cfg.wallet.hotkey, coldkey_exists=check.coldkey_exists))
    import bittensor as bt

    wallet = bt.Wallet(name=cfg.wallet.name, hotkey=cfg.wallet.hotkey, path=cfg.wallet.path)
    try:
        wallet.hotkey  # noqa: B018 - decrypt/parse now, not in the middle of a round
    except Exception as exc:
        raise NeuronError(f"cannot read hotkey {cfg.wallet.name}/{cfg.wallet.hotkey}: {exc}") from exc
    return wallet


def open_chain_for(cfg: Config, wallet=None, hotkey: str | None = None):
    from dtrain.chain.factory import open_chain

    sandbox_dir = cfg.chain.sandbox_dir or None
    if cfg.chain.network == "sandbox" and not sandbox_dir:
        raise NeuronError("network 'sandbox' needs chain.sandbox_dir (or --sandbox-dir)")
    return open_chain(cfg.chain.network, cfg.chain.netuid, wallet=wallet, hotkey=hotkey,
                      sandbox_dir=expand(sandbox_dir) if sandbox_dir else None)


def resolve_device(cfg: Config) -> str:
    import torch

    if cfg.training.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if cfg.training.device.startswith("cuda") and not torch.cuda.is_available():
        raise NeuronError(f"training.device is {cfg.training.device!r} but no CUDA device is available")
    return cfg.training.device


def load_tokenizer_for(cfg: Config):
    from dtrain.training.tokenizer import load_fallback_tokenizer, load_tokenizer

    if cfg.data.tokenizer == SHIPPED_TOKENIZER:
        from dtrain.training.assets import FALLBACK_TOKENIZER_NAME
        from dtrain.training.tokenizer import TokenizerInfo

        tok = load_fallback_tokenizer()
        info = TokenizerInfo(name=FALLBACK_TOKENIZER_NAME, requested=SHIPPED_TOKENIZER, is_fallback=False,
                             vocab_size=len(tok), eos_token_id=int(tok.eos_token_id))
        return tok, info
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
    return load_tokenizer(cfg.data.tokenizer, allow_fallback=cfg.data.allow_tokenizer_fallback,
                          local_files_only=offline)


def data_source_for(cfg: Config):
    from dtrain.training.data import DataSource

    if cfg.data.source == "fineweb":
        return DataSource(path=cfg.data.dataset, name=cfg.data.dataset_config or None)
    if not cfg.data.local_path:
        return DataSource.shipped()
    root = expand(cfg.data.local_path)
    if root.is_dir():
        files = sorted(str(p) for p in root.glob("*.txt"))
        if not files:
            raise NeuronError(f"data.local_path {root} holds no *.txt files")
        return DataSource.local_text(files)
    if not root.is_file():
        raise NeuronError(f"data.local_path {root} does not exist")
    return DataSource.local_text([str(root)])


def trainer_config(cfg: Config, device: str):
    from dtrain.training.trainer import TrainerConfig

    return TrainerConfig(
        micro_batch_size=cfg.training.micro_batch_size,
        local_batch_size=cfg.training.local_batch_size,
        optimizer=cfg.training.optimizer,
        lr=cfg.training.lr,
        weight_decay=cfg.training.weight_decay,
        warmup_steps=cfg.training.warmup_steps,
        total_steps=cfg.training.total_steps,
        grad_clip=cfg.training.grad_clip or None,
        precision=cfg.training.precision,
        device=device,
    )


def build_model(cfg: Config, tokenizer_info, *, n_positions: int | None = None):
    """The configured model with its initial weights: the Hub checkpoint named by
    ``model.hub_id``, else the preset initialised from a seed derived from the run id."""
    from dtrain.training.models import create_model, load_pretrained_model

    if cfg.model.hub_id:
        return load_pretrained_model(cfg.model.hub_id)
    # Every peer initialises from the same seed, so a fresh swarm starts from identical
    # weights without downloading anything.
    seed = int.from_bytes(cfg.model.run_id.encode()[:8].ljust(8, b"\0"), "little") % (2**31)
    return create_model(cfg.model.preset, vocab_size=tokenizer_info.vocab_size,
                        eos_token_id=tokenizer_info.eos_token_id,
                        n_positions=n_positions or max(cfg.model.seq_len, 1), seed=seed)


def build_workbench(cfg: Config, *, n_positions: int | None = None) -> Workbench:
    """Model + tokenizer + page reader + trainer, identical on every honest peer.

    ``n_positions`` overrides the architecture; only the wrong-model adversary uses it.
    """
    from dtrain.training.data import PageReader, PageSpec
    from dtrain.training.models import count_parameters, model_fingerprint
    from dtrain.training.trainer import Trainer

    tokenizer, info = load_tokenizer_for(cfg)
    if info.is_fallback:
        log.warning("tokenizer: %s (%s)", info.name, info.reason)
    model = build_model(cfg, info, n_positions=n_positions)
    device = resolve_device(cfg)
    trainer = Trainer(model, trainer_config(cfg, device))
    reader = PageReader(data_source_for(cfg), tokenizer, PageSpec(seq_len=cfg.model.seq_len,
                                                                   page_sequences=cfg.data.page_sequences))
    model_fp = model_fingerprint(trainer.model)
    return Workbench(model=trainer.model, trainer=trainer, reader=reader, tokenizer_info=info,
                     fingerprint=model_fp, swarm_fingerprint=swarm_fingerprint(cfg, model_fp), run_id=cfg.model.run_id,
                     param_count=count_parameters(trainer.model))


def swarm_fingerprint(cfg: Config, model_fingerprint: str) -> str:
    """What peers of one swarm must share, as one hash: the model fingerprint, every setting
    marked swarm-wide in the config schema, and the protocol constants that decide pages and
    gradient sketches.

    It is the fingerprint peers match on in the all-reduce, so a peer whose swarm-wide
    settings differ is reported WRONG_MODEL instead of averaging gradients that were computed
    on other pages or will be applied with another learning rate.
    """
    import hashlib
    import json

    from dtrain.config import swarm_settings
    from dtrain.training.data import ASSIGNMENT_VERSION, MAX_UIDS
    from dtrain.training.fingerprint import FINGERPRINT_VERSION

    settings = swarm_settings(cfg)
    if cfg.data.source != "fineweb":
        # the Hub dataset names are not read for local text; a stale value must not split a swarm
        settings.pop("data.dataset", None)
        settings.pop("data.dataset_config", None)
    doc = {"format": "dtrain-swarm/1", "model": model_fingerprint, "settings": settings, "max_uids": MAX_UIDS,
           "pages": ASSIGNMENT_VERSION, "sketch": FINGERPRINT_VERSION}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def averaging_config(cfg: Config, log_path: Path | None):
    from dtrain.neurons.deadlines import matchmaking_timeout_s
    from dtrain.swarm.averaging import AveragingConfig

    if cfg.allreduce.mode != "gradient":
        # Train verification compares a miner's gradients with the validator's replica, which
        # needs identical parameters between rounds; DiLoCo's local steps break that.
        raise NeuronError(
            f"allreduce.mode = {cfg.allreduce.mode!r} is available in the swarm library and "
            "benchmarks/convergence.py, but mine/validate support only 'gradient' so far: "
            "validators cannot verify miners whose replicas drift between rounds")

    a = cfg.allreduce
    return AveragingConfig(
        prefix=f"dtrain-{cfg.model.run_id}",
        min_group_size=a.min_group_size,
        target_group_size=a.target_group_size,
        min_matchmaking_time_s=a.matchmaking_time,
        request_timeout_s=a.request_timeout,
        allreduce_timeout_s=a.allreduce_timeout,
        sender_timeout_s=min(a.allreduce_timeout, max(5.0, a.allreduce_timeout / 4)),
        matchmaking_timeout_s=matchmaking_timeout_s(a),
        compression=a.compression,
        log_path=str(log_path) if log_path else None,
        # neurons always bind contributions to work (docs/protocol.md, "Work commitments")
        require_commitments=True,
        aggregation=a.aggregation,
    )


def swarm_node_config(cfg: Config, data_dir: Path, initial_peers: list[str]):
    from dtrain.swarm.node import NodeConfig

    peers = list(dict.fromkeys([*cfg.allreduce.initial_peers, *initial_peers]))
    return NodeConfig(data_dir=str(data_dir), initial_peers=peers, host_maddrs=list(cfg.allreduce.host_maddrs),
                      announce_maddrs=list(cfg.allreduce.announce_maddrs), bootstrap_timeout_s=5.0)


def params_digest(trainer) -> str:
    """A short hash of the parameters: peers in sync have the same one."""
    import hashlib

    import torch

    flat = trainer.flat_parameters().detach().to("cpu", dtype=torch.float32).contiguous()
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]
