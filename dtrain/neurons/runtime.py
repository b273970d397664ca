"""Turn a :class:`~dtrain.config.Config` into the running parts a neuron needs.

Miners and validators must build *the same* model, tokenizer and data pages, or
verification cannot work; keeping that construction in one place is the point of
this module.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtrain.config import Config, expand

log = logging.getLogger("dtrain.neuron")

# data.tokenizer value that selects the shipped byte-level BPE without trying the Hub.
SHIPPED_TOKENIZER = "shipped"


def no_progress_monitor_thread() -> None:
    """Stop tqdm from starting its monitor thread in this process.

    The Hub and datasets clients draw tqdm bars (uploads, downloads, file loads); each bar
    class starts a monitor thread on its first bar and another whenever the last one died, so
    a neuron's thread count wandered over the weeks. A neuron has no terminal for those bars
    to redraw, so the monitor has nothing to do.
    """
    from tqdm import tqdm

    tqdm.monitor_interval = 0


class NeuronError(Exception):
    """A problem that stops a neuron, with a message that says what to do."""


@dataclass
class Workbench:
    """Model, tokenizer, data pages, trainer and training mode of one neuron."""

    model: Any
    trainer: Any  # the shared replica (mode.trainer): rounds average into it, checkpoints hold it
    reader: Any
    tokenizer_info: Any
    fingerprint: str  # the model's architecture and shapes (checkpoints are checked against it)
    swarm_fingerprint: str  # the model fingerprint plus every swarm-wide setting (the swarm's identity)
    run_id: str
    param_count: int
    mode: Any  # dtrain.modes.Mode: what is trained, contributed, applied and audited (allreduce.mode)


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


def is_production(cfg: Config) -> bool:
    """Every network but the sandbox: there nothing may be guessed, because a guess (another
    tokenizer, another model) makes this peer train something the swarm does not."""
    return cfg.chain.network != "sandbox"


def load_tokenizer_for(cfg: Config):
    """The configured tokenizer, or a TokenizerLoadError saying what is missing and how to get it.

    The shipped BPE stands in for an unavailable tokenizer only on the sandbox network or
    when ``data.allow_tokenizer_fallback`` is set; on a production network that opt-in is
    honoured with a loud warning, since every peer of a swarm must share one tokenizer.
    """
    from dtrain.training import hub_access
    from dtrain.training.tokenizer import load_shipped_tokenizer, load_tokenizer

    if cfg.data.tokenizer == SHIPPED_TOKENIZER:
        return load_shipped_tokenizer(SHIPPED_TOKENIZER)
    production = is_production(cfg)
    allow = cfg.data.allow_tokenizer_fallback or not production
    tok, info = load_tokenizer(cfg.data.tokenizer, allow_fallback=allow, local_files_only=hub_access.offline_mode(),
                               revision=cfg.data.tokenizer_revision or None, key="data.tokenizer",
                               revision_key="data.tokenizer_revision")
    if info.is_fallback and production:
        log.warning(
            "TOKENIZER FALLBACK on network %s: %r could not be loaded, so this node trains with %s (%d tokens) "
            "because data.allow_tokenizer_fallback = true. Its model matches only peers that fell back too: a "
            "swarm on %r reports this node as WRONG_MODEL every round. Make %r available (see the error above) "
            "and set data.allow_tokenizer_fallback = false.",
            cfg.chain.network, info.requested, info.name, info.vocab_size, info.requested, info.requested)
    return tok, info


def check_tokenizer_fits(model, tokenizer_info) -> None:
    """A model whose embedding is smaller than the vocabulary would index past it on the
    first page with a high token id (a device-side assert on CUDA); say so at start."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(vocab, int) and vocab < tokenizer_info.vocab_size:
        raise NeuronError(
            f"the model has {vocab} token embeddings but tokenizer {getattr(tokenizer_info, 'name', '')!r} has "
            f"{tokenizer_info.vocab_size} tokens; set data.tokenizer to the tokenizer the model was trained with")


def data_source_for(cfg: Config):
    from dtrain.training.data import DataSource

    if cfg.data.source == "fineweb":
        return DataSource(path=cfg.data.dataset, name=cfg.data.dataset_config or None,
                          revision=cfg.data.dataset_revision or None)
    if not cfg.data.local_path:
        return DataSource.shipped()
    root = expand(cfg.data.local_path)
    if root.is_dir():
        parquet = sorted(str(p) for p in root.glob("*.parquet"))
        text = sorted(str(p) for p in root.glob("*.txt"))
        if parquet and text:
            # one directory, one format: mixing them would make shard order a guess
            raise NeuronError(f"data.local_path {root} holds both *.parquet and *.txt files; "
                              "point it at a directory (or file) of one kind")
        if parquet:
            return DataSource.local_parquet(parquet)
        if not text:
            raise NeuronError(f"data.local_path {root} holds no *.txt or *.parquet files")
        return DataSource.local_text(text)
    if not root.is_file():
        raise NeuronError(f"data.local_path {root} does not exist")
    if root.suffix.lower() == ".parquet":
        return DataSource.local_parquet([str(root)])
    return DataSource.local_text([str(root)])


