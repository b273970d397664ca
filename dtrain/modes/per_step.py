"""Per-step mode (``allreduce.mode = "gradient"``): every round averages the gradients the
miners trained since the last one, weighted by samples, and every peer takes the same optimizer
step with it.

The miner accumulates gradients of its own pages on the shared replica itself, recording a
work sketch per page (``dtrain.training.work``), and goes on until its round begins, up to the
swarm's target global batch: faster hardware brings more samples to the round and is paid for
them. Its contribution is the mean gradient of those pages. A validator recomputes randomly
chosen committed pages on the pre-step replica.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Sequence

from dtrain.modes.base import AuditRequest, Contribution, Mode, ModeSettings, PageTrained, Progress

log = logging.getLogger(__name__)


def page_loss(results) -> float:
    """Sample-weighted mean loss of a page's micro-batches."""
    n = sum(r.samples for r in results)
    return sum(r.loss * r.samples for r in results) / n if n else float("nan")


class PerStep(Mode):
    name = "gradient"

    def __init__(self, settings: ModeSettings, model, device: str, reader, *, fused: bool | None = None):
        from dtrain.training.trainer import Trainer
        from dtrain.training.work import WorkLog

        super().__init__(settings, Trainer(model, settings.local_trainer_config(device, fused)), reader)
        self.work = WorkLog(settings.run_id)

    # ---------------------------------------------------------------- training

    def start_epoch(self, epoch: int) -> None:
        # Nothing to restart: the accumulation (and its work report) begins afresh at the
        # first page after a step, which zeroes the gradients (train_page).
        pass

    @property
    def wants_data(self) -> bool:
        # Train until the round, not until a local batch: idling waiting for the clock wastes the accelerator.
        return self.trainer.accumulated_samples < self.contribution_limit

    def train_page(self, tokens, *, page: int, counter: int, epoch: int) -> PageTrained:
        if self.trainer.accumulated_samples == 0:
            self.work.reset(epoch)  # a new accumulation: a new work report
        results = self.trainer.accumulate(tokens)
        samples = sum(r.samples for r in results)
        # The page's sketch is the change in the accumulated gradient's sketch (linear).
        self.work.record(page=page, counter=counter, samples=samples, loss=page_loss(results),
                         gradients=self.trainer.gradients())
        return PageTrained(loss=sum(r.loss for r in results) / len(results), samples=samples)

    @property
    def samples(self) -> int:
        return self.trainer.accumulated_samples

    def progress(self) -> Progress:
        t = self.trainer
        return Progress(lr=t.lr, inner_step=t.counters.inner_step, samples=t.counters.samples,
                        tokens=t.counters.tokens, samples_accumulated=t.accumulated_samples,
                        local_batch=self.contribution_limit)

    # ---------------------------------------------------------------- contribution

    def contribution(self, samples: int, weight_cap: float, out=None) -> Contribution:
        # Peers exchange *mean* gradients weighted by sample counts; the trainer keeps sums.
        import torch

        from dtrain.modes.base import computed_into

        n = max(samples, 1)
        mean = computed_into(out, lambda g, out=None: torch.div(g, n, out=out), self.trainer.gradients())
        report = self.work.report()
        return Contribution(mean, float(min(samples, report.samples, weight_cap)), report)

    # ---------------------------------------------------------------- validating

    @property
    def contribution_limit(self) -> int:
        """The most samples one contribution carries: the swarm's target global batch (one
        miner alone may fill it), never below a local batch."""
        return max(self.settings.target_batch_size, self.settings.local_batch_size)

    @property
    def weight_cap(self) -> float:
        return float(self.contribution_limit)

    def empty_report(self, epoch: int):
        from dtrain.training.work import WorkReport

        return WorkReport(epoch=int(epoch))

    def audit(self, requests: Sequence[AuditRequest], *, epoch: int, rng: random.Random) -> list:
        """Check each report's page ids against the assignment and recompute randomly chosen
        committed pages on the pre-step replica; with ``batch_audit_probability``, recompute the
        whole committed batch and check what the miner sent against it under the round audit's
        secret seed (``req.sent``; dtrain.swarm.averaging.audit.batch_problem)."""
        from dtrain.training.fingerprint import Fingerprint, compare_fingerprints
        from dtrain.training.work_audit import recompute_page_work
        from dtrain.sketch import WORK_SKETCH_K
        from dtrain.training.work import work_nonce
        from dtrain.validation.verification import (
            batch_audit_chance, check_page_ids, choose_audit_pages, judge_work, page_audit,
        )

        nonce = work_nonce(self.settings.run_id, epoch)
        verdicts = []
        for req in requests:
            report = req.report
            if report is None or not report.pages:
                verdicts.append(None)
                continue
            id_problem = check_page_ids(report.pages, self.expected_page(req.uid, epoch))
            audits = []
            if not id_problem:
                for index in choose_audit_pages(len(report.pages), self.settings.audit_pages, rng):
                    entry = report.pages[index]
                    reference = recompute_page_work(self.trainer.model, self.reader.read_pages([entry.page]),
                                                    nonce=nonce, micro_batch_size=self.settings.micro_batch_size,
                                                    precision=self.trainer.precision, k=WORK_SKETCH_K)
                    claimed = Fingerprint(loss=entry.loss, sketch=entry.sketch, samples=entry.samples)
                    audits.append(page_audit(entry, compare_fingerprints(claimed, reference)))
            verdict = judge_work(report, id_problem, audits, expected_epoch=epoch)
            chance = batch_audit_chance(self.settings.batch_audit_probability, report.samples,
                                        self.settings.local_batch_size)
            if verdict.passed and req.sent is not None and rng.random() < chance:
                problem = self._batch_problem(report, req.sent)
                log.info("uid %d: whole committed batch recomputed for the round audit: %s", req.uid,
                         problem or "it gives what the miner sent")
                if problem:
                    verdict = dataclasses.replace(verdict, problem=problem)
            verdicts.append(verdict)
        return verdicts

    def _batch_problem(self, report, sent) -> str:
        """Recompute every committed page; "" when the mean gradient they give is what the miner
        sent, under the round audit's secret seed (audit.batch_problem)."""
        from dtrain.swarm.averaging.audit import batch_problem
        from dtrain.training.work_audit import summed_gradients

        total: list = [None] * len(self.trainer.params)
        samples = 0
        for entry in report.pages:
            _, _, n = summed_gradients(self.trainer.model, self.reader.read_pages([entry.page]),
                                       micro_batch_size=self.settings.micro_batch_size,
                                       precision=self.trainer.precision, into=total)
            samples += n
        mean = [None if g is None else g.float().div(max(samples, 1)).cpu() for g in total]
        return batch_problem(mean, sent)
