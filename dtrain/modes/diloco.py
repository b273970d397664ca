"""DiLoCo mode (``allreduce.mode = "diloco"``): H local steps on an inner copy of the model,
then one averaged pseudo-gradient (anchor - inner parameters) and one outer Nesterov step on the
shared replica, the epoch's *anchor*. A validator audits a trajectory's shape, page ids and
start, then replays one stretch of it from the snapshot before it (:meth:`DiLoCo.audit`).

The two copies, the carried moments and the audit: docs/swarm.md ("DiLoCo"), docs/protocol.md
("DiLoCo") and docs/training.md ("Training modes").
"""

from __future__ import annotations

import copy
import logging
import random
import time
from collections.abc import Sequence
from pathlib import Path

from dtrain.modes.base import AuditRequest, Contribution, Mode, ModeSettings, PageTrained, Progress

log = logging.getLogger(__name__)

# A snapshot is downloaded in pieces of this size (the miner's per-request limit is 64 MiB).
SNAPSHOT_CHUNK = 16 << 20
# The whole download must finish within SNAPSHOT_FIXED_S plus its size at SNAPSHOT_MIN_RATE
# (4 MiB/s, 34 Mbit/s: about 6 min for gpt2-124m's 1.5 GB): audits run one miner after
# another before the round's step, so a miner must not be able to stall them chunk by chunk.
SNAPSHOT_FIXED_S, SNAPSHOT_MIN_RATE = 30.0, 4 << 20


def outer_trainer_config(settings: ModeSettings, device: str):
    """The anchor's optimizer: SGD with Nesterov momentum at a constant rate, no clipping and
    no weight decay (both belong to the inner AdamW steps)."""
    from dtrain.training.trainer import TrainerConfig

    return TrainerConfig(
        micro_batch_size=settings.micro_batch_size, local_batch_size=settings.local_batch_size,
        optimizer="nesterov", lr=settings.outer_lr, momentum=settings.outer_momentum, weight_decay=0.0,
        warmup_steps=0, total_steps=1, min_lr_ratio=1.0, grad_clip=None, precision=settings.precision,
        device=device)