# Start-up input retries (tokenizer, Hub model, data): waits double from 2 s up to a minute,
# and go on while the failure is transient. A restarted miner is still committed on chain
# from its last run, so giving up would take a registered miner offline over a Hub hiccup.
# Ctrl-C ends them.
RETRY_FOREVER = 1 << 30


def retry_data(fn, *, stop, on_retry=None, base_delay: float = 2.0, max_delay: float = 60.0):
    """``(True, fn())`` once ``fn`` succeeds; ``(False, None)`` when ``stop`` was set while waiting.

    Transient training-input errors (a DataSourceError, or a tokenizer or Hub model load that
    failed because the Hub was unreachable: timeouts, refused connections, HTTP 5xx/429) are retried with
    exponential backoff and jitter (dtrain.retry) while ``stop`` is not set, the waits
    themselves ending early on ``stop``; ``on_retry(error, failures, wait)`` reports each.
    A permanent failure (no such dataset, model, file or text field) propagates at once.
    """
    from dtrain.retry import RetryPolicy, retry
    from dtrain.training.errors import TrainingError

    class _Stopped(Exception):
        pass

    def attempt():
        if stop.is_set():
            raise _Stopped
        return fn()

    policy = RetryPolicy(attempts=RETRY_FOREVER, base_delay=base_delay, max_delay=max_delay, jitter=0.5)
    try:
        result, _ = retry(attempt, policy=policy, on_retry=on_retry, sleep=stop.wait,
                          retryable=lambda exc: isinstance(exc, TrainingError) and exc.transient)
    except _Stopped:
        return False, None
    return True, result


def build_model(cfg: Config, tokenizer_info, *, n_positions: int | None = None):
    """The configured model with its initial weights: the Hub checkpoint named by
    ``model.hub_id``, else the preset initialised from a seed derived from the run id."""
    from dtrain.training.models import create_model, load_pretrained_model

    if cfg.model.hub_id:
        from dtrain.training import hub_access

        # No preset stands in for a missing Hub model on any network: a different model
        # than the swarm's gets every gradient rejected. The error says how to get it.
        model = load_pretrained_model(cfg.model.hub_id, revision=cfg.model.revision or None,
                                      local_files_only=hub_access.offline_mode(), key="model.hub_id",
                                      revision_key="model.revision")
        check_tokenizer_fits(model, tokenizer_info)
        return model
    # Every peer initialises from the same seed, so a fresh swarm starts from identical
    # weights without downloading anything.
    seed = int.from_bytes(cfg.model.run_id.encode()[:8].ljust(8, b"\0"), "little") % (2**31)
    return create_model(cfg.model.preset, vocab_size=tokenizer_info.vocab_size,
                        eos_token_id=tokenizer_info.eos_token_id,
                        n_positions=n_positions or max(cfg.model.seq_len, 1), seed=seed)


def build_workbench(cfg: Config, *, n_positions: int | None = None, fused: bool | None = None,
                    modes=None) -> Workbench:
    """Model + tokenizer + page reader + training mode, identical on every honest peer.

    ``n_positions`` overrides the architecture, ``fused`` the local AdamW kernel, ``modes``
    the mode classes (dtrain.modes.build_mode): only the cheating miners of
    dtrain.sandbox.adversary use them.
    """
    from dtrain.modes import UnknownMode, build_mode
    from dtrain.training.data import PageReader, PageSpec
    from dtrain.training.models import count_parameters, model_fingerprint

    tokenizer, info = load_tokenizer_for(cfg)  # warns itself when it falls back
    model = build_model(cfg, info, n_positions=n_positions)
    device = resolve_device(cfg)
    reader = PageReader(data_source_for(cfg), tokenizer, PageSpec(seq_len=cfg.model.seq_len,
                                                                   page_sequences=cfg.data.page_sequences))
    try:
        mode = build_mode(cfg, model, device, reader, fused=fused, modes=modes)
    except UnknownMode as exc:
        raise NeuronError(str(exc)) from None
    trainer = mode.trainer
    model_fp = model_fingerprint(trainer.model)
    return Workbench(model=trainer.model, trainer=trainer, mode=mode, reader=reader, tokenizer_info=info,
                     fingerprint=model_fp,
                     swarm_fingerprint=swarm_fingerprint(cfg, model_fp, tokenizer_digest=info.digest),
                     run_id=cfg.model.run_id, param_count=count_parameters(trainer.model))


