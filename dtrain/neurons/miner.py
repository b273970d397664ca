"""The miner neuron: train, answer validators, average gradients, push the model.

The training thread (the caller of :meth:`Miner.run`) owns the model: it trains on the miner's
assigned pages and runs every job the API hands it (Train queries and all-reduce rounds,
miner_api.py); the model-store pusher uploads in the background. What is trained between
rounds, what a contribution is and what step a round takes belong to the training mode
(``self.bench.mode``, dtrain.modes); the miner never asks which mode it is.
"""

from __future__ import annotations

import logging
import math
import threading
import time

from dtrain.api.messages import (
    AllReduceRequest, AllReduceResponse, MicroBatchReport, TrainRequest, TrainResponse,
)
from dtrain.config import Config
from dtrain.neurons.base import CatchUpTarget, NeuronBase
from dtrain.neurons.catch_up import CatchUps
from dtrain.neurons.jobs import JobQueue
from dtrain.neurons.miner_api import MinerApi
from dtrain.neurons.miner_rounds import MinerRounds
from dtrain.neurons.runtime import NeuronError, node_dir
from dtrain.training.errors import DataSourceError
from dtrain.telemetry import Telemetry

log = logging.getLogger("dtrain.miner")

PEER_REFRESH_S = 10.0
DATA_RETRY_S = 5.0


