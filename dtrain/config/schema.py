"""The configuration schema: one dataclass per TOML section, each field with its default,
documentation and validation rules in its metadata.

docs/configuration.md is generated from here (scripts/gen_config_docs.py). Standard library
only: this module is on the ``dtrain --help`` path.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any


def _f(default: Any, doc: str, *, min: float | None = None, max: float | None = None,
       choices: tuple[str, ...] | None = None, factory: bool = False, swarm: bool = False) -> Any:
    # ``swarm``: every peer of a run must use the same value (models, pages and optimizer
    # steps must agree, or verification and averaging silently go out of step). Such
    # settings are hashed into the swarm fingerprint (dtrain.neurons.runtime).
    meta = {"doc": doc, "min": min, "max": max, "choices": choices, "swarm": swarm}
    if factory:
        return field(default_factory=default, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class WalletConfig:
    name: str = _f("default", "Coldkey wallet name (btcli's --wallet.name).")
    hotkey: str = _f("default", "Hotkey name inside the wallet.")
    path: str = _f("~/.bittensor/wallets", "Directory that holds bittensor wallets.")


@dataclass
class ChainConfig:
    network: str = _f("finney", "finney, test, local, a ws:// or wss:// URL, or sandbox.")
    netuid: int = _f(38, "Subnet uid.", min=0, max=65535)
    sandbox_dir: str = _f("", "State directory of the embedded sandbox chain (network = sandbox).")


@dataclass
class NodeConfig:
    role: str = _f("miner", "What this machine runs (written by dtrain init).", choices=("miner", "validator"))
    data_dir: str = _f("~/.local/share/dtrain", "Where checkpoints, the peer identity and round records live.")
    log_format: str = _f("text", "Plain log format when the dashboard is off.", choices=("text", "json"))


@dataclass
class ModelConfig:
    preset: str = _f("gpt2-250m", "Model preset: tiny, gpt2-124m, gpt2-250m, gpt2-500m, gpt2-1b.",
                     choices=("tiny", "gpt2-124m", "gpt2-250m", "gpt2-500m", "gpt2-1b"), swarm=True)
    hub_id: str = _f("", "Load initial weights with from_pretrained from this Hub id (empty: fresh init).")
    revision: str = _f("", "Hub revision of hub_id (branch, tag or commit; empty: the default branch).",
                       swarm=True)
    run_id: str = _f("sn38", "Training run id; part of every push tag and of the data assignment.", swarm=True)
    seq_len: int = _f(1024, "Tokens per training sequence.", min=8, max=65536, swarm=True)


@dataclass
class DataConfig:
    source: str = _f("fineweb", "fineweb (read from the Hub) or local (text or parquet files).",
                     choices=("fineweb", "local"), swarm=True)
    dataset: str = _f("HuggingFaceFW/fineweb", "Hub dataset id for source = fineweb.", swarm=True)
    dataset_config: str = _f("sample-350BT", "Dataset configuration name.", swarm=True)
    dataset_revision: str = _f("", "Hub dataset revision (branch, tag or commit; empty: the default branch). "
                               "Pin a commit so every peer reads the same files.", swarm=True)
    local_path: str = _f("", "Text or parquet file, or a directory of *.txt or *.parquet files, for "
                         "source = local (empty: the shipped corpus).")
    tokenizer: str = _f("distilgpt2", "Tokenizer: a Hub id, a directory written by save_pretrained, or shipped "
                        "(the byte-level BPE shipped with dtrain; the sandbox uses it).", swarm=True)
    tokenizer_revision: str = _f("", "Hub revision of the tokenizer (branch, tag or commit; empty: the default "
                                 "branch). Pin a commit so every peer tokenises alike.", swarm=True)
    allow_tokenizer_fallback: bool = _f(False, "Train with the shipped byte-level BPE when the tokenizer can't be "
                                        "loaded. Off: a missing tokenizer stops the node (the sandbox always "
                                        "allows it); on a real network only a swarm that all falls back agrees.")
    page_sequences: int = _f(8, "Sequences per data page (the unit of data assignment).", min=1, max=4096,
                             swarm=True)


@dataclass
class TrainingConfig:
    """How a replica trains. Miners train with it and validators recompute with it, so the
    optimizer settings and the local batch are swarm-wide; device and precision are this
    machine's choice."""

    micro_batch_size: int = _f(8, "Sequences per forward/backward pass (a validator also asks miners for this "
                               "micro-batch size in Train queries).", min=1, max=65536)
    local_batch_size: int = _f(64, "Sequences per DiLoCo inner step. Gradient mode trains on until its round (up "
                               "to allreduce.target_batch_size); there this is the batch size the batch audit's "
                               "chance is counted in (docs/scoring.md).", min=1, max=1 << 24, swarm=True)
    optimizer: str = _f("adamw", "Inner optimizer.", choices=("adamw", "lamb"), swarm=True)
    lr: float = _f(3e-4, "Peak learning rate.", min=0.0, swarm=True)
    weight_decay: float = _f(0.1, "Decoupled weight decay.", min=0.0, swarm=True)
    warmup_steps: int = _f(100, "Linear warm-up steps.", min=0, swarm=True)
    total_steps: int = _f(100_000, "Cosine schedule length in optimizer steps.", min=1, swarm=True)
    grad_clip: float = _f(1.0, "Gradient norm clip (0 disables).", min=0.0, swarm=True)
    precision: str = _f("auto", "auto (bf16 on CUDA, fp32 on CPU), fp32 or bf16.", choices=("auto", "fp32", "bf16"))
    device: str = _f("auto", "auto, cpu, cuda or cuda:N.")


