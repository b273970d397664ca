"""Telemetry: the one place a neuron publishes what it is doing.

The training loop, the swarm and the validator *write* here; the Rich dashboard,
the plain line logger, ``/metrics`` and ``dtrain status`` *read* snapshots. Writes
are a lock and a few assignments, so publishing never slows training, and readers
never drive the loop.

Only the standard library: the core must not import Rich or the CLI.
"""

from __future__ import annotations

import copy
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

HISTORY = 120  # points kept for sparklines


@dataclass
class Health:
    """Reachability of an external service (chain, model store) or of this node's swarm
    processes (the hivemind DHT and averager)."""

    ok: bool = True
    detail: str = ""
    last_ok: float = 0.0
    last_error: str = ""


@dataclass
class MinerRow:
    """One line of a validator's miner table. A component not measured in the miner's last
    round is None (shown as "—"), never a made-up 0."""

    uid: int
    hotkey: str
    gradient: float | None = None
    steps: float | None = None
    bandwidth: float | None = None
    allreduce: float | None = None
    score: float | None = None
    ema: float = 0.0
    weight: float = 0.0
    last_outcome: str = ""
    note: str = ""


@dataclass
class Snapshot:
    role: str = "miner"
    uid: int | None = None
    hotkey: str = ""
    network: str = ""
    netuid: int = 0
    peer_id: str = ""
    api: str = ""
    started_at: float = field(default_factory=time.time)
    state: str = "starting"
    epoch: int = 0
    inner_step: int = 0
    samples: int = 0
    tokens: int = 0
    samples_accumulated: int = 0
    local_batch: int = 0  # samples a contribution may carry (gradient mode: the target global batch)
    train_busy_s: float = 0.0  # seconds spent training own pages since the start (busy fraction)
    target_batch: int = 0
    global_samples: int | None = None  # None until the swarm's progress was read from the DHT
    loss: float | None = None
    tokens_per_s: float = 0.0
    grad_norm: float | None = None
    lr: float | None = None
    loss_history: list[float] = field(default_factory=list)
    tps_history: list[float] = field(default_factory=list)
    peers_seen: int = 0
    current_round: dict[str, Any] | None = None
    rounds: list[dict[str, Any]] = field(default_factory=list)
    miners: list[MinerRow] = field(default_factory=list)
    chain: Health = field(default_factory=Health)
    hub: Health = field(default_factory=Health)
    swarm: Health = field(default_factory=Health)
    swarm_restarts: int = 0  # times this node restarted its DHT and averager without an operator
    last_push: str = ""
    events: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Telemetry:
    """Thread-safe holder of the latest :class:`Snapshot`, plus an event stream."""

    def __init__(self, role: str, *, history: int = HISTORY, max_rounds: int = 20):
        self._lock = threading.Lock()
        self._snap = Snapshot(role=role)
        self._loss: deque[float] = deque(maxlen=history)
        self._tps: deque[float] = deque(maxlen=history)
        self._rounds: deque[dict[str, Any]] = deque(maxlen=max_rounds)
        self._events: deque[str] = deque(maxlen=50)
        self._listeners: list[Callable[[str, dict[str, Any]], None]] = []

    # --- writers ---------------------------------------------------------------

    def update(self, **fields: Any) -> None:
        with self._lock:
            for key, value in fields.items():
                if not hasattr(self._snap, key):
                    raise AttributeError(f"unknown telemetry field {key!r}")
                setattr(self._snap, key, value)

    def train_metrics(self, *, loss: float, tokens_per_s: float, grad_norm: float | None = None,
                      lr: float | None = None, **counters: Any) -> None:
        with self._lock:
            self._loss.append(float(loss))
            self._tps.append(float(tokens_per_s))
            self._snap.loss, self._snap.tokens_per_s = float(loss), float(tokens_per_s)
            self._snap.grad_norm, self._snap.lr = grad_norm, lr
            for key, value in counters.items():
                setattr(self._snap, key, value)
        self._emit("train", {"loss": loss, "tokens_per_s": tokens_per_s, "grad_norm": grad_norm, "lr": lr,
                             **counters})

    def round_started(self, info: dict[str, Any]) -> None:
        with self._lock:
            self._snap.current_round = dict(info)
        self._emit("round_started", info)

    def round_finished(self, record: dict[str, Any]) -> None:
        with self._lock:
            self._snap.current_round = None
            self._rounds.append(dict(record))
        self._emit("round", record)

    def set_miners(self, rows: list[MinerRow]) -> None:
        with self._lock:
            self._snap.miners = list(rows)

    def health(self, which: str, *, ok: bool, detail: str = "") -> None:
        with self._lock:
            h: Health = getattr(self._snap, which)
            changed = h.ok != ok
            h.ok, h.detail = ok, detail
            if ok:
                h.last_ok = time.time()
            else:
                h.last_error = detail
        if changed:
            self._emit("health", {"service": which, "ok": ok, "detail": detail})

    def event(self, message: str, **fields: Any) -> None:
        stamp = time.strftime("%H:%M:%S")
        with self._lock:
            self._events.append(f"{stamp} {message}")
        self._emit("event", {"message": message, **fields})

    # --- readers ---------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        with self._lock:
            snap = copy.deepcopy(self._snap)
            snap.loss_history = list(self._loss)
            snap.tps_history = list(self._tps)
            snap.rounds = list(self._rounds)
            snap.events = list(self._events)
        return snap

    def subscribe(self, listener: Callable[[str, dict[str, Any]], None]) -> None:
        """Listeners get every event (kind, fields); the plain logger is one. They must be quick."""
        self._listeners.append(listener)

    def _emit(self, kind: str, fields: dict[str, Any]) -> None:
        for listener in list(self._listeners):
            try:
                listener(kind, fields)
            except Exception:  # a broken log sink must never stop training
                pass


def write_status_file(path: str, snap: Snapshot) -> None:
    """Atomically publish a snapshot as JSON, for ``dtrain status`` and the sandbox to read."""
    from dtrain import jsonutil
    from dtrain.atomic import write_text

    write_text(path, jsonutil.dumps(snap.to_dict()))
