"""The sandbox's fixed settings: its netuid and run id, and the config every neuron runs with
(tiny model, shipped text and tokenizer, loopback only); README.md, "What the sandbox shows"."""

from __future__ import annotations

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
SANDBOX_DILOCO_WARMUP = 2  # the ramp of the production default (a tenth of H), at least one ramped step


def neuron_config(root: Path, member: Member, total_miners: int, validators: int = 1,
                  mode: str = "gradient", batch_audit: float = 1.0, check: int | None = None) -> Config:
    """The config every sandbox neuron runs with: tiny model, shipped text, loopback only."""
    cfg = Config()
    cfg.wallet.name, cfg.wallet.hotkey, cfg.wallet.path = member.name, "default", str(layout.wallets_dir(root))
    cfg.chain.network, cfg.chain.netuid, cfg.chain.sandbox_dir = "sandbox", NETUID, str(root)
    cfg.node.role = member.role
    cfg.node.data_dir = str(layout.neuron_dir(root, member.name) / "data")
    cfg.model.preset, cfg.model.seq_len, cfg.model.run_id = "tiny", 128, RUN_ID
    # Small pages and a local batch of 16 of them: the validator's checks (one challenge
    # micro-batch, one audited page per miner) stay near a tenth of a miner's training.
    cfg.data.source, cfg.data.tokenizer, cfg.data.page_sequences = "local", "shipped", 4
    m = cfg.training
    m.micro_batch_size, m.local_batch_size = 4, 64
    m.lr, m.warmup_steps, m.total_steps, m.device, m.precision = 2e-3, 0, 1000, "cpu", "fp32"
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
    a.matchmaking_time, a.request_timeout, a.allreduce_timeout = 5.0, 3.0, 30.0
    # Many neurons on one machine reach matchmaking seconds apart; the group still forms as soon
    # as every expected miner is in, so a longer window costs nothing when they all come.
    a.matchmaking_time = max(a.matchmaking_time, 0.5 * total_miners)
    a.host_maddrs = ["/ip4/127.0.0.1/tcp/0"]
    if mode == "diloco":
        a.mode, a.diloco_inner_steps, a.diloco_snapshot_every = "diloco", SANDBOX_DILOCO_H, SANDBOX_SNAPSHOT_EVERY
        a.diloco_inner_warmup = SANDBOX_DILOCO_WARMUP
        m.local_batch_size = SANDBOX_DILOCO_BATCH
        # H local steps take longer than one local batch: a slot long enough for them.
        v.round_interval_s = max(v.round_interval_s, 6.0)
    cfg.hub.repo, cfg.hub.backoff_s = str(layout.store_dir(root)), 2.0
    cfg.api.host, cfg.api.port, cfg.api.metrics_port = "127.0.0.1", 0, 0
    cfg.dashboard.enabled = False
    return cfg