class Miner(NeuronBase):
    role = "miner"

    def __init__(self, cfg: Config, telemetry: Telemetry, stop: threading.Event, *,
                 max_rounds: int | None = None):
        super().__init__(cfg, telemetry, stop)
        self.max_rounds = max_rounds
        self.jobs = JobQueue()
        self.page_counter = 0  # pages of our own assignment trained this epoch
        self.rounds_done = 0
        self.catch_up = CatchUps(self)  # the catch-ups this miner owes (catch_up.py)
        self.rounds = MinerRounds(self)  # the rounds it joins from the DHT's notices (miner_rounds.py)
        self._refresh_now = threading.Event()  # report progress at once (after a round)
        self._checkpoint_due = False
        self._pending_commit = None
        self._post_round = False
        self._last_loss: float | None = None
        # The model card's facts about the round that produced the current epoch (publish.round_facts).
        self._card_round: dict | None = None
        self._data_retry_at = 0.0
        self._busy_s = 0.0  # time in training steps of own pages (benchmarks/utilization.py)
        self.server = self.pusher = self.node = self.swarm = None

    # ------------------------------------------------------------------ lifecycle

    def run(self) -> int:
        cfg = self.cfg
        from dtrain.neurons import runtime

        self.tel.update(state="loading wallet", network=cfg.chain.network, netuid=cfg.chain.netuid)
        wallet = runtime.load_wallet(cfg)
        self.hotkey = wallet.hotkey.ss58_address
        # Model, tokenizer and data first: a missing one is a local problem with a local fix,
        # reported at once rather than after the chain (which may be down) has been reached.
        self.tel.update(hotkey=self.hotkey)
        ok, self.bench = self._with_input_retries(self._build_workbench, "loading the tokenizer and model")
        if not ok:
            return 0  # stopped (Ctrl-C) while the Hub was unreachable
        if not self._with_input_retries(self.bench.reader.open, "opening the dataset")[0]:
            return 0  # stopped (Ctrl-C) while the data source was unavailable
        self.tel.update(state="connecting to chain")
        self._open_chain(wallet)
        self.uid = self._wait_for_registration(need_permit=False)
        if self.uid is None:
            return 0  # stopped (Ctrl-C) while waiting for registration
        self.dir = node_dir(cfg, "miner", self.hotkey)
        self.tel.update(uid=self.uid)
        self.trainer = self.bench.trainer
        if self._resume(uid=self.uid):
            self.tel.event(f"resumed from checkpoint at epoch {self.epoch}, step {self.trainer.counters.inner_step}")
        self.bench.mode.open_store(self.dir / "snapshots")
        self._start_epoch()
        self.tel.event(f"model {cfg.model.preset}: {self.bench.param_count:,} parameters, "
                       f"tokenizer {self.bench.tokenizer_info.name}, fingerprint {self.bench.fingerprint[:12]}")

        self.tel.update(state="joining swarm")
        try:
            # Anything that fails from here on still tears down what was started.
            self._start_swarm(self._commitments())
            self._swarm_started()
            self.server, self.api_address = MinerApi(self).start()
            self.tel.update(api=self.api_address)
            self._commit()
            self._start_pusher()
            self._start_refresher()
            self.rounds.start(self.stop)
            self.tel.update(state="training")
            self._loop()
        finally:
            self._shutdown()
        return 0

    def _swarm_started(self) -> None:
        # Read at each start, not per request: /v1/status is public, and each read would be a
        # round trip to the DHT process. A restarted node may listen elsewhere: peers read it here.
        self._maddrs = list(self.node.last_maddrs)
        self._start_progress()

    def _commit(self) -> None:
        from dtrain.chain.base import ChainError
        from dtrain.chain.commitment import CommitmentError, MinerCommitment

        try:
            record = MinerCommitment(peer_id=self.node.peer_id, api=self.api_address,
                                     repo=self.cfg.hub.repo or "none")
        except CommitmentError as exc:
            raise NeuronError(f"cannot announce this miner on chain: {exc} (check api.external_address and "
                              "hub.repo)") from None
        try:
            self.chain.commit(record)
            self.tel.event(f"committed peer {record.peer_id[:12]}… api {record.api}")
        except ChainError:
            # Keep training (the chain's health shows the outage); the peer refresher
            # commits again once the chain answers.
            self._pending_commit = record
            return
        self._pending_commit = None

    def _start_pusher(self) -> None:
        self.pusher = None
        if not (self.cfg.hub.repo and self.cfg.miner.push_after_round):
            return
        from dtrain.hub.pusher import BackgroundPusher
        from dtrain.neurons.publish import open_configured_store

        store = open_configured_store(self.cfg)
        self.pusher = BackgroundPusher(store, self.dir / "push-staging",
                                       retry_interval=max(1.0, self.cfg.hub.backoff_s)).start()

    def _shutdown(self) -> None:
        self.tel.update(state="stopping")
        self.stop.set()  # also ends the peer refresher
        from dtrain.api.server import HandlerError

        # Refuse new jobs and answer waiting handlers first, so stopping the server never
        # waits on a handler that waits on the (no longer running) training loop.
        self.jobs.close(HandlerError(503, "miner is shutting down"))
        steps = [lambda: self.server and self.server.stop(),
                 lambda: self.pusher and self.pusher.stop(drain=True, timeout=30)]
        if self.swarm is not None:
            steps.insert(0, self._checkpoint)
        for step in steps:
            try:
                step()
            except Exception as exc:  # keep tearing down; report what failed
                log.warning("shutdown step failed: %r", exc)
        if self.swarm is not None:
            self._stop_swarm()
        self.tel.update(state="stopped")
        self._write_status()

    # ------------------------------------------------------------------ main loop

    def _loop(self) -> None:
        last_status = 0.0
        while not self.stop.is_set():
            self._watch_swarm()  # rounds run on this thread too: never in the middle of one
            self.jobs.run_pending()
            if self._post_round:
                # After the validator has its answer: disk work never delays a round's reply.
                # The checkpoint and the push read only the shared replica: before the epoch's
                # local state is back in memory (docs/operators.md, "Memory per parameter").
                self._post_round = False
                if self.epoch % self.cfg.miner.checkpoint_every == 0:
                    self._checkpoint()
                self._push()
                # The round moved the shared replica: local training restarts from it. Always,
                # even with a catch-up pending below: that catch-up may fail, and DiLoCo's inner
                # copy must never go on from an anchor the swarm has left.
                self._start_epoch()
                self._refresh_now.set()  # validators expect the miners whose progress shows our epoch
            if self.catch_up.due():
                self.catch_up.run_pending()
            if self._checkpoint_due:
                self._checkpoint_due = False
                self._checkpoint()
            if self.max_rounds is not None and self.rounds_done >= self.max_rounds:
                break
            request = self.rounds.due() if self._joins_rounds() else None  # checked or not, every round
            if request is not None:
                try:
                    self._do_round(request)
                finally:
                    self.rounds.finished()
                continue
            if self._wants_more_data():
                self._train_own_page()
            else:
                self.jobs.run_pending(wait_s=0.2)
            now = time.monotonic()
            if now - last_status > 1.0:
                self._refresh_status()
                last_status = now

    # ------------------------------------------------------------------ seams
    # What a miner does at each step of the protocol, one method each, so that the cheating
    # miners of dtrain.sandbox.adversary override a seam instead of branching in here.

    def _build_workbench(self):
        from dtrain.neurons import runtime

        return runtime.build_workbench(self.cfg)

    def _challenge_fingerprints(self, request: TrainRequest, pages: list[int]) -> list:
        """Per-micro-batch fingerprints of a Train challenge's pages, on the current model.

        Computed aside (autograd.grad, exactly as the validator recomputes): challenge pages
        are the validator's test, not part of this miner's contribution to the round.
        """
        from dtrain.api.server import HandlerError
        from dtrain.training.trainer import recompute_fingerprints

        try:
            tokens_in = self.bench.reader.read_pages(pages)
        except DataSourceError as exc:
            raise HandlerError(503, f"data unavailable: {exc}") from None
        with self.model_lock:
            return recompute_fingerprints(self.bench.model, tokens_in, nonce=request.nonce,
                                          micro_batch_size=request.micro_batch_size,
                                          precision=self.trainer.precision)

    def _challenge_uid(self) -> int:
        """Whose pages a Train challenge asks for: this miner's."""
        return self.uid

    def _joins_rounds(self) -> bool:
        return True

    def _contribution(self, samples: int, weight_cap: float, out=None):
        """The mode's Contribution (tensors, weight, work report) this miner puts into a round,
        computed into ``out`` (the swarm's round buffers) when given."""
        return self.bench.mode.contribution(samples, weight_cap, out=out)

    def _samples_this_epoch(self) -> int:
        """Samples this miner's contribution to the next round stands for."""
        return self.bench.mode.samples

    def _read_own_page(self, page: list[int]):
        """The tokens of one of this miner's own pages."""
        return self.bench.reader.read_pages(page)

    def _wants_more_data(self) -> bool:
        if time.monotonic() < self._data_retry_at:
            return False
        return self.bench.mode.wants_data

    def _start_epoch(self) -> None:
        """Begin the epoch's local training from the shared replica (a new epoch, a resume or a
        catch-up); page counters restart with each epoch's fresh permutation."""
        with self.model_lock:
            self.bench.mode.start_epoch(self.epoch)
            self.page_counter = 0

    def _train_own_page(self) -> None:
        from dtrain.training.data import assign_pages

        reader = self.bench.reader
        page = assign_pages(run_id=self.bench.run_id, uid=self.uid, epoch=self.epoch, page_counter=self.page_counter,
                            num_pages=reader.num_pages, count=1)
        t0 = time.perf_counter()
        try:
            tokens_in = self._read_own_page(page)
        except DataSourceError as exc:
            # A streaming hiccup (e.g. a Hub timeout) costs one page, not the miner.
            self.tel.event(f"data page {page[0]} unavailable ({exc}); skipping it, retrying in {DATA_RETRY_S:.0f}s")
            self.page_counter += 1
            self._data_retry_at = time.monotonic() + DATA_RETRY_S
            return
        with self.model_lock:
            trained = self.bench.mode.train_page(tokens_in, page=page[0], counter=self.page_counter, epoch=self.epoch)
            progress = self.bench.mode.progress()
        self.page_counter += 1
        elapsed = max(time.perf_counter() - t0, 1e-9)
        self._busy_s += elapsed
        self._last_loss = trained.loss
        self.tel.train_metrics(loss=trained.loss, tokens_per_s=trained.samples * self.cfg.model.seq_len / elapsed,
                               lr=progress.lr, epoch=self.epoch, inner_step=progress.inner_step,
                               samples=progress.samples, tokens=progress.tokens,
                               samples_accumulated=progress.samples_accumulated, local_batch=progress.local_batch,
                               train_busy_s=self._busy_s)

    # ------------------------------------------------------------------ API handlers (server threads)

    def _do_train(self, request: TrainRequest) -> TrainResponse:
        from dtrain.api.server import HandlerError
        from dtrain.training.data import assign_pages

        sketch = tuple(request.params_sketch) if request.params_sketch else None
        if request.epoch == self.epoch and sketch and not self._near(sketch):
            # Same epoch, but this replica is past the replica tolerance (docs/scoring.md), e.g.
            # after a round that lost a part on its way here: not this miner's doing.
            # Resynchronise from the swarm first and answer from there, rather than fail the
            # query and be paid less for someone else's fault.
            self.catch_up.heal_before_answering(CatchUpTarget(epoch=self.epoch, sketch=sketch))
        if request.epoch != self.epoch:
            # Behind (it missed a round) or ahead: a different replica altogether. Catching up
            # means a whole round's state, which the query does not wait for.
            self.catch_up.if_behind(request.epoch, sketch)
            raise HandlerError(409, f"miner is at epoch {self.epoch}, the query is for epoch {request.epoch}")
        if sketch and not self._near(sketch):
            raise HandlerError(409, "this miner's parameters differ from the validator's by more than the replica "
                                    "tolerance; resynchronising from peers")
        reader = self.bench.reader
        pages = assign_pages(run_id=self.bench.run_id, uid=self._challenge_uid(), epoch=self.epoch, page_counter=0,
                             count=request.pages, num_pages=reader.num_pages, nonce=request.nonce)
        mbs = request.micro_batch_size
        prints = self._challenge_fingerprints(request, pages)
        micro = tuple(
            # Each report names the page its micro-batch's first sequence came from.
            MicroBatchReport(page=pages[min(i * mbs // self.cfg.data.page_sequences, len(pages) - 1)],
                             loss=fp.loss, sketch=tuple(fp.sketch), samples=fp.samples, nonce=fp.nonce)
            for i, fp in enumerate(prints))
        return TrainResponse(uid=self.uid, epoch=self.epoch, samples_total=self._samples_this_epoch(),
                             params_digest=self._digest, microbatches=micro)

    def _do_round(self, request: AllReduceRequest) -> AllReduceResponse:
        self._watch_swarm(ping=False)  # a dead averager or DHT would fail the round after its whole timeout
        earlier = self.rounds.answered(request, self.epoch)
        if earlier is not None:
            return earlier
        if request.epoch != self.epoch:
            self.catch_up.if_behind(request.epoch, None)
            return AllReduceResponse(joined=False, epoch=self.epoch, round=None,
                                     reason=f"miner is at epoch {self.epoch}, round is for epoch {request.epoch}")
        from dtrain.training.work import work_nonce

        round_epoch = self.epoch
        samples = self._samples_this_epoch()
        with self.model_lock:
            contribution = self.round_swarm.into_buffers(
                lambda out: self._contribution(samples, request.weight_cap, out=out))
        mean, weight, report = contribution.tensors, contribution.weight, contribution.report
        # With per-peer caps, a peer the validator did not list (it did not verify it) gets none.
        peer_caps = request.weight_caps or {}
        default_cap = 0.0 if peer_caps else request.weight_cap
        self.tel.round_started({"round_id": request.round_id, "epoch": self.epoch, "weight": weight})
        if request.refused:
            # a validator's round audit caught them: we vote to bench them as reducers
            self.swarm.name_refused(request.refused)
        nonce = work_nonce(self.bench.run_id, self.epoch)
        if self.model_rounds is not None:
            record = self._announced_round(request, mean, weight, report, nonce, samples * self.cfg.model.seq_len)
        else:
            record = self.swarm.run_round(mean, weight=weight, cap=default_cap,
                                          tokens=samples * self.cfg.model.seq_len,
                                          timeout_s=request.deadline_s, peer_caps=peer_caps, stop=self.stop,
                                          work=report, work_nonce=nonce)
        self.rounds.vet(record)
        metrics = self._apply_round(record, mean)
        self.round_swarm.release_buffers()  # the average is applied (or not ours to): 4 bytes/param back
        if metrics is None and self._group_went_on_without_us(record):
            # The others took this round's step: we are a round behind from now on, and the
            # next validator's Train query would find us at the old epoch. Catch up now, not
            # when that query tells us.
            self.catch_up.schedule(CatchUpTarget(epoch=round_epoch + 1))
        if metrics is not None:
            from dtrain.neurons.publish import round_facts

            self._card_round = round_facts(record, metrics, epoch=self.epoch, seq_len=self.cfg.model.seq_len)
            self.page_counter = 0  # page counters restart with each epoch's fresh permutation
            if not record.in_step:
                # Part of the vector kept local values: this replica may now differ from others.
                # (A refused reducer's share is zeros on every honest peer: no catch-up for it,
                # which could only fetch a state that differs, the refused reducer's own.)
                self.catch_up.schedule(CatchUpTarget())
            if math.isfinite(metrics.loss):
                self.tel.train_metrics(loss=metrics.loss, tokens_per_s=metrics.tokens_per_s,
                                       grad_norm=metrics.grad_norm, lr=metrics.lr, epoch=self.epoch,
                                       inner_step=metrics.inner_step, samples_accumulated=0)
            else:  # nothing was trained locally (e.g. only averaged gradients): no loss to report
                self.tel.update(epoch=self.epoch, inner_step=metrics.inner_step, samples_accumulated=0,
                                grad_norm=metrics.grad_norm, lr=metrics.lr)
            self._post_round = True
        self.rounds_done += 1
        self.rounds.finished()
        self.tel.round_finished(record.to_dict())
        answer = AllReduceResponse(joined=not record.error, epoch=self.epoch, round=record.to_dict())
        self.rounds.ran(request, answer, applied=metrics is not None)
        return answer

    def _announced_round(self, request: AllReduceRequest, mean, weight: float, report, nonce: str, tokens: int):
        """Our record of the round on dtrain's own protocol: we declare at its announcer (named by
        the validator's query or the notice we joined from) and average with the signed membership."""
        from dtrain.swarm.records import RoundRecord

        announcer = request.announcer or self.rounds.announcer
        if not announcer:
            return RoundRecord(round_id=request.round_id, local_peer_id=self.model_rounds.peer_id,
                               started_at=time.time(), error="the query names no announcer to declare at")
        return self.model_rounds.run_round(mean, weight, round_id=request.round_id, epoch=request.epoch,
                                           announcer=announcer, work=report, work_nonce=nonce, tokens=tokens,
                                           stop=self.stop)

    def _group_went_on_without_us(self, record) -> bool:
        """Whether the group of a round we did not take the step of averaged without us (we
        were refused or left out): the rest of the swarm moves to the next epoch."""
        mine = record.outcome_of(record.local_peer_id)
        others = sum(p.weight_used for p in record.peers if p.peer_id != record.local_peer_id)
        return len(record.group) > 1 and mine is not None and mine.value != "SUCCESS" and others > 0

    # ------------------------------------------------------------------ helpers

    def _start_refresher(self) -> None:
        """Chain reads, peer dialing and progress exchange, off the training thread."""

        def loop() -> None:
            while not self.stop.is_set():
                try:
                    self._refresh_peers()
                except Exception as exc:  # a failed refresh is retried at the next tick
                    log.debug("peer refresh failed: %r", exc)
                self._refresh_now.wait(PEER_REFRESH_S)
                self._refresh_now.clear()

        threading.Thread(target=loop, name="dtrain-peer-refresh", daemon=True).start()

    def _refresh_peers(self) -> None:
        if self._pending_commit is not None:
            self._commit()
        self._connect_peers(self._commitments())
        # Progress on the DHT names whom validators expect in a round; it never triggers a
        # catch-up (any peer can write there).
        snap = self.tel.snapshot()
        self._exchange_progress(snap.samples_accumulated, snap.tokens_per_s / max(self.cfg.model.seq_len, 1))

    def _checkpoint(self) -> None:
        self._save_checkpoint(uid=self.uid)
        # What `dtrain push` (another process, maybe offline) needs to publish this checkpoint
        # as the same complete repo the background pusher uploads: the tokenizer's files and
        # the round facts for the model card. Losing them only costs the card some facts.
        from dtrain.training.checkpoint import save_publish_info

        try:
            save_publish_info(self.dir / "checkpoints", tokenizer=self.bench.reader.tokenizer,
                              facts={"tokenizer": self.bench.tokenizer_info.name, "last_round": self._card_round})
        except Exception as exc:  # noqa: BLE001 - the checkpoint itself is saved; keep training
            log.warning("publishing info not saved with the checkpoint: %r", exc)

    def _push(self) -> None:
        if self.pusher is not None:
            from dtrain.neurons.publish import push_after_round

            push_after_round(self)

    def _refresh_status(self) -> None:
        """Mirror the pusher's health into telemetry and rewrite status.json (for dtrain status)."""
        if self.pusher is not None:
            st = self.pusher.status()
            self.tel.health("hub", ok=st.consecutive_failures == 0, detail=st.last_error or "")
            if st.last_success_tag:
                self.tel.update(last_push=st.last_success_tag)
        self._write_status()
