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
        # The training thread owns the model; other threads (the state-slice handler, hivemind's
        # state sharing) read it only under this lock, so they never see a half-applied step.
        self.model_lock = threading.RLock()

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
        from dtrain.swarm.averaging import GradientSwarm
        from dtrain.swarm.node import SwarmNode

        peers = peer_maddrs(commitments.values())
        self.node = SwarmNode(runtime.swarm_node_config(self.cfg, self.dir, peers)).start()
        self.swarm = GradientSwarm(
            self.node.dht, [p.detach() for p in self.trainer.params], self.bench.fingerprint,
            runtime.averaging_config(self.cfg, self.dir / "rounds.jsonl"),
            # Peers that fall behind download parameters, optimizer moments and counters from us.
            state_provider=self._shared_state,
        )
        self.swarm.set_state_priority(self.epoch)
        self.tel.update(peer_id=self.node.peer_id)

    def _shared_state(self):
        from dtrain.neurons.sync import export_state

        with self.model_lock:
            meta, tensors = export_state(self.trainer, self.epoch)
            return meta, [t.clone() for t in tensors]

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

    def _catch_up(self, *, epoch: int | None = None, digest: str | None = None) -> bool:
        """Adopt a peer's model state; True on success.

        Any DHT peer can offer state, so what arrives is checked before it is kept: it must be
        at ``epoch`` and hash to ``digest`` when the caller knows them (from a validator's
        query, or from what most miners report), and never older than ours. Otherwise our
        own state is put back.
        """
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
        with self.model_lock:
            own_meta, own_tensors = self._shared_state()
            try:
                new_epoch = import_state(self.trainer, loaded[0], loaded[1])
            except ValueError as exc:
                self.tel.event(f"catch-up: rejected peer state ({exc})")
                return False
            self._refresh_digest()
            problem = ""
            if new_epoch < own_meta["epoch"]:
                problem = f"it is older (epoch {new_epoch} < {own_meta['epoch']})"
            elif epoch is not None and new_epoch != epoch:
                problem = f"it is at epoch {new_epoch}, expected {epoch}"
            elif digest is not None and self._digest != digest:
                problem = "its parameters differ from the swarm's"
            if problem:
                import_state(self.trainer, own_meta, own_tensors)
                self._refresh_digest()
                self.tel.event(f"catch-up: refused a peer's state: {problem}")
                return False
            self.epoch = new_epoch
        self.swarm.set_state_priority(self.epoch)
        self.tel.event(f"caught up to epoch {self.epoch}")
        return True

    def _refresh_digest(self) -> None:
        from dtrain.neurons.runtime import params_digest

        self._digest = params_digest(self.trainer)

    def _save_checkpoint(self, *, uid: int) -> None:
        from dtrain.training.checkpoint import save_checkpoint
        from dtrain.training.loop import LoopState, training_state

        # The cursor is saved as 0: gradients of a half-filled local batch are not kept, so a
        # resumed miner re-trains the epoch's pages from the start rather than skipping them.
        with self.model_lock:
            state = training_state(self.trainer, LoopState(run_id=self.bench.run_id, uid=uid, epoch=self.epoch,
                                                           cursor=0, max_uids=MAX_UIDS))
        save_checkpoint(self.dir / "checkpoints", state)

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