@dataclass
class MinerConfig:
    checkpoint_every: int = _f(1, "Save a checkpoint every N rounds (and always on a clean stop).", min=1)
    push_after_round: bool = _f(True, "Push the model to the store in the background after each round.")


@dataclass
class ValidatorConfig:
    miners_per_round: int = _f(8, "Miners this validator checks per round (Train query, state slice, work "
                               "audit). Every miner averages every round, checked or not (docs/protocol.md).",
                               min=1, max=4096)
    unchecked_audits: int = _f(2, "Members of each round's group this validator did not check whose committed "
                               "work it audits after the round, drawn then (docs/scoring.md, \"Sampled checks\").",
                               min=0, max=4096)
    pages_per_query: int = _f(2, "Data pages a Train query asks a miner to train on.", min=1, max=1024)
    audit_pages: int = _f(1, "Committed pages of each miner's round contribution the validator recomputes "
                          "(chosen after the miner committed; docs/scoring.md).", min=0, max=1024)
    batch_audit_probability: float = _f(0.25, "Chance per round and miner that the validator recomputes the "
                                        "miner's whole committed batch and checks what it sent against it under "
                                        "a seed drawn after the round (docs/protocol.md, \"Round audit\").",
                                        min=0.0, max=1.0)
    recompute_fraction: float = _f(0.5, "Fraction of reported micro-batches the validator recomputes.", min=0.0, max=1.0)
    round_interval_s: float = _f(60.0, "Rounds start at multiples of this many seconds of UNIX time and begin "
                                 "their all-reduce half-way through: a shared clock, so independent validators "
                                 "run rounds together. Every validator of a subnet must use the same value "
                                 "(docs/protocol.md).", min=0.0)
    ema_alpha: float = _f(0.1, "Weight of the newest score in the moving average (0 < alpha <= 1).",
                          min=0.0, max=1.0)
    weight_gradient: float = _f(0.30, "Share of the gradient score in the combined score.", min=0.0)
    weight_steps: float = _f(0.35, "Share of the steps score.", min=0.0)
    weight_bandwidth: float = _f(0.20, "Share of the bandwidth score.", min=0.0)
    weight_allreduce: float = _f(0.15, "Share of the all-reduce participation score.", min=0.0)
    slice_bytes: int = _f(4 << 20, "Bytes of model state downloaded for the bandwidth check.", min=1)


