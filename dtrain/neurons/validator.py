"""The validator neuron: verify training, run all-reduce rounds, score, set weights.

One validation round:

1. read the metagraph and the miners' commitments;
2. probe each selected miner: a signed Train challenge (a fresh nonce, from which the
   pages follow), and a state-slice download for bandwidth and replica distance;
3. recompute a random subset of each miner's micro-batches on this validator's own
   replica of the model and compare losses and gradient fingerprints;
4. ask the miners to join an all-reduce round and join it with weight 0. Each miner commits
   there to the pages its contribution came from; peers refuse a contribution that is not
   the mean of its committed pages (dtrain.swarm.contribution);
5. audit: recompute randomly chosen committed pages of each miner on the pre-step model,
   then take the round's step, so this replica stays in step for the next verification;
6. score (``dtrain.validation.scoring``), smooth, turn into weights, and set them on
   chain at the rate limit; persist everything.

Every decision about what was measured is made in ``dtrain.validation.verification``.
"""

from __future__ import annotations

import logging
import math
import random
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from dtrain.api.messages import AllReduceRequest, AllReduceResponse, StatusResponse, TrainRequest, TrainResponse
from dtrain.chain.base import ChainClientBug
from dtrain.config import Config
from dtrain.neurons.base import CatchUpTarget, NeuronBase
from dtrain.neurons.deadlines import allreduce_start, next_round_start, round_deadline_s
from dtrain.neurons.runtime import NeuronError, node_dir
from dtrain.telemetry import MinerRow, Telemetry
from dtrain.validation.verification import MAX_OVERTAKEN_IN_A_ROW, overtaken_by

log = logging.getLogger("dtrain.validator")

EVAL_PAGES = 2
# A DiLoCo snapshot is downloaded in pieces of this size (the miner's per-request limit is 64 MiB).
SNAPSHOT_CHUNK = 16 << 20
# The whole download must finish within SNAPSHOT_FIXED_S plus its size at SNAPSHOT_MIN_RATE
# (4 MiB/s, 34 Mbit/s: about 6 min for gpt2-124m's 1.5 GB): audits run one miner after
# another before the round's step, so a miner must not be able to stall them chunk by chunk.
SNAPSHOT_FIXED_S, SNAPSHOT_MIN_RATE = 30.0, 4 << 20


@dataclass
class Probe:
    """What one miner answered this round."""

    uid: int
    hotkey: str
    api: str
    peer_id: str
    status: StatusResponse | None = None
    train: TrainResponse | None = None
    train_error: str = ""
    train_seconds: float = 0.0
    slice_bps: float | None = None
    slice_error: str = ""
    allreduce: AllReduceResponse | None = None
    allreduce_error: str = ""
    checks: list = field(default_factory=list)
    outcome: str = ""
    note: str = ""
    shared_peer_id: bool = False
    slice_check: tuple | None = None
    replica_distance: float | None = None  # of its state slice from ours (dtrain.training.replica)
    work: object | None = None  # its WorkVerdict (dtrain.validation.verification), after the audit
    moved_on: bool = False  # it stepped to a later epoch while we were checking it (another validator's round)


def commitments_peer_ids(commitments: dict) -> list[str]:
    return [c.peer_id for c in commitments.values()]


