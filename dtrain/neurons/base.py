"""What miners and validators share: registration, chain reads, peers, the swarm, the
optimizer step of a round, catching up, checkpoints and the status file.

Both roles hold a replica of the model that must stay identical to the swarm's,
join the DHT through the chain's commitments, and publish a status snapshot.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from dtrain.config import Config
from dtrain.telemetry import Telemetry, write_status_file

log = logging.getLogger("dtrain.neuron")

REGISTRATION_BACKOFF_MAX_S = 30.0
CHANGE_ENDPOINT_HINT = ("To use another endpoint, pass --network ws://HOST:PORT (or wss://), "
                        "set BT_NETWORK, or set network under [chain] in the config.")


def chain_location(chain, network: str) -> str:
    """Where ``chain`` connects, for messages: a subtensor endpoint URL, the sandbox
    database path, or the network name when the backend tells neither."""
    return str(getattr(chain, "endpoint", None) or getattr(chain, "path", None) or network)


# How long a catch-up may wait for a peer's state.
CATCH_UP_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class CatchUpTarget:
    """The state a catch-up must reach.

    ``epoch`` and ``sketch`` (a parameter sketch, dtrain.training.replica) are set when
    someone named them (a validator's query, or what most miners report); None means "any
    peer state that is not older than ours". A state is accepted when its parameter sketch is
    within the replica tolerance of ``sketch``: honest replicas differ in the last bits.
    """

    epoch: int | None = None
    sketch: tuple | None = None


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
        self.node = self.swarm = None
        # allreduce.protocol = dtrain: the rounds on dtrain's own protocol, beside the swarm (which
        # still shares state with peers that catch up); None on the hivemind protocol
        self.model_rounds = self.round_transport = None
        self._swarm_watch = None  # a SwarmWatch once the swarm started (dtrain/neurons/swarm_health.py)
        self._swarm_note = ""  # the last self-restart, shown beside a healthy swarm line
        self._listen_on: list[str] | None = None  # the listen addresses a restarted node keeps
        from dtrain.neurons.runtime import no_progress_monitor_thread

        no_progress_monitor_thread()  # a flat thread count over weeks (docs/operators.md)

    # Set by the subclasses' run(): chain, dir, bench, trainer, node, swarm.

    # ------------------------------------------------------------------ chain

    def _open_chain(self, wallet) -> None:
        """Open the configured chain. Its backend records the health of every call; the
        dashboard, logs and /metrics mirror that record rather than keeping their own."""
        from dtrain.neurons.runtime import open_chain_for

        self.chain = open_chain_for(self.cfg, wallet=wallet)
        self.chain.health.subscribe(lambda ok, detail: self.tel.health("chain", ok=ok, detail=detail))

    def _wait_for_registration(self, *, need_permit: bool) -> int | None:
        """This hotkey's uid, once the chain has one; None if stopped (Ctrl-C) while waiting.

        While the chain cannot be reached, or the hotkey is not registered yet, it retries
        with backoff and says which of the two it is waiting for (once each). "Not
        registered" is only ever said after the chain answered: an unreachable chain is
        reported as such, with the endpoint and how to change it. A validator also needs a
        permit: without one miners refuse its queries, so that is an error. A
        ``ChainClientBug`` (an SDK programming error) is not waited out: it propagates.
        """
        from dtrain.chain.base import ChainError, ChainUnavailable
        from dtrain.neurons.runtime import NeuronError

        netuid = self.cfg.chain.netuid
        network = self.cfg.chain.network
        where = chain_location(self.chain, network)
        delay, said = 1.0, set()

        def once(key: str, message: str) -> None:
            if key not in said:
                said.add(key)
                self.tel.event(message)

        while not self.stop.is_set():
            try:
                neurons = self.chain.neurons()
            except ChainUnavailable as exc:
                # The SDK's own words (the cause) say why; the wrapper repeats the endpoint.
                reason = str(exc.__cause__ or exc) or type(exc).__name__
                once("unreachable", f"cannot reach the chain at {where} (network {network}): {reason}; "
                                    f"retrying every {REGISTRATION_BACKOFF_MAX_S:g}s at most. "
                                    f"{CHANGE_ENDPOINT_HINT}")
            except ChainError as exc:
                once("refused", f"the chain at {where} (network {network}) answered with an error: "
                                f"{exc}; retrying")
            else:
                if "unreachable" in said and "reached" not in said:
                    once("reached", f"reached the chain at {where}")
                me = next((n for n in neurons if n.hotkey == self.hotkey), None)
                if me is not None:
                    if need_permit and not me.validator_permit:
                        raise NeuronError(f"uid {me.uid} has no validator permit on netuid {netuid}; "
                                          "miners will refuse its queries (stake more to earn a permit)")
                    return me.uid
                if not neurons:
                    once("empty", f"netuid {netuid} has no registered neurons on {network} ({where}): "
                                  "check chain.netuid (--netuid) and the network; waiting")
                else:
                    once("unregistered", f"hotkey {self.hotkey} is not registered on netuid {netuid} "
                                         f"({network}); waiting. "
                                         f"Register it with: btcli subnets register --netuid {netuid}")
            self.stop.wait(delay)
            delay = min(delay * 2, REGISTRATION_BACKOFF_MAX_S)
        return None

    def _with_input_retries(self, fn, what: str, **delays):
        """``(True, fn())``, retrying transient failures of the training inputs (tokenizer,
        Hub model, data: a Hub timeout, a 503) with backoff until they pass; ``(False, None)``
        if stopped (Ctrl-C) while waiting.

        Neurons load their inputs before they contact the chain, so a wrong dataset or model
        id stops them before they announce anything. A restarted miner is still committed from
        its last run, which is why a transient failure waits instead of ending the process.
        """
        from dtrain.neurons.runtime import retry_data

        def on_retry(exc, failures, wait):
            self.tel.event(f"{what}: {exc}; retrying in {wait:.0f}s (attempt {failures + 1})")

        self.tel.update(state=f"{what}")
        return retry_data(fn, stop=self.stop, on_retry=on_retry, **delays)

    def _commitments(self) -> dict:
        """Miners' commitments by hotkey; {} while the chain is down (its health shows it)."""
        from dtrain.chain.base import ChainError

        try:
            return self.chain.commitments()
        except ChainError:
            return {}

    # ------------------------------------------------------------------ swarm

    def _mechanisms(self):
        """The classes its rounds are built from (a cheating reducer replaces one)."""
        from dtrain.swarm.averaging.mechanisms import Mechanisms

        return Mechanisms()

    def _start_swarm(self, commitments: dict, *, listen_on: list[str] | None = None) -> None:
        """Start the DHT (and p2pd) and the averager; ``listen_on`` replaces the configured
        listen addresses (a restarted node keeps its port: peers know it by that address)."""
        from dtrain.neurons import runtime
        from dtrain.neurons.discovery import peer_maddrs
        from dtrain.swarm.averaging import GradientSwarm
        from dtrain.swarm.node import SwarmNode
        from dtrain.swarm.startup import ProcessStartError

        peers = peer_maddrs(commitments.values())
        node_config = runtime.swarm_node_config(self.cfg, self.dir, peers)
        if listen_on:
            node_config.host_maddrs = list(listen_on)
        try:
            self.node = SwarmNode(node_config).start()
            self._check_announced()
            self.swarm = GradientSwarm(
                # Matching on the swarm fingerprint (model + swarm-wide settings) makes a peer with
                # other settings WRONG_MODEL instead of silently averaging out-of-step gradients.
                self.node.dht, [p.detach() for p in self.trainer.params], self.bench.swarm_fingerprint,
                runtime.averaging_config(self.cfg, self.dir / "rounds.jsonl"),
                # Peers that fall behind download parameters, optimizer moments and counters from us.
                state_provider=self._shared_state, mode=self.bench.mode.name,
                report_type=self.bench.mode.report_type, mechanisms=self._mechanisms(),
            )
        except BaseException as exc:
            if getattr(self, "node", None) is not None:  # no swarm yet: teardown would leave p2pd running
                self.node.shutdown()
            if isinstance(exc, ProcessStartError):  # a clear stop (exit 1), not a traceback
                raise runtime.NeuronError(f"swarm: {exc}") from None
            raise
        if self.cfg.allreduce.protocol == "dtrain":
            try:
                self.round_transport, self.model_rounds = runtime.announced_rounds(
                    self.cfg, self.node, [p.detach() for p in self.trainer.params], self.bench, self.chain,
                    wallet=self._announcing_wallet(), log_path=self.dir / "rounds.jsonl",
                    checks_type=self._mechanisms().round_checks)
            except BaseException:
                self._stop_swarm()
                raise
        self.swarm.set_state_priority(self.epoch)
        self.tel.update(peer_id=self.node.peer_id)
        if self._swarm_watch is None:
            from dtrain.neurons.swarm_health import SwarmWatch

            self._swarm_watch = SwarmWatch()

    def _announcing_wallet(self):
        """The wallet this neuron announces rounds with (a validator's); None: it only joins them."""
        return None

    @property
    def round_swarm(self):
        """What this neuron's rounds run on: the model rounds (protocol dtrain) or the swarm."""
        return self.model_rounds if self.model_rounds is not None else self.swarm

    def _swarm_started(self) -> None:
        """After the swarm node (re)started: what else holds it must take the new one."""

    def _watch_swarm(self, *, ping: bool = True) -> None:
        """On the thread that runs rounds, between them: restart the swarm node when its DHT or
        averager process died or stopped answering (dtrain/neurons/swarm_health.py).

        With ``ping`` false it only looks whether the processes run, at once and without a
        round trip (before a round: a dead averager would fail it after its whole timeout).
        """
        from dtrain.neurons.swarm_health import look_at

        watch = self._swarm_watch
        if watch is None or (ping and not watch.due()):
            return
        finding = look_at(self.node, self.swarm, ping=ping)
        if not ping and finding.problem is None:
            return  # a quick look does not count as a check
        reason = watch.judge(finding)
        if finding.problem is None:
            self.tel.health("swarm", ok=True, detail=self._swarm_note)
        elif reason is None:
            log.warning("swarm node: %s; restarting it if the next check finds it so too", finding.problem)
        else:
            self._restart_swarm(reason)

    def _restart_swarm(self, reason: str) -> None:
        """Stop what is left of the swarm node and start a new one (same identity, so the same
        peer id and chain commitment); a failed start is retried with backoff."""
        from dtrain.swarm.reachability import fixed_port_host_maddrs

        self.tel.health("swarm", ok=False, detail=reason)
        self.tel.event(f"swarm node: {reason}; restarting it")
        # Peers (and their routing tables) know this node by its address: listen on the same
        # port again when the configured one was random (tcp/0).
        if self.node is not None and getattr(self.node, "last_maddrs", None):
            self._listen_on = fixed_port_host_maddrs(self.node.config.host_maddrs, self.node.last_maddrs)
        self._stop_swarm()
        commitments = self._commitments()
        try:
            try:
                self._start_swarm(commitments, listen_on=self._listen_on)
            except Exception as exc:  # noqa: BLE001 - the old port may be taken: any port will do
                if not self._listen_on:
                    raise
                log.warning("swarm node: could not listen on %s again (%s); taking a new port",
                            ", ".join(self._listen_on), exc)
                self._listen_on = None
                self._start_swarm(commitments)
            self._swarm_started()
        except Exception as exc:  # noqa: BLE001 - p2pd or an averager that will not start: retried
            wait = self._swarm_watch.restarted(ok=False)
            self.tel.health("swarm", ok=False, detail=f"restart failed: {exc}")
            self.tel.event(f"swarm node: restart failed ({exc}); trying again in {wait:g}s")
            return
        self._swarm_watch.restarted(ok=True)
        snap = self.tel.snapshot()
        self._swarm_note = f"restarted {time.strftime('%H:%M:%S')} after: {reason}"
        self.tel.update(swarm_restarts=snap.swarm_restarts + 1)
        self.tel.health("swarm", ok=True, detail=self._swarm_note)
        self.tel.event(f"swarm node restarted; peer id {self.node.peer_id[:12]}… unchanged")

    def _check_announced(self) -> None:
        """Refuse to go on (before a miner commits anything) when hivemind announces only
        addresses that peers on other machines cannot dial; warn once on private ones.

        This is the check that sees what p2pd really found on a wildcard listen address;
        the CLI already refused what the config alone decides (dtrain.swarm.reachability).
        """
        from dtrain.neurons.runtime import NeuronError
        from dtrain.swarm.reachability import REFUSE, WARN, check_p2p

        source = "allreduce.announce_maddrs" if self.cfg.allreduce.announce_maddrs else \
            "the interfaces of allreduce.host_maddrs (no announce_maddrs set)"
        finding = check_p2p(self.node.visible_maddrs(), self.cfg.chain.network, source=source,
                            observed=not self.cfg.allreduce.announce_maddrs)
        if finding.level == REFUSE:
            self.node.shutdown()  # nothing else holds it yet; do not leave p2pd running
            raise NeuronError(finding.message)
        if finding.level == WARN:
            self.tel.event(f"warning: {finding.message}")

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

    def _apply_round(self, record, averaged):
        """Take the step every peer of a successful round takes (the mode's: the optimizer step
        with the mean gradient, or DiLoCo's outer step) and move to the next epoch; return its
        StepMetrics. Returns None (and changes nothing) when the round failed or its result is
        not finite.
        """
        with self.model_lock:
            metrics = self.bench.mode.apply_average(record, averaged)
            if metrics is None:
                return None
            self.epoch += 1
            self.trainer.counters.epoch = self.epoch
            self._refresh_digest()
        self.swarm.set_state_priority(self.epoch)
        return metrics

    def _catch_up(self, target: CatchUpTarget = CatchUpTarget(), timeout_s: float = CATCH_UP_TIMEOUT_S) -> bool:
        """Adopt a peer's model state; True on success.

        Any DHT peer can offer state, so what arrives is checked before it is kept: it must
        reach ``target`` where that names an epoch or digest, and never be older than ours.
        Otherwise our own state is put back.
        """
        from dtrain.neurons.sync import import_state

        self.tel.event("catching up: loading model state from a peer")
        try:
            loaded = self.swarm.load_state_from_peers(timeout_s=timeout_s, stop=self.stop)
        except Exception as exc:
            self.tel.event(f"catch-up failed: {exc!r}")
            return False
        if not loaded:
            self.tel.event("catch-up: no peer shared its state")
            return False
        with self.model_lock:
            own_meta, own_tensors = self._shared_state()
            # A refused state must not cost the local batch trained so far either: importing a
            # state drops the accumulated gradients, so keep them to put back.
            samples = self.trainer.accumulated_samples
            grads = [g.detach().clone() for g in self.trainer.gradients()] if samples else None
            try:
                new_epoch = import_state(self.trainer, loaded[0], loaded[1])
            except ValueError as exc:
                self.tel.event(f"catch-up: rejected peer state ({exc})")
                return False
            self._refresh_digest()
            problem = ""
            if new_epoch < own_meta["epoch"]:
                problem = f"it is older (epoch {new_epoch} < {own_meta['epoch']})"
            elif target.epoch is not None and new_epoch != target.epoch:
                problem = f"it is at epoch {new_epoch}, expected {target.epoch}"
            elif target.sketch is not None and not self._near(target.sketch):
                problem = "its parameters differ from the swarm's by more than the replica tolerance"
            if problem:
                import_state(self.trainer, own_meta, own_tensors)
                if grads is not None:
                    self.trainer.set_gradients(grads, num_samples=samples)
                self._refresh_digest()
                self.tel.event(f"catch-up: refused a peer's state: {problem}")
                return False
            self.epoch = new_epoch
        self.swarm.set_state_priority(self.epoch)
        self.tel.event(f"caught up to epoch {self.epoch}")
        return True

    def _params_sketch(self) -> tuple:
        from dtrain.training.replica import params_sketch

        return params_sketch(self.trainer.params)

    def _near(self, sketch) -> bool:
        """Whether this replica is within the replica tolerance of the one ``sketch`` describes."""
        from dtrain.training.replica import sketch_distance, within_tolerance

        return within_tolerance(sketch_distance(self._params_sketch(), tuple(sketch)))

    def _refresh_digest(self) -> None:
        from dtrain.neurons.runtime import params_digest

        self._digest = params_digest(self.trainer)

    # ------------------------------------------------------------------ files

    def _save_checkpoint(self, *, uid: int) -> None:
        from dtrain.training.checkpoint import save_checkpoint
        from dtrain.training.loop import LoopState, training_state

        # Checkpoints are taken at round boundaries with page counter 0: gradients of a
        # half-filled local batch are not kept, so a resumed miner re-trains the epoch's
        # pages from the start rather than skipping them.
        with self.model_lock:
            state = training_state(self.trainer, LoopState(run_id=self.bench.run_id, uid=uid, epoch=self.epoch))
        save_checkpoint(self.dir / "checkpoints", state)

    def _resume(self, *, uid: int) -> bool:
        """Load this neuron's checkpoint if it has one; returns whether it did."""
        from dtrain.training.loop import LoopState, resume_or_start

        fresh = LoopState(run_id=self.cfg.model.run_id, uid=uid)
        state = resume_or_start(self.trainer, self.dir / "checkpoints", fresh)
        self.epoch = state.epoch
        self.trainer.counters.epoch = self.epoch
        self._refresh_digest()
        return state is not fresh

    def _write_status(self) -> None:
        try:
            write_status_file(str(Path(self.dir) / "status.json"), self.tel.snapshot())
        except OSError as exc:
            log.debug("status file not written: %r", exc)

    def _stop_swarm(self) -> None:
        transport, self.round_transport, self.model_rounds = self.round_transport, None, None
        for step in (lambda: transport and transport.shutdown(), lambda: self.swarm and self.swarm.shutdown(),
                     lambda: self.node and self.node.shutdown()):
            try:
                step()
            except Exception as exc:  # keep tearing down; report what failed
                log.warning("shutdown step failed: %r", exc)
