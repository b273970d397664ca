"""What miners and validators share: chain reads, peers, the swarm, sync state, files.

Both roles hold a replica of the model that must stay identical to the swarm's,
join the DHT through the chain's commitments, and publish a status snapshot.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from dtrain.config import Config
from dtrain.telemetry import Telemetry, write_status_file

log = logging.getLogger("dtrain.neuron")

MAX_UIDS = 256  # page-assignment constant shared by every peer of a subnet (see training.data)


class NeuronBase:
    role = "neuron"

    def __init__(self, cfg: Config, telemetry: Telemetry, stop: threading.Event):
        self.cfg = cfg
        self.tel = telemetry
        self.stop = stop
        self.epoch = 0
        self._digest = ""

    # Set by the subclasses' run(): chain, dir, bench, trainer, node, swarm.

    def _commitments(self) -> dict:
        """Miners' commitments by hotkey; {} (and a red chain light) while the chain is down."""
        from dtrain.chain.base import ChainError

        try:
            found = self.chain.commitments()
            self.tel.health("chain", ok=True)
            return found
        except ChainError as exc:
            self.tel.health("chain", ok=False, detail=str(exc))
            return {}

    def _start_swarm(self, commitments: dict) -> None:
        from dtrain.neurons import runtime
        from dtrain.neurons.discovery import peer_maddrs
        from dtrain.neurons.sync import export_state
        from dtrain.swarm.averaging import GradientSwarm
        from dtrain.swarm.node import SwarmNode

        peers = peer_maddrs(commitments.values())
        self.node = SwarmNode(runtime.swarm_node_config(self.cfg, self.dir, peers)).start()
        self.swarm = GradientSwarm(
            self.node.dht, [p.detach() for p in self.trainer.params], self.bench.fingerprint,
            runtime.averaging_config(self.cfg, self.dir / "rounds.jsonl"),
            # Peers that fall behind download parameters, optimizer moments and counters from us.
            state_provider=lambda: export_state(self.trainer, self.epoch),
        )
        self.tel.update(peer_id=self.node.peer_id)

    def _start_progress(self) -> None:
        from dtrain.swarm.progress import ProgressTracker

        self.progress = ProgressTracker(self.node.dht, f"dtrain-{self.cfg.model.run_id}",
                                        self.cfg.allreduce.target_batch_size)

    def _exchange_progress(self, samples_accumulated: int, samples_per_second: float) -> None:
        """Publish our progress on the DHT and show the swarm's (samples toward the global batch)."""
        try:
            self.progress.report(self.epoch, samples_accumulated, samples_per_second)
            swarm = self.progress.fetch()
        except Exception as exc:  # the DHT is best effort here; training goes on without it
            log.debug("progress exchange failed: %r", exc)
            return
        self.tel.update(global_samples=swarm.samples_accumulated, target_batch=swarm.target_batch_size)

    def _connect_peers(self, commitments: dict) -> None:
        """Dial committed peers we do not know yet (or all of them while we are alone)."""
        from dtrain.neurons.discovery import peer_maddrs

        peers = peer_maddrs(commitments.values(), exclude_peer=self.node.peer_id)
        fresh = [p for p in peers if p not in self.node.config.initial_peers]
        if fresh or self.node.num_known_peers() == 0:
            self.node.config.initial_peers = list(dict.fromkeys([*self.node.config.initial_peers, *peers]))
            try:
                self.node.try_bootstrap_once()
            except Exception as exc:  # unreachable peers are retried on the next refresh
                log.debug("bootstrap attempt failed: %r", exc)
        self.tel.update(peers_seen=self.node.num_known_peers())

    def _catch_up(self) -> bool:
        """Adopt a peer's model state (after a partial round, or when behind). True on success."""
        from dtrain.neurons.sync import import_state

        self.tel.event("catching up: loading model state from a peer")
        try:
            loaded = self.swarm.load_state_from_peers(timeout_s=30)
        except Exception as exc:
            self.tel.event(f"catch-up failed: {exc!r}")
            return False
        if not loaded:
            self.tel.event("catch-up: no peer shared its state")
            return False
        try:
            self.epoch = import_state(self.trainer, loaded[0], loaded[1])
        except ValueError as exc:
            self.tel.event(f"catch-up: rejected peer state ({exc})")
            return False
        self._refresh_digest()
        self.tel.event(f"caught up to epoch {self.epoch}")
        return True

    def _refresh_digest(self) -> None:
        from dtrain.neurons.runtime import params_digest

        self._digest = params_digest(self.trainer)

    def _save_checkpoint(self, *, uid: int, cursor: int = 0) -> None:
        from dtrain.training.checkpoint import save_checkpoint
        from dtrain.training.loop import LoopState, training_state

        save_checkpoint(self.dir / "checkpoints", training_state(
            self.trainer, LoopState(run_id=self.bench.run_id, uid=uid, epoch=self.epoch, cursor=cursor,
                                    max_uids=MAX_UIDS)))

    def _resume(self, *, uid: int) -> bool:
        """Load this neuron's checkpoint if it has one; returns whether it did."""
        from dtrain.training.loop import LoopState, resume_or_start

        fresh = LoopState(run_id=self.cfg.model.run_id, uid=uid, max_uids=MAX_UIDS)
        state = resume_or_start(self.trainer, self.dir / "checkpoints", fresh)
        self.epoch = state.epoch
        self.cursor = state.cursor
        self.trainer.counters.epoch = self.epoch
        self._refresh_digest()
        return state is not fresh

    def _write_status(self) -> None:
        try:
            write_status_file(str(Path(self.dir) / "status.json"), self.tel.snapshot())
        except OSError as exc:
            log.debug("status file not written: %r", exc)

    def _stop_swarm(self) -> None:
        for step in (lambda: self.swarm.shutdown(), lambda: self.node.shutdown()):
            try:
                step()
            except Exception as exc:  # keep tearing down; report what failed
                log.warning("shutdown step failed: %r", exc)
