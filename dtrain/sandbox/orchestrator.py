"""``dtrain sandbox``: a whole subnet on this machine (README.md, "What the sandbox shows").

It creates the embedded chain and real sr25519 wallets, starts each miner and validator as its
own ``dtrain mine`` / ``dtrain validate`` process on loopback, waits for the validators' rounds,
then stops every neuron with SIGINT and kills what is left with its whole process group, so no
p2pd daemon outlives the sandbox. Each neuron also holds a lifeline to this process
(dtrain/lifeline.py): when the sandbox dies without stopping them (``kill -9``), they stop
themselves.
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

from dtrain.config import save_config
from dtrain.lifeline import LIFELINE_ENV
from dtrain.procmem import PeakMemory
from dtrain.sandbox import layout
from dtrain.sandbox.layout import Member
from dtrain.sandbox.settings import NETUID, RUN_ID, neuron_config, sandbox_scale, validator_names
from dtrain.sandbox.summary import build_summary, memory_rows, model_parameters

VALIDATOR_STAKE = 1000.0
# How long a neuron gets to stop cleanly after SIGINT: a checkpoint, the pusher's drain and
# hivemind's own shutdown timeouts (averager 5 s, DHT 3 s), with room for a slow 2-core host.
GRACE_S = 60.0
# Every neuron shares this machine's cores; on the subnet a validator has its own. Miners train
# at a lower CPU priority, so the validator's checks are not slowed by a dozen miners' training.
MINER_NICENESS = 10


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
    check: int | None = None  # validator.miners_per_round (None: every miner)
    model: str = "tiny"  # model.preset, trained at its sandbox scale (settings.SANDBOX_SCALES)
    protocol: str = "hivemind"  # allreduce.protocol: hivemind, or dtrain (the announced round)
    directory: Path | None = None
    round_timeout_s: float | None = None  # None: the preset's sandbox scale

    @property
    def round_timeout(self) -> float:
        return self.round_timeout_s if self.round_timeout_s is not None else sandbox_scale(self.model).round_timeout_s


@dataclass
class Child:
    member: Member
    process: subprocess.Popen
    log: Path


class SandboxError(Exception):
    pass


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


def lower_priority(pid: int, niceness: int) -> None:
    """Run process ``pid`` (a session leader: its threads, children and p2pd) at ``niceness``.

    Linux's autogroup scheduling shares the CPU between sessions before it looks at a process's
    own nice value, so a neuron (in a session of its own) is lowered through its autogroup; the
    process nice covers kernels without autogroups. Set right after the start, before the
    interpreter has started threads or p2pd, which inherit it."""
    try:
        os.setpriority(os.PRIO_PROCESS, pid, niceness)
    except OSError:
        return  # it exited already: nothing to lower
    try:
        with open(f"/proc/{pid}/autogroup", "w") as fh:
            fh.write(str(niceness))
    except OSError:
        pass  # no autogroups here (another OS, or CONFIG_SCHED_AUTOGROUP off): the nice above is enough


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
        self.memory = PeakMemory()  # each neuron's process tree, for the summary's peak memory
        # Only this process holds the write end: when it dies, every neuron's read ends (lifeline.py).
        self._lifeline_read, self._lifeline_write = os.pipe()
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
                                      self.options.batch_audit, check=self.options.check,
                                      model=self.options.model, protocol=self.options.protocol),
                        ndir / "config.toml", overwrite=True)
        layout.store_dir(self.root).mkdir(exist_ok=True)
        layout.write_manifest(self.root, members, {"rounds": self.options.rounds, "started_at": self.started_at,
                                                   "netuid": NETUID, "run_id": RUN_ID,
                                                   "validators": self.options.validators,
                                                   "mode": self.options.mode,
                                                   "check": self.options.check or total_miners,
                                                   "model": self.options.model,
                                                   "diloco_inner_steps": sandbox_scale(self.options.model).diloco_h})
        self.members = members
        count = self.options.validators
        self.on_event(f"registered {count} validator{'s' if count > 1 else ''} and {total_miners} miners with "
                      "real sr25519 hotkeys")
        return members

    # ------------------------------------------------------------------ processes

    def _spawn(self, member: Member, extra: list[str]) -> Child:
        ndir = layout.neuron_dir(self.root, member.name)
        log = ndir / "log.txt"
        config = ["--config", str(ndir / "config.toml"), *extra]
        if member.role == "validator":
            argv = [sys.executable, "-m", "dtrain", "validate", "--no-dashboard", *config]
        elif member.kind == "honest":
            argv = [sys.executable, "-m", "dtrain", "mine", "--no-dashboard", *config]
        else:  # a miner of another kind runs outside `dtrain mine` (dtrain/cli/sandbox_neuron.py)
            argv = [sys.executable, "-m", "dtrain.cli.sandbox_neuron", member.kind, *config]
        with open(log, "ab") as fh:
            # Own session: the whole process group (the neuron, its hivemind workers and p2pd)
            # can be signalled and, if need be, killed together.
            env = {**child_env(), LIFELINE_ENV: str(self._lifeline_read)}
            process = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       env=env, cwd=str(ndir), start_new_session=True,
                                       pass_fds=(self._lifeline_read,))
        if member.role == "miner":
            lower_priority(process.pid, MINER_NICENESS)
        child = Child(member, process, log)
        self.children.append(child)
        self.memory.track(member.name, process.pid)
        self.memory.start()
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
        # They start together and share the CPU, so the deadline grows with their number. A
        # neuron that dies is noticed at once (_wait_for_commitment polls the processes): this
        # deadline is only a hang guard.
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
                    + self.options.rounds * self.options.round_timeout * max(1, self.options.validators))
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
        self.memory.stop()
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
        fds, self._lifeline_read, self._lifeline_write = (self._lifeline_read, self._lifeline_write), -1, -1
        for fd in fds:
            if fd >= 0:
                os.close(fd)
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
        doc["model"] = {"preset": self.options.model, "parameters": model_parameters(self.options.model)}
        doc["memory"] = memory_rows(self.memory.peaks(), [m.name for m in getattr(self, "members", [])])
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