def swarm_fingerprint(cfg: Config, model_fingerprint: str, *, tokenizer_digest: str = "") -> str:
    """What peers of one swarm must share, as one hash: the model fingerprint, every setting
    marked swarm-wide in the config schema, and the protocol constants that decide pages and
    gradient sketches.

    ``tokenizer_digest`` (TokenizerInfo.digest) is the tokenizer's content: two tokenizers of
    one size but other merges give the same model fingerprint yet other token ids per page.

    It is the fingerprint peers match on in the all-reduce, so a peer whose swarm-wide
    settings differ is reported WRONG_MODEL instead of averaging gradients that were computed
    on other pages or will be applied with another learning rate.
    """
    import hashlib
    import json

    from dtrain.config import swarm_settings
    from dtrain.training.data import ASSIGNMENT_VERSION, MAX_UIDS
    from dtrain.sketch import SKETCH_VERSION

    settings = swarm_settings(cfg)
    # The wire codec is checked at group formation, by name (the gather's ``wire``): a peer on
    # another codec is told which one, instead of a bare "another model".
    settings.pop("allreduce.compression", None)
    if not cfg.model.hub_id:
        settings.pop("model.revision", None)  # read only with model.hub_id; a stale value must not split a swarm
    if cfg.data.source != "fineweb":
        # the Hub dataset names are not read for local text; a stale value must not split a swarm
        settings.pop("data.dataset", None)
        settings.pop("data.dataset_config", None)
        settings.pop("data.dataset_revision", None)
        # local files have no revision: their names and sizes tell peers on other data apart
        settings["data.files"] = _local_data_identity(cfg)
    doc = {"format": "dtrain-swarm/1", "model": model_fingerprint, "settings": settings, "max_uids": MAX_UIDS,
           "pages": ASSIGNMENT_VERSION, "sketch": SKETCH_VERSION}
    if tokenizer_digest:
        doc["tokenizer"] = tokenizer_digest
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def _local_data_identity(cfg: Config):
    try:
        return data_source_for(cfg).identity()
    except NeuronError as exc:  # no such path: the neuron stops on it before it joins a swarm
        return str(exc)


def averaging_config(cfg: Config, log_path: Path | None):
    # one mapping of [allreduce] onto the swarm's settings, owned by the swarm (its defaults are the schema's)
    from dtrain.swarm.averaging.settings import settings_from

    return settings_from(cfg, log_path)


def announced_rounds(cfg: Config, node, templates, bench, chain, *, wallet=None, log_path: Path | None = None,
                     checks_type: type | None = None):
    """The neuron's rounds on dtrain's own protocol (allreduce.protocol = dtrain): a transport on
    ``node``'s DHT, whose memberships it accepts when a validator of ``chain`` signed them
    (``wallet``: this validator's, to announce with), and the :class:`ModelRounds` of ``templates``.
    ``checks_type``: the class of each round's checks (None: the honest CommittedChecks).
    Returns (transport, model rounds); the caller shuts the transport down."""
    from dtrain.chain.permits import ValidatorPermits
    from dtrain.swarm.commitments import CommittedChecks
    from dtrain.swarm.model_rounds import ModelRounds
    from dtrain.swarm.round import Rounds, RoundSettings
    from dtrain.swarm.transport import Transport

    a = cfg.allreduce
    transport = Transport(node.dht, prefix=f"dtrain-{cfg.model.run_id}").start()
    try:
        rounds = Rounds(transport, may_announce=ValidatorPermits(chain, refresh_s=30.0), wallet=wallet)
        # the window is the matchmaking window of the hivemind protocol: what the slot leaves for declarations
        settings = RoundSettings(window_s=a.matchmaking_time, sender_timeout_s=a.allreduce_timeout,
                                 reducer_timeout_s=a.allreduce_timeout)
        model_rounds = ModelRounds(rounds, templates, bench.swarm_fingerprint, report_type=bench.mode.report_type,
                                   mode=bench.mode.name, compression=a.compression,
                                   robust=a.aggregation == "centered_clip", settings=settings, log_path=log_path,
                                   checks_type=checks_type or CommittedChecks)
    except BaseException:
        transport.shutdown()
        raise
    return transport, model_rounds


def swarm_node_config(cfg: Config, data_dir: Path, initial_peers: list[str]):
    from dtrain.swarm.node import SwarmNodeConfig
    from dtrain.swarm.reachability import AddressError, fixed_port_host_maddrs

    peers = list(dict.fromkeys([*cfg.allreduce.initial_peers, *initial_peers]))
    host_maddrs = list(cfg.allreduce.host_maddrs)
    announce = list(cfg.allreduce.announce_maddrs)
    if announce:
        # An announced port is what peers dial: listening on a random one (tcp/0) next to it can
        # never work, so listen on the announced port instead (a router forwarding another
        # external port sets host_maddrs explicitly).
        try:
            fixed = fixed_port_host_maddrs(host_maddrs, announce)
        except AddressError as exc:
            raise NeuronError(f"allreduce: {exc}") from None
        if fixed is not None:
            log.info("listening on %s, the port announced in allreduce.announce_maddrs", ", ".join(fixed))
            host_maddrs = fixed
    return SwarmNodeConfig(data_dir=str(data_dir), initial_peers=peers, host_maddrs=host_maddrs,
                           announce_maddrs=announce, bootstrap_timeout_s=5.0)


def params_digest(trainer) -> str:
    """A short hash of the parameters: peers in sync have the same one."""
    import hashlib

    import torch

    flat = trainer.flat_parameters().detach().to("cpu", dtype=torch.float32).contiguous()
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]
