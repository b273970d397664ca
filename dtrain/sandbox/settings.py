"""The sandbox's fixed settings: its netuid and run id, and the config every neuron runs with
(tiny model, shipped text and tokenizer, loopback only); README.md, "What the sandbox shows"."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dtrain.config import Config
from dtrain.sandbox import layout
from dtrain.sandbox.layout import Member

NETUID = 38
RUN_ID = "sandbox"


def validator_names(count: int) -> list[str]:
    """One validator keeps the plain name "validator"; several are validator1..N."""
    return ["validator"] if count == 1 else [f"validator{i}" for i in range(1, count + 1)]


# DiLoCo in the sandbox: H inner steps of a quarter-size local batch fit one round slot, and a
# snapshot every 4 steps keeps each validator's replay to at most 4 steps per miner.
SANDBOX_DILOCO_H, SANDBOX_DILOCO_BATCH, SANDBOX_SNAPSHOT_EVERY = 8, 16, 4
SANDBOX_TARGET_BATCHES = 16  # allreduce.target_batch_size, in local batches
SANDBOX_DILOCO_WARMUP = 2  # the ramp of the production default (a tenth of H), at least one ramped step


@dataclass(frozen=True)
class SandboxScale:
    """What a preset trains with in the sandbox, on CPU cores shared by every neuron: a step of
    a real-size model must take seconds, not minutes, and its first rounds must lower the loss."""

    seq_len: int
    micro_batch: int
    local_batch: int
    lr: float
    diloco_h: int
    diloco_batch: int
    snapshot_every: int
    allreduce_timeout: float  # a real-size part moves and is checked on a loaded CPU
    round_timeout_s: float  # how long the orchestrator waits for one validator round
    # Matchmaking window: at a real size the validator commits its own contribution for seconds
    # after its queries went out, and queried miners must still be looking when it comes.
    matchmaking_s: float = 5.0


# tiny: the sandbox's own model. The GPT-2 presets: short sequences and a one-page batch (one
# forward/backward of 4x64 tokens is ~1e11 FLOP at gpt2-124m, seconds on one core), a learning
# rate that falls with width (AdamW moves every weight by about lr a step), and DiLoCo rounds of
# 2 inner steps with one snapshot, the shape of production's H steps at a size a CPU finishes.
SANDBOX_SCALES: dict[str, SandboxScale] = {
    "tiny": SandboxScale(128, 4, 64, 2e-3, SANDBOX_DILOCO_H, SANDBOX_DILOCO_BATCH, SANDBOX_SNAPSHOT_EVERY, 30.0, 240.0),
    "gpt2-124m": SandboxScale(64, 4, 4, 6e-4, 2, 4, 2, 300.0, 900.0, 20.0),
    "gpt2-250m": SandboxScale(64, 4, 4, 4e-4, 2, 4, 2, 600.0, 1800.0, 40.0),
    "gpt2-500m": SandboxScale(64, 2, 4, 3e-4, 2, 4, 2, 900.0, 3600.0, 90.0),
    "gpt2-1b": SandboxScale(64, 2, 4, 2e-4, 2, 4, 2, 1800.0, 7200.0, 120.0),
}


def sandbox_scale(preset: str) -> SandboxScale:
    """The sandbox's settings for ``preset``; ValueError names the presets there are."""
    try:
        return SANDBOX_SCALES[preset]
    except KeyError:
        raise ValueError(f"expected one of {', '.join(SANDBOX_SCALES)}, found {preset!r}") from None


def neuron_config(root: Path, member: Member, total_miners: int, validators: int = 1,
                  mode: str = "gradient", batch_audit: float = 1.0, check: int | None = None,
                  model: str = "tiny", protocol: str = "hivemind") -> Config:
    """The config every sandbox neuron runs with: the ``model`` preset (tiny by default) at its
    sandbox scale, shipped text, loopback only."""
    scale = sandbox_scale(model)
    cfg = Config()
    cfg.wallet.name, cfg.wallet.hotkey, cfg.wallet.path = member.name, "default", str(layout.wallets_dir(root))
    cfg.chain.network, cfg.chain.netuid, cfg.chain.sandbox_dir = "sandbox", NETUID, str(root)
    cfg.node.role = member.role
    cfg.node.data_dir = str(layout.neuron_dir(root, member.name) / "data")
    cfg.model.preset, cfg.model.seq_len, cfg.model.run_id = model, scale.seq_len, RUN_ID
    # Small pages and a local batch of 16 of them: the validator's checks (one challenge
    # micro-batch, one audited page per miner) stay near a tenth of a miner's training.
    cfg.data.source, cfg.data.tokenizer, cfg.data.page_sequences = "local", "shipped", 4
    m = cfg.training
    m.micro_batch_size, m.local_batch_size = scale.micro_batch, scale.local_batch
    m.lr, m.warmup_steps, m.total_steps, m.device, m.precision = scale.lr, 0, 1000, "cpu", "fp32"
    v = cfg.validator
    # Each validator checks ``check`` miners a round (all by default) and audits as many
    # unchecked ones' committed work after it; every miner averages every round either way.
    v.miners_per_round = max(1, min(check or total_miners, total_miners))
    v.unchecked_audits = max(0, min(v.miners_per_round, total_miners - v.miners_per_round))
    v.pages_per_query, v.recompute_fraction = 1, 0.5
    v.round_interval_s, v.ema_alpha, v.slice_bytes = 2.0, 0.5, 1 << 20
    v.batch_audit_probability = batch_audit
    if validators > 1:
        # Several validators meet in one all-reduce by starting it half-way through a shared
        # slot (docs/protocol.md): the slot must outlast their checks, or the faster one's
        # round runs first and the slower one only catches up.
        v.round_interval_s = 8.0
    a = cfg.allreduce
    a.min_group_size, a.target_group_size = 2, 64
    a.matchmaking_time, a.request_timeout, a.allreduce_timeout = scale.matchmaking_s, 3.0, scale.allreduce_timeout
    # Many neurons on one machine reach matchmaking seconds apart (miners run at a lower CPU
    # priority than the validator, orchestrator.MINER_NICENESS); the group still forms as soon
    # as every expected miner is in, so a longer window costs nothing when they all come.
    a.matchmaking_time = max(a.matchmaking_time, 1.0 * total_miners)
    a.host_maddrs = ["/ip4/127.0.0.1/tcp/0"]
    a.protocol = protocol
    if mode == "diloco":
        a.mode, a.diloco_inner_steps, a.diloco_snapshot_every = "diloco", scale.diloco_h, scale.snapshot_every
        a.diloco_inner_warmup = min(SANDBOX_DILOCO_WARMUP, scale.diloco_h - 1)
        m.local_batch_size = scale.diloco_batch
        # H local steps take longer than one local batch: a slot long enough for them.
        v.round_interval_s = max(v.round_interval_s, 6.0)
    # Gradient mode trains continuously up to the target global batch: 16 local batches, more
    # than a sandbox miner trains in a slot, so a faster miner brings (and is paid for) more.
    a.target_batch_size = SANDBOX_TARGET_BATCHES * scale.local_batch
    if validators > 1 and mode == "gradient":
        # Validators that score different rounds (each may average its own epochs on one
        # machine) agree on weights only while a round's credit varies little: one local batch.
        a.target_batch_size = scale.local_batch
    cfg.hub.repo, cfg.hub.backoff_s = str(layout.store_dir(root)), 2.0
    cfg.api.host, cfg.api.port, cfg.api.metrics_port = "127.0.0.1", 0, 0
    cfg.dashboard.enabled = False
    return cfg