class DiLoCo(Mode):
    name = "diloco"

    def __init__(self, settings: ModeSettings, model, device: str, reader, *, fused: bool | None = None):
        from dtrain.training.trainer import Trainer
        from dtrain.training.trajectory import TrajectoryLog

        anchor = Trainer(model, outer_trainer_config(settings, device))
        super().__init__(settings, anchor, reader)
        self.inner = Trainer(copy.deepcopy(anchor.model), settings.local_trainer_config(device, fused))
        self.trajectory = TrajectoryLog(settings.run_id, settings.snapshot_every)
        self._step_pages: list[tuple[int, int]] = []  # (counter, page) of the inner step being accumulated
        # (epoch, steps) of the last contribution: start_epoch keeps the moments only for the
        # epoch after it, with no step taken since (the state its carry commits to)
        self._committed_end: tuple[int, int] | None = None
        # a validator's memory: uid -> {epoch: carry} of the trajectories it audited in the last two
        # epochs, what the miner's next epoch may start from (verification.start_moments_problem)
        self._carries: dict[int, dict] = {}
        self._offload_dir: str | None = None  # where a miner's idle state goes (open_store)

    # ---------------------------------------------------------------- training

    def start_epoch(self, epoch: int) -> None:
        """Restart the inner copy from the anchor: the trajectory a validator can replay begins
        here. A snapshot of it (12 bytes per parameter) is written.

        The AdamW moments are kept when they are exactly the ones this miner committed at the
        end of the previous epoch (its ``carry``, in the gather of the round that ended it):
        that is what a validator can check the new epoch's start against. Anything else (the
        first epoch, a resume, a catch-up, a round that did not move us on by one epoch, a step
        taken after the commitment) starts from fresh moments, which need no history.
        """
        # the outer momentum is idle until the next round's step, and out before the inner copy is in
        self._offload(self.trainer, parameters=False)
        committed = self._committed_end
        keep = committed == (epoch - 1, self.trajectory.steps_done) and self.trajectory.epoch == epoch - 1
        t0 = self.trajectory.t0 + self.trajectory.steps_done if keep else 0
        self.inner.copy_parameters_from(self.trainer.params)
        if not keep:
            self.inner.reset_optimizer_state()
        # A part batch left when the round came was taken at the old parameters and is in no
        # committed step: it must not go into this epoch's first one.
        self.inner.zero_grad()
        self._committed_end = None
        self.trajectory.start(epoch, self.inner.params, t0=t0)
        self._step_pages = []
        self._keep_snapshot()
        self.store.prune(epoch)

    @property
    def wants_data(self) -> bool:
        return self.trajectory.steps_done < self.settings.inner_steps

    def train_page(self, tokens, *, page: int, counter: int, epoch: int) -> PageTrained:
        """Add one own page to the inner step; take the step once the local batch is full."""
        from dtrain.training.replay import position_inner_lr

        H = self.settings.inner_steps
        inner = self.inner
        self._offload(self.trainer, parameters=False)  # (again, if a checkpoint or a peer's download took it back)
        results = inner.accumulate(tokens)
        self._step_pages.append((counter, page))
        metrics = None
        if inner.local_batch_full:
            samples = inner.accumulated_samples
            grad_sketch = self.trajectory.gradient_sketch(inner.gradients())
            position_inner_lr(inner, epoch=epoch, inner_steps=H, step_index=self.trajectory.steps_done,
                              warmup=self.settings.inner_warmup, steps_before=self.trajectory.t0)
            metrics = inner.step()
            self.trajectory.record_step(counters=[c for c, _ in self._step_pages],
                                        pages=[p for _, p in self._step_pages], samples=samples,
                                        loss=metrics.loss, params=inner.params, grad_sketch=grad_sketch)
            self._step_pages = []
            if self.trajectory.snapshot_due() and self.trajectory.steps_done < H:
                self._keep_snapshot()
            if self.trajectory.steps_done >= H:
                self._offload(inner, parameters=True)  # idle until the round's contribution
        loss = metrics.loss if metrics is not None else sum(r.loss for r in results) / len(results)
        return PageTrained(loss=loss, samples=sum(r.samples for r in results), step=metrics)

    @property
    def samples(self) -> int:
        return self.trajectory.samples

    def progress(self) -> Progress:
        inner = self.inner
        return Progress(lr=inner.lr, inner_step=self.trajectory.steps_done, samples=inner.counters.samples,
                        tokens=inner.counters.tokens,
                        samples_accumulated=self.trajectory.samples + inner.accumulated_samples,
                        local_batch=self.settings.local_batch_size * self.settings.inner_steps)

    def _keep_snapshot(self) -> None:
        """Store the inner state now and commit its moments' sketches."""
        from dtrain.training import snapshots

        params, exp_avg, exp_avg_sq = snapshots.inner_state(self.inner)
        self.store.save(self.trajectory.epoch, self.trajectory.steps_done, params, exp_avg, exp_avg_sq)
        self.trajectory.record_snapshot(exp_avg, exp_avg_sq)

    # ---------------------------------------------------------------- contribution

    def contribution(self, samples: int, weight_cap: float, out=None) -> Contribution:
        # The pseudo-gradient: anchor - parameters after the inner steps (the sign of a gradient).
        import torch

        from dtrain.modes.base import computed_into
        from dtrain.training import snapshots

        self.inner.resident()
        pseudo = computed_into(out, torch.sub, self.trainer.params, self.inner.params)
        traj = self.trajectory
        carry = None
        if traj.steps_done:
            # the moments the next epoch may start from, committed with this report
            _, exp_avg, exp_avg_sq = snapshots.inner_state(self.inner)
            carry = traj.carry(exp_avg, exp_avg_sq)
            self._committed_end = (traj.epoch, traj.steps_done)
        report = traj.report(carry)
        self._offload(self.inner, parameters=True)  # idle while the round averages
        return Contribution(pseudo, float(min(samples, report.samples, weight_cap)), report)

    def _offload(self, trainer, *, parameters: bool) -> None:
        """A miner's idle state goes to disk (open_store named where); a validator keeps all."""
        if self._offload_dir is not None:
            trainer.offload(self._offload_dir, parameters=parameters)

    # ---------------------------------------------------------------- validating

    @property
    def weight_cap(self) -> float:
        return float(self.settings.local_batch_size * self.settings.inner_steps)

    def empty_report(self, epoch: int):
        from dtrain.training.trajectory import TrajectoryReport

        return TrajectoryReport.empty(epoch)

    def audit(self, requests: Sequence[AuditRequest], *, epoch: int, rng: random.Random) -> list:
        """Check each miner's committed inner steps, and replay a random stretch of them from the
        snapshot before it (docs/protocol.md, "DiLoCo"); with ``batch_audit_probability``, replay
        all of them and check the pseudo-gradient the miner sent against the replay under the
        round audit's secret seed (``req.sent``; dtrain.swarm.averaging.audit.batch_problem)."""
        from dtrain.sketch import gradient_sketch
        from dtrain.training.replica import sketch_distance, within_tolerance
        from dtrain.sketch import WORK_SKETCH_K
        from dtrain.training.work import work_nonce
        from dtrain.validation.verification import (
            check_page_ids, judge_trajectory, start_moments_problem, trajectory_shape_problem,
        )

        s = self.settings
        nonce = work_nonce(s.run_id, epoch)
        # The anchor every miner should have started from: ours (replicas differ in the last bits).
        anchor = gradient_sketch(list(self.trainer.params), nonce, k=WORK_SKETCH_K).tolist()
        verdicts = []
        for req in requests:
            report = req.report
            seen = self._carries.setdefault(req.uid, {})
            remembered = (epoch - 1, seen[epoch - 1]) if epoch - 1 in seen else None
            if report is not None and report.epoch == epoch:
                # What its next epoch may start from (checked then, whatever this audit finds now;
                # None: it took no step, so nothing). Kept per epoch: a round that fails is audited
                # again at the same epoch, and must not replace the commitment it is checked against.
                seen[epoch] = report.carry
                for old in [e for e in seen if e < epoch - 1]:
                    del seen[old]
            # the averager refused a report of the other mode's kind in the gather (Commitment.parse)
            if report is None or not report.steps:
                verdicts.append(None)
                continue
            problem = (trajectory_shape_problem(report, inner_steps=s.inner_steps, page_sequences=s.page_sequences)
                       or check_page_ids(report.pages, self.expected_page(req.uid, epoch)))
            if not problem and not within_tolerance(sketch_distance(report.start, anchor)):
                problem = "inner steps did not start from this epoch's shared parameters"
            if not problem:
                problem, checked = start_moments_problem(report, remembered, epoch=epoch)
                if not checked:
                    log.info("uid %d starts epoch %d from carried moments this validator saw no commitment for "
                             "(not in the previous round): its start is checked by the validators that were",
                             req.uid, epoch)
            audits, first = [], 0
            if not problem:
                whole = req.sent is not None and rng.random() < s.batch_audit_probability
                segment = (0, len(report.steps)) if whole else None
                problem, audits, first, start = self.replay_stretch(req, epoch=epoch, rng=rng, nonce=nonce,
                                                                    segment=segment)
                if whole and not problem and all(a.passed for a in audits):
                    problem = self._batch_problem(start, req.sent)
                    log.info("uid %d: whole trajectory replayed for the round audit: %s", req.uid,
                             problem or "it gives what the miner sent")
            verdicts.append(judge_trajectory(report, expected_epoch=epoch, problem=problem, audits=audits,
                                             first_step=first))
        return verdicts

    def _batch_problem(self, start, sent) -> str:
        """"" when the pseudo-gradient of the replayed trajectory (``start``, the parameters it
        started from, minus where the replay ended) is what the miner sent (audit.batch_problem)."""
        from dtrain.swarm.averaging.audit import batch_problem

        pseudo = [(a.detach().float() - p.detach().float()).cpu() for a, p in zip(start, self.inner.params)]
        return batch_problem(pseudo, sent)

    def replay_stretch(self, req: AuditRequest, *, epoch: int, rng: random.Random, nonce: str,
                       segment: tuple[int, int] | None = None):
        """Download the snapshot before a randomly chosen step (or before ``segment``: (first,
        last) steps, as choose_replay_segment gives them), check it against its commitment and
        replay up to that step on the inner copy. Returns (problem, step audits, first replayed
        step - 1, the snapshot's parameters the replay started from; None when it did not)."""
        from dtrain.sketch import WORK_SKETCH_K
        from dtrain.training.replay import replay_steps
        from dtrain.validation.verification import choose_replay_segment

        report = req.report
        first, target = segment if segment is not None else choose_replay_segment(len(report.steps), report.every, rng)
        problem, params = self._load_snapshot(req, epoch=epoch, first=first, nonce=nonce)
        if problem:
            return problem, [], first, None
        if segment is not None:  # a whole replay's start is compared after it: kept aside
            params = [p.clone() for p in params]
        s = self.settings
        replayed = replay_steps(self.inner, report.steps[first:target], first_step=first, epoch=epoch,
                                inner_steps=s.inner_steps, read_page=lambda page: self.reader.read_pages([page]),
                                nonce=nonce, k=WORK_SKETCH_K, warmup=s.inner_warmup, steps_before=report.t0)
        audits = _step_audits(report.steps[first:target], replayed)
        return self._stretch_end_problem(report, first, target, audits, epoch=epoch, nonce=nonce), audits, first, params

    def _load_snapshot(self, req: AuditRequest, *, epoch: int, first: int, nonce: str):
        """Download the snapshot taken after inner step ``first``, check it against its commitment
        and load it into the inner copy: ("", its parameters), or (the problem, None)."""
        from dtrain.sketch import WORK_SKETCH_K, gradient_sketch
        from dtrain.training import snapshots
        from dtrain.validation.verification import SNAPSHOT_RTOL, sketch_mismatch

        report, inner = req.report, self.inner
        commit = report.snapshot_at(first)
        try:
            params, exp_avg, exp_avg_sq = self._download_snapshot(req, epoch, first)
        except snapshots.SnapshotError as exc:
            # A miner that cannot serve what it committed is treated as having made it up: one
            # that could choose when to fail would dodge exactly the audits it fears.
            return f"snapshot at inner step {first} not served ({exc})", None
        except TimeoutError as exc:
            return f"snapshot at inner step {first} {exc}", None
        measured = gradient_sketch(params, nonce, k=WORK_SKETCH_K).tolist()
        if sketch_mismatch(report.params_sketch_after(first), measured, SNAPSHOT_RTOL):
            return f"snapshot at inner step {first} is not the committed parameters", None
        if report.t0 + first > 0 and _moments_differ(commit, exp_avg, exp_avg_sq, SNAPSHOT_RTOL, nonce):
            return f"snapshot at inner step {first} is not the committed optimizer state", None
        snapshots.load_inner_state(inner, params, exp_avg, exp_avg_sq, report.t0 + first)
        return "", params

    def _stretch_end_problem(self, report, first: int, target: int, audits: list, *, epoch: int, nonce: str) -> str:
        """"" when the replayed steps end with the moments committed where the stretch ends;
        checked only when every step audit passed."""
        from dtrain.training import snapshots
        from dtrain.training.work import work_nonce
        from dtrain.validation.verification import MOMENTS_RTOL

        following = report.snapshot_at(target)
        if following is not None and all(a.passed for a in audits):
            # The stretch ends where the next snapshot was taken: its committed moments must be
            # the ones these steps produce, or that snapshot's optimizer state was made up.
            _, exp_avg, exp_avg_sq = snapshots.inner_state(self.inner)
            if _moments_differ(following, exp_avg, exp_avg_sq, MOMENTS_RTOL, nonce):
                return (f"the optimizer state committed at inner step {target} is not what steps {first + 1}-{target} "
                        "produce")
        elif target == len(report.steps) and report.carry is not None and all(a.passed for a in audits):
            # The last stretch ends where the carry was committed (under the next epoch's nonce):
            # the moments the next epoch may start from must be the ones these steps produce.
            _, exp_avg, exp_avg_sq = snapshots.inner_state(self.inner)
            if _moments_differ(report.carry, exp_avg, exp_avg_sq, MOMENTS_RTOL, work_nonce(self.settings.run_id, epoch + 1)):
                return (f"the moments carried into the next epoch are not what steps {first + 1}-{target} "
                        "produce")
        return ""

    def _download_snapshot(self, req: AuditRequest, epoch: int, step: int):
        """The snapshot received into the inner copy (snapshots.SnapshotSink), chunk by chunk
        within the time budget (TimeoutError past it): its (params, exp_avg, exp_avg_sq)."""
        from dtrain.training import snapshots

        if req.read_snapshot is None:
            raise snapshots.SnapshotError("no way to ask this miner for it")
        sink = snapshots.SnapshotSink(self.inner)
        budget = SNAPSHOT_FIXED_S + sink.size / SNAPSHOT_MIN_RATE
        deadline = time.monotonic() + budget
        while sink.received < sink.size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"not served within {budget:.0f} s")
            asked = min(SNAPSHOT_CHUNK, sink.size - sink.received)
            chunk = req.read_snapshot(epoch, step, sink.received, asked, min(120.0, left))
            if not chunk:
                break
            if len(chunk) > asked:
                raise snapshots.SnapshotError(f"{len(chunk)} bytes served for {asked} asked")
            sink.write(chunk)
        return sink.finish()

    # ---------------------------------------------------------------- snapshots

    def open_store(self, root: Path) -> None:
        from dtrain.training.snapshots import SnapshotStore

        self.store = SnapshotStore(root)
        self._offload_dir = str(Path(root) / "offload")  # a miner: idle state goes to disk


