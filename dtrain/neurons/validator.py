"""The validator neuron: its lifecycle, and one validation round as a list of phases.

It runs the validator (wallet, model, chain, swarm; the round loop on the shared round clock;
shutdown), keeps its replica in step, scores, sets weights and persists its state.
``Validator._round`` reads top to bottom as the round's phases: their I/O is
dtrain.neurons.validation_round and validation_audit, their decisions are
dtrain.validation.round_rules and verification, scores and weights dtrain.validation.scoring
and weights (docs/architecture.md, "Where verification lives").
"""

from __future__ import annotations

import logging
import math
import random
import secrets
import threading
import time

from dtrain.chain.base import ChainClientBug
from dtrain.config import Config
from dtrain.neurons import validation_audit as audits
from dtrain.neurons import validation_round as phases
from dtrain.neurons import validator_report as report
from dtrain.neurons.base import CatchUpTarget, NeuronBase
from dtrain.neurons.runtime import NeuronError, node_dir
from dtrain.neurons.validation_round import Probe
from dtrain.swarm.averaging.group_rules import BenchList
from dtrain.swarm.deadlines import allreduce_start, next_round_start, round_deadline_s
from dtrain.telemetry import Telemetry
from dtrain.validation.verification import probation_rounds

# fellow_validators is also imported from here (tests/test_neuron_parts.py)
from dtrain.validation.round_rules import (
    CheckRotation,
    drifted_alone,
    fellow_validators,
    later_audits,
    live_miners,
    miner_targets,
    majority_epoch_ahead,
    skip_overtaken,
)

log = logging.getLogger("dtrain.validator")

EVAL_PAGES = 2