def fellow_validators(record, miner_peer_ids: set[str], own_peer_id: str) -> set[str]:
    """The other validators of a round's group: weight-0 members that no miner committed.

    A group forms as soon as every peer its validators named has joined, so a validator that
    names only miners can see the group form before a fellow validator arrives; naming the
    ones met last round keeps them in. One that does not come costs a round the matchmaking
    window once, and is then no longer named (it is not in that round's group).
    """
    return {p.peer_id for p in record.peers
            if p.weight_claimed == 0 and p.peer_id not in miner_peer_ids and p.peer_id != own_peer_id}


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

    # ------------------------------------------------------------------ lifecycle

    def run(self) -> int:
        import torch

        from dtrain.api.client import MinerClient
        from dtrain.neurons import runtime
        from dtrain.validation.state import ValidatorState, load_state

        cfg = self.cfg
        self.tel.update(state="loading wallet", network=cfg.chain.network, netuid=cfg.chain.netuid)
        self.wallet = runtime.load_wallet(cfg)
        self.hotkey = self.wallet.hotkey.ss58_address
        # The model and tokenizer first: a missing one is reported before the chain is reached.
        self.tel.update(hotkey=self.hotkey)
        ok, self.bench = self._with_input_retries(lambda: runtime.build_workbench(cfg),
                                                  "loading the tokenizer and model")
        if not ok:
            return 0  # stopped (Ctrl-C) while the Hub was unreachable
        self.trainer = self.bench.trainer
        self.tel.update(state="connecting to chain")
        self._open_chain(self.wallet)
        self.uid = self._wait_for_registration(need_permit=True)
        if self.uid is None:
            return 0  # stopped (Ctrl-C) while waiting for the chain
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
            return 0  # stopped (Ctrl-C) while the data source was unavailable
        self.client = MinerClient(self.wallet, timeout=max(60.0, round_deadline_s(cfg.allreduce) + 60))
        self.swarm = None
        try:
            self._start_swarm(self._commitments())
            self.zeros = [torch.zeros(p.shape, dtype=torch.float32) for p in self.trainer.params]
            if cfg.api.metrics_port:
                from dtrain.metrics import serve

                try:
                    serve(self.tel, cfg.api.host, cfg.api.metrics_port)
                except OSError as exc:
                    self.tel.event(f"metrics endpoint not started on port {cfg.api.metrics_port}: {exc}")
            self.tel.update(state="validating")
            self._restore_dashboard()
            rounds = 0
            while not self.stop.is_set() and (self.max_rounds is None or rounds < self.max_rounds):
                self.tel.update(state="waiting for the next round")
                self._slot_start = next_round_start(time.time(), cfg.validator.round_interval_s)
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
        finally:
            self._shutdown()
        return 0

    def _shutdown(self) -> None:
        self.tel.update(state="stopping")
        if self.swarm is not None:
            self._stop_swarm()
        self.tel.update(state="stopped")
        self._write_status()

    # ------------------------------------------------------------------ one round

    def _round(self) -> bool:
        """One round; False when another validator's round overtook it (not scored, run again)."""
        from dtrain.chain.base import ChainError

        round_no = self.state.round_counter + 1
        self.tel.update(state=f"round {round_no}: reading chain")
        try:
            neurons = self.chain.neurons()
        except ChainError as exc:
            self.tel.event(f"round {round_no} skipped: chain unreachable ({exc})")
            return True
        commitments = self._commitments()
        miners = [n for n in neurons if n.hotkey in commitments and not n.validator_permit and n.hotkey != self.hotkey]
        if not miners:
            self.tel.event(f"round {round_no}: no miner has committed yet")
            return True
        rng = random.Random(secrets.randbits(64))
        selected = rng.sample(miners, min(len(miners), self.cfg.validator.miners_per_round))
        probes = [Probe(uid=n.uid, hotkey=n.hotkey, api=commitments[n.hotkey].api,
                        peer_id=commitments[n.hotkey].peer_id) for n in selected]
        self._mark_shared_peer_ids(probes, commitments)
        self._connect_peers(commitments)

        with ThreadPoolExecutor(max_workers=min(8, len(probes))) as pool:
            list(pool.map(self._status_of, probes))
        self._follow_the_swarm(probes)
        loss_before = self._eval_loss()
        self.tel.update(state=f"round {round_no}: Train queries")
        nonce = secrets.token_hex(16)
        # Our replica, described once per round: its sketch goes with every Train query, its RMS
        # scales every state-slice comparison.
        from dtrain.training.replica import params_rms

        self._round_sketch = self._params_sketch()
        self._round_rms = params_rms(self.trainer.params)
        with ThreadPoolExecutor(max_workers=min(8, len(probes))) as pool:
            list(pool.map(lambda p: self._probe(p, nonce), probes))
        for probe in probes:
            self._check_slice(probe)
        self._spot_moved_on(probes)
        t0 = time.perf_counter()
        for probe in probes:
            self._verify(probe, nonce)
        verify_s = time.perf_counter() - t0
        self._resync_if_alone(probes)

        # Every validator starts its all-reduce at the same point of the slot, however long its
        # checks took, so all of them meet the miners in one matchmaking window.
        self.tel.update(state=f"round {round_no}: waiting for the all-reduce")
        self.stop.wait(max(0.0, allreduce_start(self._slot_start, self.cfg.validator.round_interval_s) - time.time()))
        self.tel.update(state=f"round {round_no}: all-reduce")
        record, averaged = self._allreduce(probes, round_no)
        self._fellow_validators = fellow_validators(record, set(commitments_peer_ids(commitments)), self.swarm.peer_id)
        answers = [p.allreduce.epoch for p in probes if p.allreduce is not None]
        committed = [record.work_reports[p.peer_id].epoch for p in probes if p.peer_id in record.work_reports]
        overtaken = overtaken_by(record.ok, self.epoch, answers, asked=len(probes), committed_epochs=committed)
        self._overtaken_in_a_row = self._overtaken_in_a_row + 1 if overtaken is not None else 0
        if overtaken is not None and self._overtaken_in_a_row <= MAX_OVERTAKEN_IN_A_ROW:
            # Another validator's round ran without us (we were late to its group, or landed in a
            # later epoch's group): the miners are ahead, so this round is no evidence against
            # them. Catch up to their epoch and run the round again, scoring nothing now.
            self.tel.event(f"round {round_no}: the miners averaged epoch {self.epoch} in another validator's "
                           f"round and are at epoch {overtaken}; catching up, not scoring")
            self.tel.round_finished(record.to_dict())
            if self._catch_up(CatchUpTarget(epoch=overtaken)):
                self._save_checkpoint(uid=0)
            return False
        self.tel.update(state=f"round {round_no}: auditing committed work")
        t0 = time.perf_counter()
        self._audit(probes, record)
        audit_s = time.perf_counter() - t0
        self._update_probation(probes, round_no)
        self._take_step(record, averaged)
        loss_after = self._eval_loss() if record.ok else loss_before

        scores = self._score(probes, record, neurons)
        weights = self._set_weights(neurons)
        summary = self._summary(round_no, probes, record, scores, weights, loss_before, loss_after, verify_s)
        summary["audit_s"] = round(audit_s, 3)
        self.state.add_round(summary)
        from dtrain.validation.state import save_state

        save_state(self.state_path, self.state)
        self.tel.event(f"round {round_no}: {summary['status']}, {len(summary['participants'])} participants, "
                       f"eval loss {loss_before:.3f} -> {loss_after:.3f}")
        return True

    def _status_of(self, probe: Probe) -> None:
        from dtrain.api.client import ApiError

        try:
            probe.status = self.client.status(probe.api, timeout=10)
        except ApiError as exc:
            probe.train_error = f"status: {exc}"

    def _mark_shared_peer_ids(self, probes: list[Probe], commitments: dict) -> None:
        """Hotkeys that commit the same hivemind peer id cannot be told apart in a round: the
        copy would inherit the original's outcome. None of them is trusted."""
        from collections import Counter

        counts = Counter(c.peer_id for c in commitments.values())
        for probe in probes:
            if counts[probe.peer_id] > 1:
                probe.shared_peer_id = True
                probe.note = "peer id committed by several hotkeys"

    def _follow_the_swarm(self, probes: list[Probe]) -> None:
        """If most reachable miners are at a later epoch than ours, adopt a peer's state at it.

        Without this a validator that fell behind (restart from an older checkpoint, a second
        validator's round) could never verify anyone again. Epochs, not digests, are compared:
        honest replicas on other hardware differ in the last bits (docs/scoring.md).
        """
        from collections import Counter

        epochs = Counter(p.status.epoch for p in probes if p.status is not None and p.status.epoch is not None)
        if not epochs:
            return
        epoch, votes = epochs.most_common(1)[0]
        if epoch > self.epoch and votes * 2 > len(probes):
            self.tel.event(f"most miners are at epoch {epoch}, this validator at {self.epoch}: catching up")
            if self._catch_up(CatchUpTarget(epoch=epoch)):
                self._save_checkpoint(uid=0)

    def _resync_if_alone(self, probes: list[Probe]) -> None:
        """Same epoch, but most miners' parameters are beyond the replica tolerance from ours:
        this replica is the one that drifted. Take a peer's state at our epoch."""
        from dtrain.training.replica import within_tolerance

        # A miner that stepped while we read its slice did not drift, and neither did we.
        measured = [p.replica_distance for p in probes if p.replica_distance is not None and not p.moved_on]
        far = [d for d in measured if not within_tolerance(d)]
        if len(measured) >= 2 and len(far) * 2 > len(measured):
            self.tel.event(f"{len(far)} of {len(measured)} miners are beyond the replica tolerance from this "
                           "validator: resynchronising from peers")
            if self._catch_up(CatchUpTarget(epoch=self.epoch)):
                self._save_checkpoint(uid=0)

    def _spot_moved_on(self, probes: list[Probe]) -> None:
        """Ask again where the miners whose answers did not fit our epoch are now: one that has
        stepped since this round's status query was averaged by another validator's round in
        the middle of our checks, which makes those answers stale rather than wrong."""
        from dtrain.api.client import ApiError
        from dtrain.training.replica import within_tolerance
        from dtrain.validation.verification import moved_on_during_checks

        def suspicious(p: Probe) -> bool:
            if p.status is None or p.status.epoch != self.epoch or p.shared_peer_id:
                return False
            train_off = (p.train is None and bool(p.train_error)) or (p.train is not None and p.train.epoch != self.epoch)
            slice_off = p.replica_distance is not None and not within_tolerance(p.replica_distance)
            return train_off or slice_off

        def recheck(p: Probe) -> None:
            try:
                now = self.client.status(p.api, timeout=10)
            except ApiError:
                return
            if moved_on_during_checks(p.status.epoch, self.epoch, now.epoch):
                p.moved_on = True
                p.note = (f"moved to epoch {now.epoch} during this validator's checks (another validator's "
                          f"round averaged epoch {self.epoch} first)")

        todo = [p for p in probes if suspicious(p)]
        if todo:
            with ThreadPoolExecutor(max_workers=min(8, len(todo))) as pool:
                list(pool.map(recheck, todo))

    def _probe(self, probe: Probe, nonce: str) -> None:
        from dtrain.api.client import ApiError

        if probe.status is None or probe.shared_peer_id:
            return
        theirs = probe.status.swarm_fingerprint
        if theirs is not None and theirs != self.bench.swarm_fingerprint:
            # Its pages, model or optimizer step differ from ours: its work cannot be verified
            # here, and the all-reduce will refuse it as WRONG_MODEL. Say why in the round record.
            probe.note = (f"swarm-wide settings differ from this validator's (swarm fingerprint {theirs[:12]}, "
                          f"ours {self.bench.swarm_fingerprint[:12]}; docs/configuration.md)")
            return
        challenge = TrainRequest(nonce=nonce, epoch=self.epoch, pages=self.cfg.validator.pages_per_query,
                                 micro_batch_size=self.cfg.training.micro_batch_size, params_digest=self._digest,
                                 params_sketch=self._round_sketch)
        t0 = time.perf_counter()
        try:
            probe.train = self.client.train(probe.api, probe.hotkey, challenge, timeout=300)
        except ApiError as exc:
            probe.train_error = str(exc)
        probe.train_seconds = time.perf_counter() - t0
        # A random offset, and the bytes must be our own replica's: a miner cannot serve zeros
        # (or a cached blob) without holding the model.
        # Aligned to whole float32 values, so the slice can also be compared value by value.
        length = self.cfg.validator.slice_bytes
        offset = 4 * secrets.randbelow(max(1, sum(p.numel() for p in self.trainer.params)))
        try:
            dl = self.client.state_slice(probe.api, probe.hotkey, offset, length, timeout=60, keep_data=True)
        except ApiError as exc:
            probe.slice_bps, probe.slice_error = 0.0, str(exc)
            return
        probe.slice_bps = dl.bytes_per_second
        probe.slice_check = (offset, length, dl.data or b"", dl.bytes_received)

    def _verify(self, probe: Probe, nonce: str) -> None:
        """Recompute a random subset of the miner's micro-batches; fill ``probe.checks``."""
        from dtrain.training.data import assign_pages
        from dtrain.training.fingerprint import Fingerprint, compare_fingerprints
        from dtrain.training.trainer import recompute_fingerprints
        from dtrain.validation.scoring import check_from_comparison
        from dtrain.validation.verification import answer_problem, choose_recomputed, in_sync_problem

        if probe.moved_on:
            return  # its answers are stale: see _spot_moved_on
        if probe.train is None:
            probe.note = probe.note or probe.train_error or "no Train answer"
            return
        answer = probe.train
        problem = in_sync_problem(answer.epoch, self.epoch, probe.replica_distance)
        if problem:
            # Not a forgery we can prove, but nothing we can verify either: no credit.
            probe.note = problem
            return
        reader = self.bench.reader
        mbs = self.cfg.training.micro_batch_size
        pages = assign_pages(run_id=self.bench.run_id, uid=probe.uid, epoch=self.epoch, page_counter=0,
                             count=self.cfg.validator.pages_per_query, num_pages=reader.num_pages, nonce=nonce)
        tokens = reader.read_pages(pages)
        expected = math.ceil(tokens.shape[0] / mbs)
        micro = answer.microbatches
        problem, failed = answer_problem(len(micro), expected)
        if problem:
            probe.checks, probe.note = failed, problem
            return
        chosen = choose_recomputed(expected, self.cfg.validator.recompute_fraction, random.Random(secrets.randbits(64)))
        checks = []
        for index in chosen:
            x = tokens[index * mbs:(index + 1) * mbs]
            reference = recompute_fingerprints(self.bench.model, x, nonce=nonce, micro_batch_size=mbs,
                                               precision=self.trainer.precision)[0]
            report = micro[index]
            claimed = Fingerprint(loss=report.loss, sketch=report.sketch, samples=report.samples,
                                  nonce=report.nonce or "")
            cmp = compare_fingerprints(claimed, reference)
            checks.append(check_from_comparison(cmp, reference.loss))
            if not cmp.passed:
                probe.note = "; ".join(cmp.reasons)
        probe.checks = checks

    def _check_slice(self, probe: Probe) -> None:
        """The slice must be this model's parameters at that offset, within the replica tolerance
        (honest replicas differ in the last bits); its distance tells who drifted."""
        from dtrain.neurons.sync import state_slice
        from dtrain.training.replica import slice_distance, within_tolerance

        if probe.slice_check is None:
            return
        offset, length, data, received = probe.slice_check
        ours = state_slice(self.trainer, offset, length)
        distance = slice_distance(data, ours, self._round_rms) if received == len(ours) else math.inf
        probe.replica_distance = distance
        if not within_tolerance(distance):
            probe.slice_bps = 0.0
            probe.slice_error = "state slice does not match the model (beyond the replica tolerance)"

    def _weight_cap(self) -> float:
        """The most samples an honest miner brings to a round: its local batch (Train pages are
        computed aside and are not part of a contribution); in DiLoCo mode, H of them."""
        steps = self.cfg.allreduce.diloco_inner_steps if self.bench.inner is not None else 1
        return float(self.cfg.training.local_batch_size * steps)

    def _allreduce(self, probes: list[Probe], round_no: int):
        """Run the round with weight 0; return its record and the averaged gradient (not applied yet)."""
        from dtrain.api.client import ApiError
        from dtrain.training.trajectory import TrajectoryReport
        from dtrain.training.work import WorkReport, work_nonce
        from dtrain.validation.verification import on_probation, train_passed, weight_caps

        # The cap is what we verified: a miner whose Train answer failed, or whose committed work
        # failed an audit recently, gets no weight at all.
        caps = weight_caps({p.peer_id: train_passed(p.checks, shared_peer_id=p.shared_peer_id)
                            and not on_probation(self.state.probation, p.hotkey, round_no) for p in probes},
                           self._weight_cap())
        deadline = round_deadline_s(self.cfg.allreduce)
        request = AllReduceRequest(round_id=f"{self.bench.run_id}-{self.epoch}-{round_no}", epoch=self.epoch,
                                   weight_cap=self._weight_cap(), deadline_s=deadline, weight_caps=caps,
                                   params_digest=self._digest)
        self.tel.round_started({"round_id": request.round_id, "epoch": self.epoch, "miners": len(probes)})

        def ask(probe: Probe) -> None:
            try:
                probe.allreduce = self.client.allreduce(probe.api, probe.hotkey, request, timeout=deadline + 60)
            except ApiError as exc:
                probe.allreduce_error = str(exc)

        with ThreadPoolExecutor(max_workers=min(16, len(probes))) as pool:
            futures = [pool.submit(ask, p) for p in probes]
            tensors = [z.clone() for z in self.zeros]
            expected = sorted({p.peer_id for p in probes} | self._fellow_validators)
            record = self.swarm.run_round(tensors, weight=0.0, cap=0.0, expected_peers=expected, timeout_s=deadline,
                                          peer_caps=caps, stop=self.stop,
                                          work=(TrajectoryReport.empty(self.epoch) if self.bench.inner is not None
                                                else WorkReport(epoch=self.epoch)),
                                          work_nonce=work_nonce(self.bench.run_id, self.epoch))
            for f in futures:
                f.result()
        return record, tensors

    def _take_step(self, record, averaged) -> None:
        # Joining with weight 0, this replica receives the same average and takes the same step.
        if self._apply_round(record, averaged) is not None:
            self._save_checkpoint(uid=0)
            if record.fraction_averaged < 1.0:
                # Part of our replica kept local (zero) values: take a peer's state instead.
                self._catch_up()
        self.tel.round_finished(record.to_dict())

    def _update_probation(self, probes: list[Probe], round_no: int) -> None:
        from dtrain.validation.verification import update_probation

        failed = {p.hotkey: p.work is not None and not p.work.passed for p in probes}
        self.state.probation = update_probation(self.state.probation, failed, round_no)
        for probe in probes:
            until = self.state.probation.get(probe.hotkey)
            if until is not None and not failed[probe.hotkey]:
                probe.note = probe.note or f"on probation until round {until} (its committed work failed an audit)"

    def _audit(self, probes: list[Probe], record) -> None:
        """Recompute randomly chosen committed pages of every miner on the pre-step model."""
        from dtrain.training.data import assign_pages
        from dtrain.training.fingerprint import Fingerprint, compare_fingerprints
        from dtrain.training.trainer import recompute_page_work
        from dtrain.training.work import WORK_SKETCH_K, work_nonce
        from dtrain.validation.verification import check_page_ids, choose_audit_pages, judge_work, page_audit

        reader = self.bench.reader
        nonce = work_nonce(self.bench.run_id, self.epoch)
        # Drawn now, after every miner committed in the gather, from a secret it never sees.
        rng = random.Random(secrets.randbits(64))
        if self.bench.inner is not None:
            self._audit_trajectories(probes, record, rng)
            return
        for probe in probes:
            # parsed and checked by the averager; a malformed one was refused in the gather
            report = record.work_reports.get(probe.peer_id)
            if report is None or probe.shared_peer_id or not report.pages:
                continue

            def expected(counter: int, uid=probe.uid) -> int:
                return assign_pages(run_id=self.bench.run_id, uid=uid, epoch=self.epoch, page_counter=counter,
                                    count=1, num_pages=reader.num_pages)[0]

            id_problem = check_page_ids(report.pages, expected)
            audits = []
            if not id_problem:
                for index in choose_audit_pages(len(report.pages), self.cfg.validator.audit_pages, rng):
                    entry = report.pages[index]
                    reference = recompute_page_work(self.bench.model, reader.read_pages([entry.page]), nonce=nonce,
                                                    micro_batch_size=self.cfg.training.micro_batch_size,
                                                    precision=self.trainer.precision, k=WORK_SKETCH_K)
                    claimed = Fingerprint(loss=entry.loss, sketch=entry.sketch, samples=entry.samples)
                    audits.append(page_audit(entry, compare_fingerprints(claimed, reference)))
            probe.work = judge_work(report, id_problem, audits, expected_epoch=self.epoch)
            if not probe.work.passed:
                probe.note = probe.work.problem

    def _audit_trajectories(self, probes: list[Probe], record, rng: random.Random) -> None:
        """DiLoCo: check each miner's committed inner steps, and replay a random stretch of them
        from the snapshot before it (docs/protocol.md, "DiLoCo")."""
        from dtrain.training.data import assign_pages
        from dtrain.training.fingerprint import gradient_sketch
        from dtrain.training.replica import sketch_distance, within_tolerance
        from dtrain.training.work import WORK_SKETCH_K, work_nonce
        from dtrain.validation.verification import check_page_ids, judge_trajectory, trajectory_shape_problem

        reader = self.bench.reader
        nonce = work_nonce(self.bench.run_id, self.epoch)
        # The anchor every miner should have started from: ours (replicas differ in the last bits).
        anchor = gradient_sketch(list(self.trainer.params), nonce, k=WORK_SKETCH_K).tolist()
        for probe in probes:
            report = record.work_reports.get(probe.peer_id)
            # the averager refused a report of the other mode's kind in the gather (Commitment.parse)
            if report is None or probe.shared_peer_id or not report.steps:
                continue

            def expected(counter: int, uid=probe.uid) -> int:
                return assign_pages(run_id=self.bench.run_id, uid=uid, epoch=self.epoch, page_counter=counter,
                                    count=1, num_pages=reader.num_pages)[0]

            problem = (trajectory_shape_problem(report, inner_steps=self.cfg.allreduce.diloco_inner_steps,
                                                page_sequences=self.cfg.data.page_sequences)
                       or check_page_ids(report.pages, expected))
            if not problem and not within_tolerance(sketch_distance(report.start, anchor)):
                problem = "inner steps did not start from this epoch's shared parameters"
            audits, first = [], 0
            if not problem:
                problem, audits, first = self._replay_stretch(probe, report, rng, nonce)
            probe.work = judge_trajectory(report, expected_epoch=self.epoch, problem=problem, audits=audits,
                                          first_step=first)
            if not probe.work.passed:
                probe.note = probe.work.problem

    def _replay_stretch(self, probe: Probe, report, rng: random.Random, nonce: str):
        """Download the snapshot before a randomly chosen step, check it against its commitment
        and replay up to that step. Returns (problem, step audits, first replayed step - 1)."""
        from dtrain.api.client import ApiError
        from dtrain.training import snapshots
        from dtrain.training.fingerprint import Fingerprint, compare_fingerprints, gradient_sketch
        from dtrain.training.replay import replay_steps
        from dtrain.training.work import WORK_SKETCH_K
        from dtrain.validation.verification import (
            MOMENTS_RTOL, SNAPSHOT_RTOL, choose_replay_segment, sketch_mismatch, step_audit,
        )

        first, target = choose_replay_segment(len(report.steps), report.every, rng)
        commit = report.snapshot_at(first)
        inner = self.bench.inner
        size = snapshots.snapshot_nbytes(inner.params)
        data = bytearray()
        budget = SNAPSHOT_FIXED_S + size / SNAPSHOT_MIN_RATE
        deadline = time.monotonic() + budget
        try:
            while len(data) < size:
                # A miner that cannot serve what it committed is treated as having made it up:
                # one that could choose when to fail would dodge exactly the audits it fears.
                left = deadline - time.monotonic()
                if left <= 0:
                    return f"snapshot at inner step {first} not served within {budget:.0f} s", [], first
                dl = self.client.state_slice(probe.api, probe.hotkey, len(data), min(SNAPSHOT_CHUNK, size - len(data)),
                                             timeout=min(120.0, left), keep_data=True, snapshot=(self.epoch, first))
                if not dl.data:
                    break
                data += dl.data
            params, exp_avg, exp_avg_sq = snapshots.decode(data, [p.shape for p in inner.params])
        except (ApiError, snapshots.SnapshotError) as exc:
            return f"snapshot at inner step {first} not served ({exc})", [], first
        measured = gradient_sketch(params, nonce, k=WORK_SKETCH_K).tolist()
        if sketch_mismatch(report.params_sketch_after(first), measured, SNAPSHOT_RTOL):
            return f"snapshot at inner step {first} is not the committed parameters", [], first
        def moments_differ(committed, exp_avg, exp_avg_sq, rtol: float) -> bool:
            return any(sketch_mismatch(want, gradient_sketch(got, nonce, k=WORK_SKETCH_K).tolist(), rtol)
                       for want, got in ((committed.exp_avg, exp_avg), (committed.exp_avg_sq, exp_avg_sq)))

        if first > 0 and moments_differ(commit, exp_avg, exp_avg_sq, SNAPSHOT_RTOL):
            return f"snapshot at inner step {first} is not the committed optimizer state", [], first
        snapshots.load_inner_state(inner, params, exp_avg, exp_avg_sq, first)
        replayed = replay_steps(inner, report.steps[first:target], first_step=first, epoch=self.epoch,
                                inner_steps=self.cfg.allreduce.diloco_inner_steps,
                                read_page=lambda page: self.bench.reader.read_pages([page]), nonce=nonce,
                                k=WORK_SKETCH_K, warmup=self.cfg.allreduce.diloco_inner_warmup)
        audits = []
        for entry, mine in zip(report.steps[first:target], replayed):
            # The gradient tells the pages apart; the update, that AdamW was applied as committed.
            gradient = compare_fingerprints(Fingerprint(loss=entry.loss, sketch=entry.grad_sketch, samples=entry.samples),
                                            Fingerprint(loss=mine.loss, sketch=mine.grad_sketch, samples=mine.samples))
            update = compare_fingerprints(Fingerprint(loss=entry.loss, sketch=entry.sketch, samples=entry.samples),
                                          Fingerprint(loss=mine.loss, sketch=mine.sketch, samples=mine.samples))
            audits.append(step_audit(entry, gradient, update))
        following = report.snapshot_at(target)
        if following is not None and all(a.passed for a in audits):
            # The stretch ends where the next snapshot was taken: its committed moments must be
            # the ones these steps produce, or that snapshot's optimizer state was made up.
            _, exp_avg, exp_avg_sq = snapshots.inner_state(inner)
            if moments_differ(following, exp_avg, exp_avg_sq, MOMENTS_RTOL):
                return (f"the optimizer state committed at inner step {target} is not what steps {first + 1}-{target} "
                        "produce"), audits, first
        return "", audits, first

    def _score(self, probes: list[Probe], record, neurons) -> dict:
        from dtrain.swarm.records import Outcome
        from dtrain.validation.scoring import ScoringConfig, combined_scores, score_round, update_ema

        v = self.cfg.validator
        scfg = ScoringConfig(w_gradient=v.weight_gradient, w_steps=v.weight_steps, w_bandwidth=v.weight_bandwidth,
                             w_participation=v.weight_allreduce, ema_alpha=v.ema_alpha)
        from dtrain.validation.verification import excuse_moved_on, on_probation, round_input

        claimed_by_peer = {p.peer_id: p.weight_claimed for p in record.peers}
        inputs = {}
        for probe in probes:
            result = record.result_of(probe.peer_id)
            if result is not None:
                outcome = result.outcome
            else:
                outcome = Outcome.NOT_ALIVE if probe.status is None else Outcome.NON_PARTICIPATING
            probe.outcome = outcome.value
            if outcome != Outcome.SUCCESS and not probe.note:
                # say why the round did not count the miner (the swarm's reason, e.g. a lost part)
                probe.note = (result.reason if result is not None else "") or "did not join the all-reduce"
            # The all-reduce figures in a miner's reply are its own claims, so bandwidth is
            # scored on the state slice this validator timed (and checked) itself.
            miner_ahead = probe.status is not None and (probe.status.epoch or 0) > self.epoch
            in_a_row = self._moved_on_in_a_row.get(probe.hotkey, 0) + 1 if probe.moved_on else 0
            if in_a_row:
                self._moved_on_in_a_row[probe.hotkey] = in_a_row
            else:
                self._moved_on_in_a_row.pop(probe.hotkey, None)
            excused = excuse_moved_on(probe.moved_on, outcome, in_a_row)
            if excused:
                probe.note += "; not scored this round"
            # A reachable miner that did not answer the Train challenge (or answered out of
            # sync) gets an empty check: gated to 0, not "not measured".
            measured = not excused and (bool(probe.checks) or (probe.status is not None and not miner_ahead))
            inputs[probe.uid] = round_input(checks=list(probe.checks) if measured else None,
                                            shared_peer_id=probe.shared_peer_id, work=probe.work,
                                            claimed_weight=claimed_by_peer.get(probe.peer_id),
                                            outcome=None if excused else outcome,
                                            slice_bps=probe.slice_bps,
                                            probation=on_probation(self.state.probation, probe.hotkey,
                                                                   self.state.round_counter + 1))
        scores = score_round(inputs, scfg)
        hotkeys = {n.uid: n.hotkey for n in neurons}
        self.state.ema = update_ema(self.state.ema, combined_scores(scores), hotkeys, alpha=scfg.ema_alpha)
        for probe in probes:
            s = scores[probe.uid]
            self.state.last_scores[probe.uid] = {**s.as_dict(), "hotkey": probe.hotkey, "outcome": probe.outcome,
                                                 "note": probe.note, "ema": self.state.ema.scores.get(probe.uid, 0.0)}
        return scores

    def _set_weights(self, neurons) -> dict[int, float]:
        """Compute weights from the EMA and, when the rate limit allows, set them on chain."""
        from dtrain.chain.base import ChainError
        from dtrain.validation.weights import (
            WeightSetPolicy, compute_weights, record_failure, record_success, should_set,
        )

        miner_uids = [n.uid for n in neurons if not n.validator_permit]
        weights = compute_weights(self.state.ema.scores, miner_uids)
        if not weights:
            return {}
        try:
            status = self.chain.weights_status(self.uid)
            block = status.block
            policy = WeightSetPolicy(rate_limit_blocks=status.rate_limit if status.rate_limit is not None else 100)
        except ChainError:
            return weights  # the chain's health shows the outage; weights are set next round
        if should_set(policy, self.state.weight_set, block):
            uids = sorted(weights)
            try:
                self.chain.set_weights(uids, [weights[u] for u in uids])
                self.state.weight_set = record_success(self.state.weight_set, block)
                self.tel.event(f"weights set at block {block} for {len(uids)} miners")
            except ChainError as exc:
                self.state.weight_set = record_failure(policy, self.state.weight_set, block, str(exc))
                self.tel.event(f"setting weights failed ({exc}); retrying later")
        return weights

    def _summary(self, round_no, probes, record, scores, weights, loss_before, loss_after, verify_s) -> dict:
        rows = []
        for probe in probes:
            s = scores[probe.uid]
            rows.append({"uid": probe.uid, "hotkey": probe.hotkey, "outcome": probe.outcome,
                         "score": s.combined, "ema": self.state.ema.scores.get(probe.uid, 0.0),
                         "weight": weights.get(probe.uid, 0.0), "gated": list(s.gated), "note": probe.note,
                         "train_s": round(probe.train_seconds, 3)})
        self._update_miner_table(weights)
        participants = [r["uid"] for r in rows if r["outcome"] == "SUCCESS"]
        return {
            "round": round_no, "epoch": self.epoch, "round_id": record.round_id,
            "status": "success" if record.ok else "failed", "participants": participants,
            "duration_s": round(record.duration_s, 3), "allreduce_s": round(record.allreduce_s, 3),
            "bytes_sent": record.bytes_sent, "bytes_received": record.bytes_received,
            "fraction_averaged": record.fraction_averaged, "error": record.error,
            "loss_before": loss_before, "loss_after": loss_after, "verify_s": round(verify_s, 3),
            "train_query_s": round(sum(p.train_seconds for p in probes), 3), "miners": rows,
            "time": time.time(),
        }

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
        rows = []
        for uid, s in sorted(self.state.last_scores.items()):
            rows.append(MinerRow(uid=uid, hotkey=str(s.get("hotkey", "")), gradient=s.get("gradient"),
                                 steps=s.get("steps"), bandwidth=s.get("bandwidth"),
                                 allreduce=s.get("participation"), score=s.get("combined"),
                                 ema=self.state.ema.scores.get(uid, 0.0), weight=weights.get(uid, 0.0),
                                 last_outcome=str(s.get("outcome", "")), note=", ".join(s.get("gated") or [])
                                 or str(s.get("note", ""))))
        self.tel.set_miners(rows)

    def _restore_dashboard(self) -> None:
        from dtrain.validation.weights import compute_weights

        # After a restart the miner table shows the persisted scores straight away.
        self._update_miner_table(compute_weights(self.state.ema.scores))