def _moments_differ(committed, exp_avg, exp_avg_sq, rtol: float, nonce: str) -> bool:
    """Whether the sketches of these AdamW moments under ``nonce`` differ from ``committed``'s beyond ``rtol``."""
    from dtrain.sketch import WORK_SKETCH_K, gradient_sketch
    from dtrain.validation.verification import sketch_mismatch

    return any(sketch_mismatch(want, gradient_sketch(got, nonce, k=WORK_SKETCH_K).tolist(), rtol)
               for want, got in ((committed.exp_avg, exp_avg), (committed.exp_avg_sq, exp_avg_sq)))


def _step_audits(entries, replayed) -> list:
    """A step audit per committed inner step against its replay."""
    from dtrain.training.fingerprint import Fingerprint, compare_fingerprints
    from dtrain.validation.verification import step_audit

    audits = []
    for entry, mine in zip(entries, replayed):
        # The gradient tells the pages apart; the update, that AdamW was applied as committed.
        gradient = compare_fingerprints(Fingerprint(loss=entry.loss, sketch=entry.grad_sketch, samples=entry.samples),
                                        Fingerprint(loss=mine.loss, sketch=mine.grad_sketch, samples=mine.samples))
        update = compare_fingerprints(Fingerprint(loss=entry.loss, sketch=entry.sketch, samples=entry.samples),
                                      Fingerprint(loss=mine.loss, sketch=mine.sketch, samples=mine.samples))
        audits.append(step_audit(entry, gradient, update))
    return audits