@dataclass
class AllReduceConfig:
    mode: str = _f("gradient", "gradient (average the gradient of every step) or diloco (take "
                   "diloco_inner_steps local steps, then average the pseudo-gradient and take one outer "
                   "Nesterov step; about H times fewer bytes per token).", choices=("gradient", "diloco"),
                   swarm=True)
    diloco_inner_steps: int = _f(500, "DiLoCo: local (inner) steps per round, H; a miner that has taken H waits "
                                 "for the round.", min=1, max=1_000_000, swarm=True)
    diloco_inner_warmup: int = _f(50, "DiLoCo: inner steps over which the inner learning rate ramps up after "
                                  "the optimizer moments were restarted (a resume or catch-up; not while the "
                                  "schedule's own warm-up runs, nor from moments carried over; 0: no ramp; "
                                  "docs/swarm.md \"DiLoCo\").", min=0, swarm=True)
    outer_lr: float = _f(0.7, "DiLoCo: learning rate of the outer Nesterov step.", min=0.0, swarm=True)
    outer_momentum: float = _f(0.7, "DiLoCo: momentum of the outer Nesterov step (0.7: docs/training.md, "
                               "\"What each mode costs\").", min=0.0, max=1.0, swarm=True)
    diloco_snapshot_every: int = _f(50, "DiLoCo: inner steps between the snapshots a miner keeps for validators' "
                                    "replays; bounds one audit's replay to this many steps.", min=1, swarm=True)
    protocol: str = _f("hivemind", "How a round is run: hivemind (its matchmaking and averager, the default) or dtrain "
                       "(the validator announces the round, signs its membership after a declaration window of "
                       "matchmaking_time seconds, and the members average with exactly that group on dtrain's own "
                       "butterfly; docs/protocol.md, \"The announced round\"). Swarm-wide.",
                       choices=("hivemind", "dtrain"), swarm=True)
    target_batch_size: int = _f(32768, "The swarm's target global batch, in sequences. Gradient mode: a miner "
                                "trains continuously until its round, up to this many, and a contribution weighs "
                                "at most this much; the progress display counts toward it (docs/training.md, "
                                "\"The global batch\").", min=1, max=1 << 24, swarm=True)
    min_group_size: int = _f(2, "Smallest group an all-reduce round accepts.", min=1, max=4096)
    target_group_size: int = _f(256, "Largest group matchmaking assembles: at least the subnet's miners, so "
                                "every miner averages in the one group its validators witness (docs/swarm.md).",
                                min=1, max=4096)
    matchmaking_time: float = _f(15.0, "Seconds to gather a group.", min=0.1)
    request_timeout: float = _f(5.0, "Seconds to wait for a matchmaking reply.", min=0.1)
    allreduce_timeout: float = _f(120.0, "Seconds before a slow peer is banned from the round.", min=0.1)
    compression: str = _f("none", "Wire compression: none, fp16, or 8bit (dtrain's blockwise codec: 0.27 of fp32, "
                          "relative error at most 0.031 for any gradient; docs/swarm.md, \"Wire compression\"). "
                          "Swarm-wide: each peer checks the others' parts with its own codec's tolerance.",
                          choices=("none", "fp16", "8bit"), swarm=True)
    aggregation: str = _f("centered_clip", "How a reducer combines the senders' parts: centered_clip (bounds an "
                          "undetected bad contribution; docs/swarm.md) or mean.",
                          choices=("centered_clip", "mean"), swarm=True)
    initial_peers: list = _f(list, "Extra hivemind multiaddrs to bootstrap from (chain commitments are used too).", factory=True)
    host_maddrs: list = _f(lambda: ["/ip4/0.0.0.0/tcp/0"], "Multiaddrs hivemind listens on.", factory=True)
    announce_maddrs: list = _f(list, "Multiaddrs announced to peers (set your public IP here).", factory=True)