class Validator(NeuronBase):
    role = "validator"

    def __init__(self, cfg: Config, telemetry: Telemetry, stop: threading.Event, *, max_rounds: int | None = None):
        super().__init__(cfg, telemetry, stop)
        self.max_rounds = max_rounds
        self._overtaken_in_a_row = 0  # rounds left unscored because another validator's round ran first
        self._moved_on_in_a_row: dict[str, int] = {}  # hotkey -> rounds in a row it moved on mid-check
        self._slot_start = time.time()  # when the current round's slot began (the shared round clock)
        # Peer ids of the other validators met in our last round's group: named with the miners,
        # so the group forms once they are in too (docs/protocol.md, "Several validators").
        self._fellow_validators: set[str] = set()
        # peers we tell the miners failed our round audit, each for a number of rounds (they then
        # vote to bench it as a reducer; docs/protocol.md, "Round audit"); in memory only
        self._audit_refused = BenchList()
        # Our replica holds the whole result of our last round (round_rules.drifted_alone).
        self._in_step = False
        self._uids_by_peer: dict[str, int] = {}  # of the committed miners, this round
        self._checks = CheckRotation()  # whom the next round checks: those checked longest ago
        self._averaged_last: set[str] = set()  # peers our last round averaged
        self._in_step_with: set[str] = set()  # miners that held our replica when this round began

    # ------------------------------------------------------------------ lifecycle

    def run(self) -> int:
        import torch

        if not self._start():
            return 0  # stopped (Ctrl-C) while an input or the chain was unavailable
        self.swarm = None
        try:
            self._start_swarm(self._commitments())
            self._swarm_started()
            self.zeros = [torch.zeros(()).expand(p.shape) for p in self.trainer.params]  # expanded: no memory
            self._serve_metrics()
            self.tel.update(state="validating")
            self._restore_dashboard()
            self._validate()
        finally:
            self._shutdown()
        return 0

    def _start(self) -> bool:
        """Wallet, model and tokenizer, chain registration, state, data and the API client; False
        when stopped on the way (a missing model or tokenizer is reported before the chain is reached)."""
        from dtrain.api.client import MinerClient
        from dtrain.neurons import runtime
        from dtrain.validation.state import ValidatorState, load_state

        cfg = self.cfg
        self.tel.update(state="loading wallet", network=cfg.chain.network, netuid=cfg.chain.netuid)
        self.wallet = runtime.load_wallet(cfg)
        self.hotkey = self.wallet.hotkey.ss58_address
        self.tel.update(hotkey=self.hotkey)
        ok, self.bench = self._with_input_retries(lambda: runtime.build_workbench(cfg),
                                                  "loading the tokenizer and model")
        if not ok:
            return False
        self.trainer = self.bench.trainer
        self.tel.update(state="connecting to chain")
        self._open_chain(self.wallet)
        self.uid = self._wait_for_registration(need_permit=True)
        if self.uid is None:
            return False
        self.dir = node_dir(cfg, "validator", self.hotkey)
        self.state_path = self.dir / "state.json"
        self.state = load_state(self.state_path) if self.state_path.exists() else ValidatorState()
        self.tel.update(uid=self.uid)
        self._resume(uid=0)

        def first_pages():
            self.bench.reader.open()
            return self._eval_batch()

        ok, self.eval_tokens = self._with_input_retries(first_pages, "opening the dataset")
        if not ok:
            return False
        self.client = MinerClient(self.wallet, timeout=max(60.0, round_deadline_s(cfg.allreduce) + 60))
        return True

    def _swarm_started(self) -> None:
        self._start_progress()  # whom to expect in a round: the miners' progress on the DHT

    def _catch_up(self, *args, **kwargs) -> bool:
        self._in_step = False  # a peer's state, not our own round's result
        return super()._catch_up(*args, **kwargs)

    def _serve_metrics(self) -> None:
        port = self.cfg.api.metrics_port
        if port:
            from dtrain.metrics import serve

            try:
                serve(self.tel, self.cfg.api.host, port)
            except OSError as exc:
                self.tel.event(f"metrics endpoint not started on port {port}: {exc}")

    def _validate(self) -> None:
        """Round after round on the shared round clock, until stopped (or ``max_rounds``)."""
        rounds = 0
        while not self.stop.is_set() and (self.max_rounds is None or rounds < self.max_rounds):
            self._watch_swarm()
            self.tel.update(state="waiting for the next round")
            self._slot_start = next_round_start(time.time(), self.cfg.validator.round_interval_s)
            self.stop.wait(max(0.0, self._slot_start - time.time()))
            if self.stop.is_set():
                break
            try:
                finished = self._round()
            except ChainClientBug:
                raise  # a bug in dtrain or an unsupported SDK: every round would fail alike
            except Exception as exc:
                # One bad round (a hostile miner, a data hiccup) must not end validation.
                log.exception("validation round failed")
                self.tel.event(f"round failed: {type(exc).__name__}: {exc}")
                finished = True
            # A round another validator's round overtook is not scored and does not count.
            rounds += 1 if finished else 0
            self._write_status()

    def _shutdown(self) -> None:
        self.tel.update(state="stopping")
        if self.swarm is not None:
            self._stop_swarm()
        self.tel.update(state="stopped")
        self._write_status()

    # ------------------------------------------------------------------ one round

    def _round(self) -> bool:
        """One round, phase by phase (dtrain.neurons.validation_round); False when another
        validator's round overtook it (not scored, run again)."""
        from dtrain.chain.base import ChainError

        round_no = self.state.round_counter + 1
        self.tel.update(state=f"round {round_no}: reading chain")
        try:
            neurons = self.chain.neurons()
        except ChainError as exc:
            self.tel.event(f"round {round_no} skipped: chain unreachable ({exc})")
            return True
        commitments = self._commitments()
        targets = self._checks.choose(neurons, commitments, self.hotkey, self.cfg.validator.miners_per_round,
                                      random.Random(secrets.randbits(64)))
        if not targets:
            self.tel.event(f"round {round_no}: no miner has committed yet")
            return True
        probes = [Probe.of(t) for t in targets]
        miners = miner_targets(neurons, commitments)
        self._uids_by_peer = {peer: t.uid for peer, t in miners.items()}
        self._connect_peers(commitments)

        # Where the miners are: a validator left behind follows them before checking anyone.
        phases.ask_statuses(self.client, probes)
        self._follow_the_swarm(probes)
        loss_before = self._eval_loss()

        # The Train challenge and state slices, checked against this replica.
        self.tel.update(state=f"round {round_no}: Train queries")
        verify_s = self._probe_and_verify(probes)

        # The all-reduce, joined with weight 0; unscored if another validator's round ran first.
        round_epoch = self.epoch
        record, averaged = self._allreduce(probes, round_no, commitments,
                                           validators=[n.hotkey for n in neurons if n.validator_permit])
        if self._overtaken(round_no, probes, record):
            return False  # not a check: these miners stay first in line for the rerun
        self._checks.scored(targets, round_no)

        # Audit the committed work on the pre-step replica, then take the round's step.
        self.tel.update(state=f"round {round_no}: auditing committed work")
        t0 = time.perf_counter()
        later = self._audit(probes, record, averaged, neurons, commitments)
        audit_s = time.perf_counter() - t0
        self.state.probation = phases.update_probation(
            probes + later, record, self.state.probation, round_no,
            rounds=probation_rounds(len(miners), len(probes)))
        self._take_step(record, averaged)
        loss_after = self._eval_loss() if record.ok else loss_before

        # Score, set weights, persist.
        scores = self._score(probes, record, neurons, round_no, round_epoch,
                             caught=audits.caught(probes + later, record))
        weights = self._set_weights(neurons)
        caught = {p.uid: p.note for p in later if p.work is not None and not p.work.passed}
        summary = self._summary(round_no, probes, record, scores, weights, loss_before, loss_after, verify_s,
                                caught)
        summary["audit_s"] = round(audit_s, 3)
        self._persist(round_no, summary, loss_before, loss_after)
        return True

    def _probe_and_verify(self, probes: list[Probe]) -> float:
        """Train challenges and state slices, checked against this replica, then the recomputed
        micro-batches; resynchronise if this replica is the one that drifted. The seconds verifying."""
        challenge = phases.challenge(self.trainer, self.cfg, epoch=self.epoch, digest=self._digest,
                                     sketch=self._params_sketch())
        phases.probe(self.client, probes, challenge, swarm_fingerprint=self.bench.swarm_fingerprint,
                     slice_bytes=self.cfg.validator.slice_bytes)
        phases.check_slices(probes, self.trainer, challenge.rms)
        phases.spot_moved_on(self.client, probes, self.epoch)
        t0 = time.perf_counter()
        phases.verify(probes, self.bench, self.cfg, challenge)
        verify_s = time.perf_counter() - t0
        self._resync_if_alone(probes)
        return verify_s

    def _persist(self, round_no: int, summary: dict, loss_before: float, loss_after: float) -> None:
        from dtrain.validation.state import save_state

        self.state.add_round(summary)
        save_state(self.state_path, self.state)
        self.tel.event(f"round {round_no}: {summary['status']}, {len(summary['participants'])} participants, "
                       f"eval loss {loss_before:.3f} -> {loss_after:.3f}")

    def _audit(self, probes: list[Probe], record, averaged, neurons, commitments: dict) -> list[Probe]:
        """The round audit (the peers it proves at fault are named to the miners next round), then
        the work audit (dtrain.neurons.validation_audit) of the checked miners and of a few
        unchecked members drawn now (returned: they are not scored, only penalised if caught)."""
        from dtrain.swarm.averaging.audit import PROVEN_BENCH_ROUNDS
        from dtrain.swarm.averaging.group_rules import BENCH_ROUNDS

        # The group's other miners (checked by no one or by other validators) are asked too, so
        # a part that one of them is in can still be checked; validators are not asked (they keep nothing).
        miners = miner_targets(neurons, self._commitments() or commitments)  # where they are now
        audits.follow_restarts(probes, miners)
        others = {peer: (t.api, t.hotkey) for peer, t in miners.items()}
        later = [Probe.of(miners[peer]) for peer in later_audits(
            [peer for peer in record.work_reports if peer in self._in_step_with], {p.peer_id for p in probes},
            self.cfg.validator.unchecked_audits, random.Random(secrets.randbits(64)))]
        found = audits.round_audit(self.client, self.round_swarm, probes + later, record, averaged, others=others)
        self._audit_refused.tick()
        for peer in (found.problems if found is not None else ()):
            self._audit_refused.name([peer], PROVEN_BENCH_ROUNDS if peer in found.proven else BENCH_ROUNDS)
            self.tel.event(f"round audit: peer {peer[:16]}… {found.problems[peer]}; named to the miners as refused")
        audits.audit(self.client, self.bench.mode, probes + later, record, self.epoch)
        later += audits.proven_faults(record, miners, {p.peer_id for p in probes + later}, found)
        for p in later:
            if p.work is not None and not p.work.passed:
                self.tel.event(f"uid {p.uid}, not checked this round: {p.note}; its score is forfeit and it is "
                               "on probation")
        return later

    def _follow_the_swarm(self, probes: list[Probe]) -> None:
        """If most miners asked are at a later epoch than ours, adopt a peer's state at it
        (round_rules.majority_epoch_ahead)."""
        epoch = majority_epoch_ahead([None if p.status is None else p.status.epoch for p in probes], self.epoch)
        if epoch is not None:
            self.tel.event(f"most miners are at epoch {epoch}, this validator at {self.epoch}: catching up")
            if self._catch_up(CatchUpTarget(epoch=epoch)):
                self._save_checkpoint(uid=0)

    def _resync_if_alone(self, probes: list[Probe]) -> None:
        """Same epoch, but most miners' parameters are beyond the replica tolerance from ours:
        this replica is the one that drifted (round_rules.drifted_alone). Take a peer's state
        at our epoch."""
        drift = drifted_alone([p.replica_distance for p in probes], [p.moved_on for p in probes],
                              in_step=self._in_step)
        if drift is not None:
            self.tel.event(f"{drift.far} of {drift.measured} miners are beyond the replica tolerance from this "
                           "validator: resynchronising from peers")
            if self._catch_up(CatchUpTarget(epoch=self.epoch)):
                self._save_checkpoint(uid=0)

    def _allreduce(self, probes: list[Probe], round_no: int, commitments: dict, validators: list[str]):
        """Run the round with weight 0 at the slot's all-reduce time; return its record and the
        averaged tensors (not applied yet). On dtrain's protocol the round is the one announced by
        the first of ``validators`` (hotkeys) in the epoch's order that is up: ours, or another's
        we join (validation_round.round_to_join)."""
        from dtrain.swarm.round_notices import RoundNotices
        from dtrain.training.work import work_nonce

        # Every validator starts its all-reduce at the same point of the slot, however long its
        # checks took, so all of them meet the miners in one matchmaking window.
        self.tel.update(state=f"round {round_no}: waiting for the all-reduce")
        self.stop.wait(max(0.0, allreduce_start(self._slot_start, self.cfg.validator.round_interval_s) - time.time()))
        self.tel.update(state=f"round {round_no}: all-reduce")
        joined, announcer = None, None
        if self.model_rounds is not None:
            notices = RoundNotices(self.node.dht, f"dtrain-{self.cfg.model.run_id}")
            joined = phases.round_to_join(notices.current, validators=validators, own_hotkey=self.hotkey,
                                          own_peer=self.node.peer_id, run_id=self.bench.run_id, epoch=self.epoch,
                                          stop=self.stop)
            announcer = joined.announcer if joined is not None else self.node.peer_id
        request = phases.allreduce_request(probes, run_id=self.bench.run_id, epoch=self.epoch, round_no=round_no,
                                           digest=self._digest, weight_cap=self.bench.mode.weight_cap,
                                           deadline_s=round_deadline_s(self.cfg.allreduce),
                                           probation=self.state.probation, refused=tuple(self._audit_refused.named()),
                                           unchecked={c.peer_id: hotkey for hotkey, c in commitments.items()},
                                           announcer=announcer,
                                           round_id=joined.round_id if joined is not None else None)
        self.tel.round_started({"round_id": request.round_id, "epoch": self.epoch, "miners": len(probes)})
        # Every miner at our epoch joins, checked or not: the group waits for all that its progress
        # on the DHT shows there, and for the miners our last round averaged (they stepped with us).
        miner_ids = {c.peer_id for c in commitments.values()}
        expected = ({p.peer_id for p in probes} | self._fellow_validators | self._live_miners(miner_ids)
                    | (self._averaged_last & miner_ids))
        # whose work we can audit unchecked: it trained on our replica (we averaged together, whole)
        self._in_step_with = self._averaged_last & miner_ids if self._in_step else set()
        if self.model_rounds is not None:
            record, averaged = phases.announced_allreduce(self.client, self.model_rounds, probes, request,
                                                          announce=lambda: self._announce(request),
                                                          work_nonce=work_nonce(self.bench.run_id, self.epoch),
                                                          stop=self.stop, joining=joined is not None)
        else:
            record, averaged = phases.allreduce(self.client, self.swarm, probes, request, zeros=self.zeros,
                                                expected=sorted(expected),
                                                announce=lambda: self._announce(request),
                                                work=self.bench.mode.empty_report(self.epoch),
                                                work_nonce=work_nonce(self.bench.run_id, self.epoch), stop=self.stop)
        self._fellow_validators = fellow_validators(record, miner_ids, self.swarm.peer_id)
        self._averaged_last = {p.peer_id for p in record.peers if p.outcome.value == "SUCCESS"} if record.ok else set()
        return record, averaged

    def _announcing_wallet(self):
        return self.wallet

    def _live_miners(self, miner_peer_ids: set[str]) -> set[str]:
        try:
            return live_miners(self.progress.peers(), miner_peer_ids, self.epoch)
        except Exception as exc:  # noqa: BLE001 - the DHT is best effort: expect the checked miners only
            self.tel.event(f"miners' progress not read from the DHT ({exc!r}); expecting the checked miners only")
            return set()

    def _announce(self, request) -> None:
        if problem := phases.announce(self.node.dht, self.cfg.model.run_id, request):
            self.tel.event(problem)

    def _overtaken(self, round_no: int, probes: list[Probe], record) -> bool:
        """Another validator's round ran without us (we were late to its group, or landed in a
        later epoch's group): the miners are ahead, so this round is no evidence against them.
        Catch up to their epoch, to run the round again, scoring nothing now
        (round_rules.skip_overtaken)."""
        epoch, self._overtaken_in_a_row = skip_overtaken(
            round_averaged=record.ok, our_epoch=self.epoch, asked=len(probes),
            answer_epochs=[p.allreduce.epoch for p in probes if p.allreduce is not None],
            committed_epochs=[record.work_reports[p.peer_id].epoch for p in probes if p.peer_id in record.work_reports],
            in_a_row=self._overtaken_in_a_row)
        if epoch is None:
            return False
        self.tel.event(f"round {round_no}: the miners averaged epoch {self.epoch} in another validator's "
                       f"round and are at epoch {epoch}; catching up, not scoring")
        self.tel.round_finished(record.to_dict())
        if self._catch_up(CatchUpTarget(epoch=epoch)):
            self._save_checkpoint(uid=0)
        return True

    def _take_step(self, record, averaged) -> None:
        # Joining with weight 0, this replica receives the same average and takes the same step.
        applied = self._apply_round(record, averaged)
        self.round_swarm.release_buffers()  # the average is applied (or not ours to): 4 bytes/param back
        if applied is not None:
            self._in_step = record.in_step
            self._save_checkpoint(uid=0)
            if not record.in_step:
                # Part of our replica kept local (zero) values: take a peer's state instead.
                self._catch_up()
        self.tel.round_finished(record.to_dict())

    def _score(self, probes: list[Probe], record, neurons, round_no: int, round_epoch: int,
               caught: list[int]) -> dict:
        """Each checked miner's verdict and score at the epoch the round ran at; the EMA
        (``caught``: uids an audit or the round's record caught forfeit it) and the dashboard's last scores."""
        from dtrain.validation.scoring import ScoringConfig, combined_scores, forfeit, score_round, update_ema

        scfg = ScoringConfig.from_validator(self.cfg.validator)
        inputs, self._moved_on_in_a_row = phases.assess(probes, record, epoch=round_epoch,
                                                        probation=self.state.probation, round_no=round_no,
                                                        moved_on_streaks=self._moved_on_in_a_row)
        scores = score_round(inputs, scfg)
        hotkeys = {n.uid: n.hotkey for n in neurons}
        self.state.ema = update_ema(forfeit(self.state.ema, caught), combined_scores(scores), hotkeys,
                                    alpha=scfg.ema_alpha)
        for probe in probes:
            s = scores[probe.uid]
            self.state.last_scores[probe.uid] = {**s.as_dict(), "hotkey": probe.hotkey, "outcome": probe.outcome,
                                                 "note": probe.note, "ema": self.state.ema.paid().get(probe.uid, 0.0)}
        return scores

    def _set_weights(self, neurons) -> dict[int, float]:
        return report.set_weights(self.chain, self.uid, self.state, neurons, self.tel)

    def _summary(self, round_no, probes, record, scores, weights, loss_before, loss_after, verify_s,
                 caught) -> dict:
        self._update_miner_table(weights)
        return report.round_summary(round_no, self.epoch, probes, record, scores, weights, self.state.ema,
                                    loss=(loss_before, loss_after), verify_s=verify_s, uids=self._uids_by_peer,
                                    caught=caught)

    # ------------------------------------------------------------------ helpers

    def _eval_batch(self):
        from dtrain.training.data import assign_pages

        reader = self.bench.reader
        pages = assign_pages(run_id=self.bench.run_id, uid=0, epoch=0, page_counter=0, count=EVAL_PAGES,
                             num_pages=reader.num_pages, nonce="eval")
        return reader.read_pages(pages)

    def _eval_loss(self) -> float:
        """Loss of this replica (kept in step with the swarm) on a fixed held-out batch."""
        import torch

        from dtrain.training.trainer import microbatch_loss

        mbs = self.cfg.training.micro_batch_size
        losses = []
        with torch.no_grad():
            x_all = self.eval_tokens.to(self.trainer.device)
            for start in range(0, x_all.shape[0], mbs):
                losses.append(float(microbatch_loss(self.bench.model, x_all[start:start + mbs],
                                                    self.trainer.precision)))
        loss = sum(losses) / len(losses)
        if not math.isfinite(loss):
            raise NeuronError("the validator's model produced a non-finite loss; its replica is corrupt "
                              f"(delete {self.dir / 'checkpoints'} to resynchronise from peers)")
        self.tel.train_metrics(loss=loss, tokens_per_s=0.0, lr=self.trainer.lr, epoch=self.epoch,
                               inner_step=self.trainer.counters.inner_step)
        return loss

    def _update_miner_table(self, weights: dict[int, float]) -> None:
        self.tel.set_miners(report.miner_rows(self.state, weights))

    def _restore_dashboard(self) -> None:
        from dtrain.validation.weights import compute_weights

        # After a restart the miner table shows the persisted scores straight away.
        self._update_miner_table(compute_weights(self.state.ema.paid()))
