"""``dtrain sandbox``: a whole subnet on this machine.

It creates the embedded chain, real sr25519 wallets, one or more validators and the
miners, each a separate ``dtrain mine`` / ``dtrain validate`` process on loopback with
the tiny model and the shipped text. The validators are independent, as on the live
subnet (no master): each runs ``rounds`` rounds, sets its own weights and exits; then
every miner is stopped with SIGINT (clean checkpoint, DHT left) and anything still
alive after a grace period is killed with its whole process group, so no p2pd daemon
outlives the sandbox.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from dtrain.config import Config, save_config
from dtrain.sandbox import layout
from dtrain.sandbox.layout import Member

NETUID = 38
RUN_ID = "sandbox"
VALIDATOR_STAKE = 1000.0
# How long a neuron gets to stop cleanly after SIGINT: a checkpoint, the pusher's drain and
# hivemind's own shutdown timeouts (averager 5 s, DHT 3 s), with room for a slow 2-core host.
GRACE_S = 60.0


@dataclass
class SandboxOptions:
    miners: int = 3
    rounds: int = 2
    validators: int = 1
    adversaries: list[str] = field(default_factory=list)
    mode: str = "gradient"  # allreduce.mode: gradient or diloco
    # validator.batch_audit_probability: the sandbox recomputes every miner's whole batch every
    # round (its model is tiny, and four rounds leave no room for odds); production's is 0.25
    batch_audit: float = 1.0
    directory: Path | None = None
    round_timeout_s: float = 240.0


@dataclass
class Child:
    member: Member
    process: subprocess.Popen
    log: Path


class SandboxError(Exception):
    pass


def validator_names(count: int) -> list[str]:
    """One validator keeps the plain name "validator"; several are validator1..N."""
    return ["validator"] if count == 1 else [f"validator{i}" for i in range(1, count + 1)]


# DiLoCo in the sandbox: H inner steps of a quarter-size local batch fit one round slot, and a
# snapshot every 4 steps keeps each validator's replay to at most 4 steps per miner.
SANDBOX_DILOCO_H, SANDBOX_DILOCO_BATCH, SANDBOX_SNAPSHOT_EVERY = 8, 16, 4
SANDBOX_DILOCO_WARMUP = 2  # the ramp of the production default (a tenth of H), at least one ramped step


def neuron_config(root: Path, member: Member, total_miners: int, validators: int = 1,
                  mode: str = "gradient", batch_audit: float = 1.0) -> Config:
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
    v.miners_per_round, v.pages_per_query, v.recompute_fraction = max(1, total_miners), 1, 0.5
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


def create_wallet(root: Path, name: str) -> str:
    """A fresh, unencrypted sandbox wallet (real sr25519 keys); returns the hotkey ss58."""
    import contextlib
    import io

    import bittensor as bt

    wallet = bt.Wallet(name=name, hotkey="default", path=str(layout.wallets_dir(root)))
    with contextlib.redirect_stdout(io.StringIO()):  # the SDK may print mnemonics; they are throwaway
        wallet.create_new_coldkey(use_password=False, suppress=True, overwrite=True)
        wallet.create_new_hotkey(use_password=False, suppress=True, overwrite=True)
    return wallet.hotkey.ss58_address


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DTRAIN_", "BT_"))}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               # Several neurons share the machine's cores; one thread each avoids thrashing.
               OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


class Sandbox:
    def __init__(self, options: SandboxOptions, *, on_event: Callable[[str], None] | None = None):
        self.options = options
        self.on_event = on_event or (lambda message: None)
        self.children: list[Child] = []
        self._temp: tempfile.TemporaryDirectory | None = None
        self._stopping = threading.Event()
        self.started_at = time.time()
        if options.directory is not None:
            self.root = Path(options.directory).expanduser().resolve()
        else:
            self._temp = tempfile.TemporaryDirectory(prefix="dtrain-sandbox-")
            self.root = Path(self._temp.name)

    # ------------------------------------------------------------------ setup

    def setup(self) -> list[Member]:
        from dtrain.chain import sandbox as chain_sandbox

        self.root.mkdir(parents=True, exist_ok=True)
        if layout.manifest_path(self.root).exists():
            raise SandboxError(f"{self.root} already holds a sandbox; choose an empty --dir or delete it")
        self.on_event(f"creating the sandbox chain in {self.root}")
        chain_sandbox.create(self.root, netuid=NETUID, block_time=1.0, weights_rate_limit=1)
        chain = chain_sandbox.SandboxChain(self.root, netuid=NETUID)
        specs = [(name, "validator", "validator") for name in validator_names(self.options.validators)]
        specs += [(f"miner{i}", "miner", "honest") for i in range(1, self.options.miners + 1)]
        specs += [(f"adv-{kind}-{i}", "miner", kind) for i, kind in enumerate(self.options.adversaries, 1)]
        members = []
        try:
            for name, role, kind in specs:
                hotkey = create_wallet(self.root, name)
                uid = chain.register(hotkey, stake=VALIDATOR_STAKE if role == "validator" else 0.0,
                                     validator_permit=role == "validator")
                members.append(Member(name=name, role=role, kind=kind, uid=uid, hotkey=hotkey))
        finally:
            chain.close()
        total_miners = sum(m.role == "miner" for m in members)
        for member in members:
            ndir = layout.neuron_dir(self.root, member.name)
            ndir.mkdir(parents=True, exist_ok=True)
            save_config(neuron_config(self.root, member, total_miners, self.options.validators, self.options.mode,
                                      self.options.batch_audit),
                        ndir / "config.toml", overwrite=True)
        layout.store_dir(self.root).mkdir(exist_ok=True)
        layout.write_manifest(self.root, members, {"rounds": self.options.rounds, "started_at": self.started_at,
                                                   "netuid": NETUID, "run_id": RUN_ID,
                                                   "validators": self.options.validators,
                                                   "mode": self.options.mode,
                                                   "diloco_inner_steps": SANDBOX_DILOCO_H})
        self.members = members
        count = self.options.validators
        self.on_event(f"registered {count} validator{'s' if count > 1 else ''} and {total_miners} miners with "
                      "real sr25519 hotkeys")
        return members

    # ------------------------------------------------------------------ processes

    def _spawn(self, member: Member, extra: list[str]) -> Child:
        ndir = layout.neuron_dir(self.root, member.name)
        log = ndir / "log.txt"
        command = "mine" if member.role == "miner" else "validate"
        argv = [sys.executable, "-m", "dtrain", command, "--config", str(ndir / "config.toml"),
                "--no-dashboard", *extra]
        if member.role == "miner" and member.kind != "honest":
            argv += ["--adversary", member.kind]
        with open(log, "ab") as fh:
            # Own session: the whole process group (the neuron, its hivemind workers and p2pd)
            # can be signalled and, if need be, killed together.
            process = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       env=child_env(), cwd=str(ndir), start_new_session=True)
        child = Child(member, process, log)
        self.children.append(child)
        return child

    def _wait_for_commitment(self, hotkey: str, timeout_s: float) -> bool:
        from dtrain.chain.sandbox import SandboxChain

        chain = SandboxChain(self.root, netuid=NETUID)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline and not self._stopping.is_set():
                if hotkey in chain.commitments():
                    return True
                if any(c.process.poll() is not None for c in self.children):
                    return False
                time.sleep(0.5)
        finally:
            chain.close()
        return False

    def _not_up(self, name: str, log: Path) -> SandboxError:
        """Why the sandbox could not start: the neuron that exited (any of them stops the
        wait, not only the one waited for), else the one that did not commit in time."""
        exited = next((c for c in self.children if c.process.poll() is not None), None)
        if exited is not None:
            return SandboxError(f"{exited.member.name} exited (code {exited.process.returncode}) before the "
                                f"sandbox was up: {_last_line(exited.log)!r}; see {exited.log}")
        return SandboxError(f"{name} did not come up; see {log}")

    def start(self) -> None:
        miners = [m for m in self.members if m.role == "miner"]
        validators = [m for m in self.members if m.role == "validator"]
        # The first miner starts alone; everyone else finds it (and each other) through
        # its chain commitment, exactly as on the real subnet: no bootstrap address is given.
        first = self._spawn(miners[0], [])
        self.on_event(f"started {miners[0].name} (uid {miners[0].uid}); waiting for its commitment")
        if not self._wait_for_commitment(miners[0].hotkey, 240):
            raise self._not_up(miners[0].name, first.log)
        for member in miners[1:]:
            self._spawn(member, [])
        # They start together and share the CPU: on a 2-core machine eight neurons took over
        # four minutes to import torch, hivemind and bittensor and commit. A neuron that dies
        # is noticed at once (_wait_for_commitment polls the processes), so this deadline is
        # only a hang guard and grows with the number starting at once.
        deadline = time.monotonic() + 240 + 60 * len(miners[1:])
        for member in miners[1:]:
            if not self._wait_for_commitment(member.hotkey, max(1.0, deadline - time.monotonic())):
                raise self._not_up(member.name, layout.neuron_dir(self.root, member.name) / "log.txt")
        self.on_event(f"all {len(miners)} miners committed; starting "
                      + ("the validator" if len(validators) == 1 else f"{len(validators)} validators"))
        for member in validators:
            self._spawn(member, ["--max-rounds", str(self.options.rounds)])

    def validator_children(self) -> list[Child]:
        return [c for c in self.children if c.member.role == "validator"]

    def validators_done(self) -> int | None:
        """None while a validator runs; then the first non-zero exit code, else 0."""
        codes = [c.process.poll() for c in self.validator_children()]
        if any(code is None for code in codes):
            return None
        return next((code for code in codes if code != 0), 0)

    def wait_for_validator(self) -> int:
        """Wait until every validator has run its rounds; return the first non-zero exit code, else 0."""
        # Validators that share the CPU (and the matchmaking window) take longer per round.
        deadline = (time.monotonic() + 120
                    + self.options.rounds * self.options.round_timeout_s * max(1, self.options.validators))
        while time.monotonic() < deadline and not self._stopping.is_set():
            code = self.validators_done()
            if code is not None:
                return code
            time.sleep(0.5)
        if self._stopping.is_set():
            return 130
        late = [c for c in self.validator_children() if c.process.poll() is None]
        raise SandboxError(f"{late[0].member.name} did not finish {self.options.rounds} rounds in time; "
                           f"see {late[0].log}")

    def stop_all(self) -> None:
        """SIGINT every neuron (clean shutdown), then kill whatever is left, group and all."""
        self._stopping.set()
        for child in self.children:
            if child.process.poll() is None:
                try:
                    # Only the neuron itself: it shuts its DHT and p2pd down in order. Signalling
                    # the whole group would kill p2pd under a neuron that is still leaving the DHT.
                    os.kill(child.process.pid, signal.SIGINT)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + GRACE_S
        for child in self.children:
            try:
                child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        # Exit codes before the final kill: 0 means the neuron stopped cleanly on SIGINT.
        self.exit_codes = {child.member.name: child.process.poll() for child in self.children}
        # A neuron that ignored SIGINT is killed below; say where it was stuck, for the report.
        views = {row["name"]: row for row in self.neuron_views()}
        self.stop_notes = {
            child.member.name: (f"still running {GRACE_S:g} s after SIGINT, killed; last state "
                                f"{views.get(child.member.name, {}).get('state')!r}, last log line: "
                                f"{_last_line(child.log)!r}")
            for child in self.children if child.process.poll() is None
        }
        for child in self.children:
            # Even a neuron that exited cleanly may have left a daemon in its group.
            try:
                os.killpg(child.process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            if child.process.poll() is None:
                child.process.wait(timeout=10)

    def cleanup(self) -> None:
        if self._temp is not None:
            self._temp.cleanup()

    # ------------------------------------------------------------------ live view + summary

    def neuron_views(self) -> list[dict]:
        files = layout.status_files(self.root)
        rows = []
        for member in self.members:
            doc = {}
            path = files.get(member.name)
            if path is not None:
                try:
                    doc = json.loads(path.read_text())
                except (OSError, ValueError):
                    doc = {}
            child = next((c for c in self.children if c.member.name == member.name), None)
            alive = child is not None and child.process.poll() is None
            rows.append({"name": member.name, "role": member.role, "kind": member.kind, "uid": member.uid,
                         "alive": alive, "state": doc.get("state", "starting" if alive else "not started"),
                         "epoch": doc.get("epoch"), "loss": doc.get("loss"), "peers": doc.get("peers_seen"),
                         "samples": doc.get("samples"), "events": (doc.get("events") or [])[-1:]})
        return rows

    def summary(self) -> dict:
        doc = build_summary(self.root, wall_s=time.time() - self.started_at)
        doc["exit_codes"] = getattr(self, "exit_codes", {})
        doc["stop_notes"] = getattr(self, "stop_notes", {})
        return doc


def _last_line(path: Path) -> str:
    """The last non-empty line of a neuron's log (its tail only: logs can be large)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 4096))
            lines = [line for line in fh.read().decode("utf-8", "replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1][-300:] if lines else ""


def _validator_view(member: Member, state: dict, chain_weights: dict[int, float]) -> dict:
    rounds = state.get("recent_rounds", []) if isinstance(state.get("recent_rounds"), list) else []
    return {"name": member.name, "uid": member.uid, "hotkey": member.hotkey,
            "round_counter": state.get("round_counter"),
            "statuses": [r.get("status") for r in rounds if isinstance(r, dict)],
            "weights": {str(uid): float(w) for uid, w in sorted(chain_weights.items())}}


def build_summary(root: Path, wall_s: float | None = None) -> dict:
    """The sandbox's outcome, from the validators' persisted state and the chain.

    The rounds and scores shown are the first validator's; every validator is listed under
    ``validators`` with the weights it set, and each miner's ``weight`` is the stake-weighted
    mean over validators (what the chain's consensus sees), with ``weights_by_validator``
    beside it and ``validator_spread`` (the largest per-miner difference) at the top.
    """
    from dtrain.chain.sandbox import SandboxChain

    manifest = layout.read_manifest(root) or {"members": []}
    members = [Member(**m) for m in manifest["members"]]
    validators = [m for m in members if m.role == "validator"]
    states: dict[str, dict] = {}
    for path in layout.validator_state_files(root):
        try:
            states.setdefault(path.parents[2].name, json.loads(path.read_text()))
        except (OSError, ValueError):
            pass
    state = states.get(validators[0].name, {}) if validators else {}
    rounds_raw = state.get("recent_rounds", [])
    by_uid = {m.uid: m for m in members}
    all_weights: dict[int, dict[int, float]] = {}
    try:
        chain = SandboxChain(root, netuid=NETUID)
        try:
            all_weights = chain.weights()
        finally:
            chain.close()
    except Exception:
        all_weights = {}
    weights_by_validator = {v.name: {int(k): float(w) for k, w in all_weights.get(v.uid, {}).items()}
                            for v in validators}
    rounds = []
    for r in rounds_raw:
        sent, received = r.get("bytes_sent"), r.get("bytes_received")
        rounds.append({"round": r.get("round"), "status": r.get("status"), "participants": r.get("participants", []),
                       "duration_s": r.get("duration_s"), "allreduce_s": r.get("allreduce_s"),
                       "bytes": sent + received if sent is not None and received is not None else None,
                       "epoch": r.get("epoch"),
                       "fraction_averaged": r.get("fraction_averaged"), "error": r.get("error", ""),
                       "loss_before": r.get("loss_before"), "loss_after": r.get("loss_after"),
                       "verify_s": r.get("verify_s"), "audit_s": r.get("audit_s"),
                       "train_query_s": r.get("train_query_s"),
                       "outcomes": {str(m["uid"]): m["outcome"] for m in r.get("miners", [])},
                       "notes": {str(m["uid"]): m.get("note", "") for m in r.get("miners", []) if m.get("note")}})
    last_scores = {int(k): v for k, v in state.get("last_scores", {}).items()}
    ema = {int(k): float(v) for k, v in state.get("ema", {}).items()}
    miners = []
    spread = 0.0
    for member in members:
        if member.role != "miner":
            continue
        s = last_scores.get(member.uid, {})
        # Sandbox validators all hold the same stake, so the consensus weight is the plain mean.
        per_validator = {name: w.get(member.uid, 0.0) for name, w in weights_by_validator.items()}
        values = list(per_validator.values())
        if len(values) > 1:
            spread = max(spread, max(values) - min(values))
        miners.append({"uid": member.uid, "name": member.name, "hotkey": member.hotkey, "kind": member.kind,
                       "score": ema.get(member.uid, 0.0),
                       "weight": sum(values) / len(values) if values else 0.0,
                       "weights_by_validator": per_validator,
                       "last_round": s.get("combined"), "outcome": s.get("outcome"), "gated": s.get("gated", []),
                       "components": {k: s.get(k) for k in ("gradient", "steps", "bandwidth", "participation")}})
    curve = []
    if rounds:
        curve.append(rounds[0]["loss_before"])
        curve += [r["loss_after"] for r in rounds]
    curve = [c for c in curve if isinstance(c, (int, float))]
    verify = sum(r.get("verify_s") or 0 for r in rounds)
    audit = sum(r.get("audit_s") or 0 for r in rounds)
    train = sum(r.get("train_query_s") or 0 for r in rounds)
    return {
        "dir": str(root), "wall_s": round(wall_s, 1) if wall_s is not None else None,
        "rounds": rounds, "miners": miners,
        "loss": {"start": curve[0] if curve else None, "end": curve[-1] if curve else None, "curve": curve},
        "verification": {"verify_s": round(verify, 3), "audit_s": round(audit, 3), "train_query_s": round(train, 3),
                         "ratio": round(verify / train, 4) if train else None},
        "uids": {str(uid): m.name for uid, m in by_uid.items()},
        "validators": [_validator_view(v, states.get(v.name, {}), weights_by_validator.get(v.name, {}))
                       for v in validators],
        "validator_spread": round(spread, 6) if len(validators) > 1 else None,
    }