@dataclass
class HubConfig:
    repo: str = _f("", "Model store: hf://owner/repo, or a local directory. Empty disables pushes.")
    push_retries: int = _f(5, "Upload attempts before giving up until the next round.", min=1, max=100)
    backoff_s: float = _f(2.0, "First retry delay; doubles each attempt.", min=0.0)


@dataclass
class ApiConfig:
    host: str = _f("0.0.0.0", "Address the miner API listens on.")
    port: int = _f(8091, "Port the miner API listens on (0 picks a free port; the committed address follows it).",
                   min=0, max=65535)
    external_address: str = _f("", "host:port committed on chain (empty: host:port above).")
    max_body_bytes: int = _f(1 << 20, "Largest request body accepted.", min=1)
    metrics_port: int = _f(9092, "Validator's Prometheus /metrics port (miners serve /metrics on the API port); "
                           "0 disables it.", min=0, max=65535)


@dataclass
class DashboardConfig:
    enabled: bool = _f(True, "Show the live dashboard on a terminal (plain logs otherwise).")
    refresh_hz: float = _f(4.0, "Dashboard refreshes per second.", min=0.1, max=60.0)


@dataclass
class Config:
    wallet: WalletConfig = field(default_factory=WalletConfig)
    chain: ChainConfig = field(default_factory=ChainConfig)
    node: NodeConfig = field(default_factory=NodeConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    miner: MinerConfig = field(default_factory=MinerConfig)
    validator: ValidatorConfig = field(default_factory=ValidatorConfig)
    allreduce: AllReduceConfig = field(default_factory=AllReduceConfig)
    hub: HubConfig = field(default_factory=HubConfig)
    api: ApiConfig = field(default_factory=ApiConfig)
    dashboard: DashboardConfig = field(default_factory=DashboardConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)


# With ``from __future__ import annotations`` field types are strings; resolve them once.
SECTIONS: dict[str, type] = typing.get_type_hints(Config)

# Keys no longer accepted, so an old file gets "moved to X" or "removed" instead of "unknown key"
# (docs/configuration.md, "Moved and removed keys").
MOVED_KEYS = {f"miner.{key}": f"training.{key}" for key in (
    "micro_batch_size", "local_batch_size", "optimizer", "lr", "weight_decay", "warmup_steps", "total_steps",
    "grad_clip", "precision", "device")}
# dotted key -> why it was removed
REMOVED_KEYS: dict[str, str] = {}


def section_fields(section: str) -> dict[str, tuple[type, dataclasses.Field]]:
    cls = SECTIONS[section]
    hints = typing.get_type_hints(cls)
    return {f.name: (hints[f.name], f) for f in dataclasses.fields(cls)}


def env_name(section: str, key: str) -> str:
    return f"DTRAIN_{section.upper()}_{key.upper()}"


def retired_reason(section: str, key: str) -> str | None:
    """Why ``section.key`` is no longer accepted, or None when it never existed."""
    dotted = f"{section}.{key}"
    if dotted in MOVED_KEYS:
        new_section, new_key = MOVED_KEYS[dotted].split(".")
        return (f"this key moved to [{new_section}] {new_key} (env {env_name(new_section, new_key)}); "
                "move it there")
    if dotted in REMOVED_KEYS:
        return f"this key was removed: {REMOVED_KEYS[dotted]}; delete it"
    return None


def swarm_settings(cfg: "Config") -> dict[str, Any]:
    """Every swarm-wide setting (``swarm=True`` in the schema), keyed ``section.key``."""
    out: dict[str, Any] = {}
    for section in SECTIONS:
        for key, (_typ, fld) in section_fields(section).items():
            if fld.metadata.get("swarm"):
                out[f"{section}.{key}"] = getattr(getattr(cfg, section), key)
    return out
