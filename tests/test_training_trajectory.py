"""DiLoCo trajectories: the committed inner steps, their snapshots, and the validator's replay.

Real tiny models and real AdamW steps throughout: the replay must reproduce an honest
miner's steps exactly on the same hardware, and must not reproduce made-up ones.
"""

from __future__ import annotations

import copy
import dataclasses
import random

import pytest
import torch

from dtrain.training import snapshots
from dtrain.sketch import gradient_sketch
from dtrain.training.fingerprint import Fingerprint, compare_fingerprints
from dtrain.training.models import create_model
from dtrain.training.replay import inner_lr_factor, position_inner_lr, replay_steps
from dtrain.training.trainer import Trainer, TrainerConfig
from dtrain.training.trajectory import (
    InnerStepWork, SnapshotCommit, TrajectoryLog, TrajectoryReport,
)
from dtrain.sketch import WORK_SKETCH_K
from dtrain.training.work import WorkReport, WorkReportError, work_nonce
from dtrain.validation import verification as V

RUN, EPOCH, H, EVERY, PAGES_PER_STEP = "run-t", 3, 5, 2, 2


def _page(i: int) -> torch.Tensor:
    return torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(1000 + i))


def _trainer(model, **kw) -> Trainer:
    cfg = TrainerConfig(**{**dict(micro_batch_size=2, local_batch_size=4, lr=2e-3, warmup_steps=0, total_steps=100,
                                  precision="fp32"), **kw})
    return Trainer(copy.deepcopy(model), cfg)


@pytest.fixture(scope="module")
def model():
    return create_model("tiny", vocab_size=512, n_positions=32, eos_token_id=0, seed=1)


def _train(inner: Trainer, steps: int = H, page_of=lambda counter: counter, warmup: int = 0, epoch: int = EPOCH,
           t0: int = 0):
    """A miner's inner loop, as dtrain.neurons.miner runs it: (report, {step: snapshot bytes}).
    ``t0``: the AdamW steps ``inner``'s moments already stand for (0: fresh)."""
    log = TrajectoryLog(RUN, every=EVERY)
    log.start(epoch, inner.params, t0=t0)
    stored = {}

    def keep():
        p, m, v = snapshots.inner_state(inner)
        stored[log.steps_done] = snapshots.encode(p, m, v)
        log.record_snapshot(m, v)

    keep()
    counter = 0
    for t in range(steps):
        counters = []
        for _ in range(PAGES_PER_STEP):
            inner.accumulate(_page(page_of(counter)))
            counters.append(counter)
            counter += 1
        samples = inner.accumulated_samples
        grad = log.gradient_sketch(inner.gradients())
        position_inner_lr(inner, epoch=epoch, inner_steps=H, step_index=t, warmup=warmup, steps_before=t0)
        metrics = inner.step()
        log.record_step(counters=counters, pages=counters, samples=samples, loss=metrics.loss, params=inner.params,
                        grad_sketch=grad)
        if log.snapshot_due() and log.steps_done < H:
            keep()
    _, m, v = snapshots.inner_state(inner)
    return log.report(log.carry(m, v)), stored


def _replay(model, report, stored, first: int, last: int, warmup: int = 0, t0: int | None = None):
    """The validator's replay of steps ``first + 1 .. last``; ``t0`` (default: the report's) is
    the optimizer step count it assumes the epoch started at."""
    t0 = report.t0 if t0 is None else t0
    validator = _trainer(model)
    p, m, v = snapshots.decode(stored[first], [q.shape for q in validator.params])
    snapshots.load_inner_state(validator, p, m, v, t0 + first)
    out = replay_steps(validator, report.steps[first:last], first_step=first, epoch=report.epoch, inner_steps=H,
                       read_page=_page, nonce=work_nonce(RUN, report.epoch), k=WORK_SKETCH_K, warmup=warmup,
                       steps_before=t0)
    return [V.step_audit(e, compare_fingerprints(Fingerprint(e.loss, e.grad_sketch, e.samples),
                                                 Fingerprint(r.loss, r.grad_sketch, r.samples)),
                         compare_fingerprints(Fingerprint(e.loss, e.sketch, e.samples),
                                              Fingerprint(r.loss, r.sketch, r.samples)))
            for e, r in zip(report.steps[first:last], out)]


def test_report_round_trips_the_wire_and_keeps_a_snapshot_before_every_stretch(model):
    report, stored = _train(_trainer(model))
    assert TrajectoryReport.from_wire(report.to_wire()) == report
    assert [s.step for s in report.snapshots] == [0, 2, 4]
    assert sorted(stored) == [0, 2, 4]
    assert report.samples == H * 4
    assert [p.counter for p in report.pages] == list(range(H * PAGES_PER_STEP))
    # a per-step report still parses as one
    assert isinstance(WorkReport.from_wire(WorkReport(epoch=1).to_wire()), WorkReport)


def test_contribution_sketch_is_the_pseudo_gradients_sketch(model):
    inner = _trainer(model)
    anchor = [p.detach().clone() for p in inner.params]
    report, _ = _train(inner)
    pseudo = [a - p.detach() for a, p in zip(anchor, inner.params)]
    want = gradient_sketch(pseudo, work_nonce(RUN, EPOCH), k=WORK_SKETCH_K)
    got = torch.tensor(report.contribution_sketch(), dtype=torch.float64)
    assert float((want - got).norm() / want.norm()) < 1e-6
    # c_T, derived from the start and the updates, is the sketch of the final parameters
    final = gradient_sketch(list(inner.params), work_nonce(RUN, EPOCH), k=WORK_SKETCH_K)
    assert not V.sketch_mismatch(report.params_sketch_after(H), final.tolist(), 1e-9)


@pytest.mark.parametrize("first,last", [(0, 1), (0, 2), (2, 4), (4, 5)])
def test_an_honest_stretch_replays_exactly_from_its_snapshot(model, first, last):
    report, stored = _train(_trainer(model))
    comparisons = _replay(model, report, stored, first, last)
    assert len(comparisons) == last - first
    assert all(c.passed and c.cosine > 1 - 1e-9 and c.loss_diff == 0 for c in comparisons), comparisons


def test_the_inner_warmup_ramp_is_replayed_and_skipping_it_is_caught(model):
    assert [inner_lr_factor(t, 3) for t in range(5)] == [1 / 3, 2 / 3, 1.0, 1.0, 1.0]
    assert inner_lr_factor(0, 0) == 1.0
    report, stored = _train(_trainer(model), warmup=3)
    assert all(c.passed and c.cosine > 1 - 1e-9 for c in _replay(model, report, stored, 0, 2, warmup=3))
    # a miner that skips the swarm's ramp takes full-rate first steps: its updates do not replay
    skipped, stored = _train(_trainer(model), warmup=0)
    assert not all(c.passed for c in _replay(model, skipped, stored, 0, 2, warmup=3))


def test_the_ramp_waits_for_the_schedules_own_warmup_and_moments_carried_need_none(model):
    trainer = _trainer(model, warmup_steps=2 * H)  # the run's schedule ramps over its first 2 epochs

    def lr(epoch: int, step: int, steps_before: int = 0) -> float:
        position_inner_lr(trainer, epoch=epoch, inner_steps=H, step_index=step, warmup=3, steps_before=steps_before)
        return trainer.optimizer.param_groups[0]["lr"]

    def schedule(epoch: int, step: int) -> float:
        trainer.set_schedule_position(epoch * H + step)
        return trainer.optimizer.param_groups[0]["lr"]

    # within the schedule's warm-up: its own ramp only (two multiplied would square it)
    assert lr(0, 0) == schedule(0, 0) and lr(1, 1) == schedule(1, 1)
    # after it, fresh moments ramp over their first 3 steps ...
    assert lr(2, 0) == pytest.approx(schedule(2, 0) / 3) and lr(2, 3) == schedule(2, 3)
    # ... and moments carried from the epoch before (t0 = H) do not
    assert lr(2, 0, steps_before=H) == schedule(2, 0)


def test_fused_adamw_replays_within_tolerance_of_the_plain_one(model):
    """Another optimizer kernel (what CUDA miners run) is still an honest miner."""
    report, stored = _train(_trainer(model, fused=True))
    assert all(c.passed for c in _replay(model, report, stored, 2, 4))


@pytest.mark.parametrize("first,last", [(0, 2), (4, 5)])
def test_steps_trained_on_other_pages_fail_the_replay(model, first, last):
    """Late in an inner loop an AdamW update is mostly the momentum carried in, so the update
    of a step on other pages can look alike; the gradient's sketch cannot."""
    report, stored = _train(_trainer(model), page_of=lambda counter: counter + 500)  # commits its own ids
    comparisons = _replay(model, report, stored, first, last)
    assert not any(c.passed for c in comparisons)
    assert all(any(r.startswith("gradient cosine") for r in c.reasons) for c in comparisons), comparisons


def test_made_up_steps_fail_the_replay(model):
    """One real step passed off as H (the sandbagger): every replayed step after the first fails."""
    real, stored = _train(_trainer(model), steps=1)
    one = real.steps[0]
    steps = tuple(InnerStepWork(counters=(2 * i, 2 * i + 1), pages=(2 * i, 2 * i + 1), samples=one.samples,
                                loss=one.loss, sketch=one.sketch, grad_sketch=one.grad_sketch) for i in range(H))
    fake = TrajectoryReport(epoch=EPOCH, every=EVERY, start=real.start, steps=steps,
                            snapshots=tuple(SnapshotCommit(s, real.snapshots[0].exp_avg, real.snapshots[0].exp_avg_sq)
                                            for s in range(0, H, EVERY)))
    comparisons = _replay(model, fake, stored, 0, 2)
    assert comparisons[0].passed and not comparisons[1].passed


@pytest.mark.parametrize("mutate,fragment", [
    (lambda w: w.update(every=0), "every"),
    (lambda w: w.update(c0=b"\0" * 7), "start sketch"),
    (lambda w: w["s"][1].__setitem__(0, [0, 1]), "strictly increasing"),
    (lambda w: w["s"][0].__setitem__(1, [1, 2, 3]), "matching"),
    (lambda w: w["s"][0].__setitem__(2, 0), "samples"),
    (lambda w: w["s"][0].__setitem__(3, float("nan")), "finite"),
    (lambda w: w["s"][0].__setitem__(2, True), "samples"),
    (lambda w: w.update(snap=w["snap"][:1]), "snapshots must be at steps"),
    (lambda w: w.update(s="x"), "step list"),
])
def test_malformed_trajectories_are_refused_with_the_reason(model, mutate, fragment):
    report, _ = _train(_trainer(model), steps=3)
    wire = report.to_wire()
    mutate(wire)
    with pytest.raises(WorkReportError, match=fragment):
        TrajectoryReport.from_wire(wire)


def test_snapshot_bytes_decode_and_refuse_what_does_not_fit(model):
    inner = _trainer(model)
    _train(inner, steps=2)
    p, m, v = snapshots.inner_state(inner)
    data = snapshots.encode(p, m, v)
    assert len(data) == snapshots.snapshot_nbytes(inner.params)
    p2, m2, v2 = snapshots.decode(data, [q.shape for q in inner.params])
    assert all(torch.equal(a, b) for a, b in zip(p + m + v, p2 + m2 + v2))
    with pytest.raises(snapshots.SnapshotError, match="bytes"):
        snapshots.decode(data[:-4], [q.shape for q in inner.params])
    negative = snapshots.encode(p, m, [-t - 1 for t in v])
    with pytest.raises(snapshots.SnapshotError, match="negative"):
        snapshots.decode(negative, [q.shape for q in inner.params])


def test_loading_a_snapshot_at_step_0_is_a_fresh_optimizer(model):
    inner = _trainer(model)
    _train(inner, steps=2)
    p, m, v = snapshots.inner_state(inner)
    snapshots.load_inner_state(inner, p, m, v, 0)
    assert len(inner.optimizer.state) == 0
    snapshots.load_inner_state(inner, p, m, v, 2)
    state = inner.optimizer.state[inner.params[0]]
    assert float(state["step"]) == 2 and torch.equal(state["exp_avg"], m[0])


def test_snapshot_store_is_atomic_reads_ranges_and_prunes_old_epochs(tmp_path):
    store = snapshots.SnapshotStore(tmp_path / "snaps", keep_epochs=2)
    one = [torch.tensor([1.0, 2.0])]
    store.save(5, 0, one, one, one)
    p, m, v = [torch.arange(6.0).reshape(2, 3)], [torch.ones(2, 3)], [torch.full((2, 3), 2.0)]
    store.save(6, 4, p, m, v)
    data = snapshots.encode(p, m, v)
    assert store.read(6, 4, 0, len(data) + 10) == data
    assert store.read(6, 4, 4, 8) == data[4:12]
    assert not list((tmp_path / "snaps").glob(".*tmp*"))
    store.prune(7)  # keeps epochs 6 and 7 only
    with pytest.raises(snapshots.SnapshotError, match="epoch 5"):
        store.read(5, 0, 0, 1)
    assert store.read(6, 4, 0, 4) == data[:4]


def test_snapshot_is_streamed_in_the_format_decode_reads_and_a_failed_write_keeps_the_last(tmp_path):
    # Moments not taken yet are expanded zeros (no memory); views and non-contiguous tensors
    # are written in chunks: the bytes are the same as one float32 buffer per section.
    torch.manual_seed(0)
    shapes = [torch.Size([3, 5]), torch.Size([7])]
    params = [torch.randn(5, 3).t(), torch.randn(7)]  # the first is not contiguous
    zeros = [torch.zeros((), dtype=torch.float32).expand(s) for s in shapes]
    second = [torch.rand(s) for s in shapes]
    store = snapshots.SnapshotStore(tmp_path / "snaps")
    store.save(1, 0, params, zeros, second)
    data = bytearray(store.read(1, 0, 0, 1 << 20))
    p, m, v = snapshots.decode(data, shapes)
    assert all(torch.equal(a, b) for a, b in zip(p, params))
    assert all(not bool(t.any()) for t in m) and all(torch.equal(a, b) for a, b in zip(v, second))
    with pytest.raises(AttributeError):  # a write that fails half-way (not a tensor)
        store.save(1, 0, params, zeros, [second[0], object()])
    assert store.read(1, 0, 0, 1 << 20) == data  # the last good snapshot is intact
    assert not list((tmp_path / "snaps").glob(".*tmp*"))


def test_a_snapshot_received_in_chunks_lands_in_the_trainer_as_decode_reads_it(model):
    # A validator receives a snapshot straight into its inner copy: chunks of any size (a value
    # split between two), the same tensors decode gives, and decode's refusals.
    inner = _trainer(model)
    torch.manual_seed(3)
    shapes = [p.shape for p in inner.params]
    p, m, v = [torch.randn(s) for s in shapes], [torch.randn(s) for s in shapes], [torch.rand(s) for s in shapes]
    data = snapshots.encode(p, m, v)
    sink = snapshots.SnapshotSink(inner)
    assert sink.size == len(data)
    for at in range(0, len(data), 4093):  # not a multiple of 4
        sink.write(data[at:at + 4093])
    got = sink.finish()
    want = snapshots.decode(bytearray(data), shapes)
    assert all(torch.equal(a, b) for section, ref in zip(got, want) for a, b in zip(section, ref))
    assert all(a.data_ptr() == q.data_ptr() for a, q in zip(got[0], inner.params))  # in place
    snapshots.load_inner_state(inner, *got, 4)
    assert inner.optimizer.state[inner.params[0]]["exp_avg"].data_ptr() == got[1][0].data_ptr()  # adopted

    short = snapshots.SnapshotSink(inner)
    short.write(data[:100])
    with pytest.raises(snapshots.SnapshotError, match="100 bytes"):
        short.finish()
    with pytest.raises(snapshots.SnapshotError, match="more than"):
        snapshots.SnapshotSink(inner).write(data + b"1234")
    negative = snapshots.SnapshotSink(inner)
    negative.write(snapshots.encode(p, m, [-x for x in v]))
    with pytest.raises(snapshots.SnapshotError, match="negative"):
        negative.finish()
    nan = snapshots.SnapshotSink(inner)
    nan.write(snapshots.encode([x * float("nan") for x in p], m, v))
    with pytest.raises(snapshots.SnapshotError, match="non-finite"):
        nan.finish()


def test_replay_step_choice_and_shape_rules():
    rng = random.Random(7)
    picks = {V.choose_replay_segment(5, 2, rng) for _ in range(200)}
    assert picks == {(0, 2), (2, 4), (4, 5)}  # whole stretches between snapshots; the last is short
    assert V.choose_replay_segment(0, 2, rng) is None
    step = InnerStepWork(counters=(0,), pages=(9,), samples=4, loss=1.0, sketch=(0.0,) * WORK_SKETCH_K)
    report = TrajectoryReport(epoch=1, every=1, start=(0.0,) * WORK_SKETCH_K, steps=(step,) * 3)
    assert "more than allreduce.diloco_inner_steps" in V.trajectory_shape_problem(report, inner_steps=2,
                                                                                page_sequences=4)
    assert V.trajectory_shape_problem(report, inner_steps=3, page_sequences=4) == ""
    assert "claims 4 samples from 1 pages" in V.trajectory_shape_problem(report, inner_steps=3, page_sequences=2)
    verdict = V.judge_trajectory(report, expected_epoch=2, problem="", audits=[])
    assert not verdict.passed and "epoch 1" in verdict.problem and verdict.credited_samples == 0
    failed = V.PageAudit(page=9, counter=0, passed=False, cosine=0.1, norm_ratio=1.0, loss_diff=0.0,
                         reasons=("cosine 0.1 < 0.995",))
    verdict = V.judge_trajectory(report, expected_epoch=1, problem="", audits=[failed], first_step=2)
    assert "inner step 3 failed its replay" in verdict.problem
    assert V.judge_trajectory(report, expected_epoch=1, problem="", audits=[]).credited_samples == 12


def test_sketch_mismatch_is_relative_to_the_sketches_scale():
    a = [1000.0, -2000.0, 3.0]
    assert not V.sketch_mismatch(a, [x * (1 + 1e-12) for x in a], 1e-9)
    assert V.sketch_mismatch(a, [a[0] + 0.01, a[1], a[2]], 1e-9)
    assert V.sketch_mismatch(a, a[:2], 1e-9)


def test_a_replayed_stretch_ends_on_the_next_snapshots_committed_moments(model):
    """Replaying a whole stretch must reproduce the next snapshot's moments: a snapshot's
    optimizer state is then evidence, not a claim (a made-up one is caught one stretch earlier)."""
    report, stored = _train(_trainer(model))
    validator = _trainer(model)
    p, m, v = snapshots.decode(stored[0], [q.shape for q in validator.params])
    snapshots.load_inner_state(validator, p, m, v, 0)
    replay_steps(validator, report.steps[0:2], first_step=0, epoch=EPOCH, inner_steps=H, read_page=_page,
                 nonce=work_nonce(RUN, EPOCH), k=WORK_SKETCH_K)
    _, m2, v2 = snapshots.inner_state(validator)
    nonce = work_nonce(RUN, EPOCH)
    commit = report.snapshot_at(2)
    assert not V.sketch_mismatch(commit.exp_avg, gradient_sketch(m2, nonce, k=WORK_SKETCH_K).tolist(), V.MOMENTS_RTOL)
    assert not V.sketch_mismatch(commit.exp_avg_sq, gradient_sketch(v2, nonce, k=WORK_SKETCH_K).tolist(),
                                 V.MOMENTS_RTOL)
    inflated = [t * 10 for t in m2]  # the moments a miner would make up to steer its updates
    assert V.sketch_mismatch(commit.exp_avg, gradient_sketch(inflated, nonce, k=WORK_SKETCH_K).tolist(),
                             V.MOMENTS_RTOL)


def test_a_report_of_the_other_averaging_mode_is_refused_in_the_gather(model):
    """One mode per swarm: a per-step validator must never be handed a trajectory to audit as
    pages, nor a DiLoCo one a page list."""
    import numpy as np

    from dtrain.swarm.averaging.contribution import Commitment

    trajectory, _ = _train(_trainer(model), steps=2)
    claims = np.zeros((3, WORK_SKETCH_K), dtype="<f4")
    diloco = Commitment.of_claims("n", trajectory, claims).to_gather()
    per_step = Commitment.of_claims("n", WorkReport(epoch=EPOCH), claims).to_gather()
    assert Commitment.parse(diloco, TrajectoryReport).report == trajectory
    assert Commitment.parse(per_step, WorkReport).report == WorkReport(epoch=EPOCH)
    with pytest.raises(WorkReportError, match="DiLoCo work report in a swarm of the other averaging mode"):
        Commitment.parse(diloco, WorkReport)
    with pytest.raises(WorkReportError, match="per-step work report in a swarm of the other averaging mode"):
        Commitment.parse(per_step, TrajectoryReport)


def test_a_trajectory_may_not_name_more_pages_in_all_than_a_report_may(model):
    from dtrain.training.trajectory import MAX_STEP_PAGES
    from dtrain.training.work import MAX_REPORT_PAGES

    report, _ = _train(_trainer(model), steps=1)
    wire = report.to_wire()
    template = wire["s"][0]
    steps = MAX_REPORT_PAGES // MAX_STEP_PAGES + 1  # each step within its own bound, the sum over

    def step(i: int) -> list:
        counters = list(range(i * MAX_STEP_PAGES, (i + 1) * MAX_STEP_PAGES))
        return [counters, counters, 4, 1.0, template[4], template[5]]

    wire["s"] = [step(i) for i in range(steps)]
    wire["every"] = steps  # one snapshot, at step 0: only the page total is wrong
    wire["snap"] = wire["snap"][:1]
    with pytest.raises(WorkReportError, match=f"more than {MAX_REPORT_PAGES} pages"):
        TrajectoryReport.from_wire(wire)
    wire["s"] = wire["s"][:-1]  # at the bound: accepted
    wire["carry"][0] = len(wire["s"])  # the end moments' commitment names the optimizer's step count
    assert len(TrajectoryReport.from_wire(wire).pages) == MAX_REPORT_PAGES


# ---------------------------------------------------------------- moments carried across epochs


def _two_epochs(model, warmup: int = 0):
    """Epoch EPOCH from fresh moments, then EPOCH + 1 from the moments it ended with (as a miner
    whose round moved it on by one epoch): ((report, stored) of each)."""
    inner = _trainer(model)
    first = _train(inner, warmup=warmup)
    second = _train(inner, warmup=warmup, epoch=EPOCH + 1, t0=H)
    return first, second


def test_an_epoch_started_from_carried_moments_replays_exactly_and_its_start_checks_out(model):
    (a, _), (b, stored) = _two_epochs(model, warmup=3)
    assert a.t0 == 0 and a.carry.step == H and b.t0 == H and b.carry.step == 2 * H
    assert TrajectoryReport.from_wire(b.to_wire()) == b
    # the start moments are the end moments of the epoch before: the step-0 snapshot sketches,
    # under this epoch's nonce, exactly what the previous report carried
    assert (b.snapshots[0].exp_avg, b.snapshots[0].exp_avg_sq) == (a.carry.exp_avg, a.carry.exp_avg_sq)
    assert any(b.snapshots[0].exp_avg)  # not fresh
    assert V.start_moments_problem(b, (EPOCH, a.carry), epoch=EPOCH + 1) == ("", True)
    # every stretch replays exactly from its snapshot, the first one from the carried moments
    for first, last in ((0, 2), (2, 4), (4, 5)):
        comparisons = _replay(model, b, stored, first, last, warmup=3)
        assert all(c.passed and c.cosine > 1 - 1e-9 and c.loss_diff == 0 for c in comparisons), (first, comparisons)
    # replayed as if the moments were fresh (t0 = 0: the ramp and AdamW's bias correction of a
    # new optimizer), the same steps do not reproduce: the step count is part of the state
    assert not all(c.passed for c in _replay(model, b, stored, 0, 2, warmup=3, t0=0))


def test_start_moments_must_be_fresh_or_the_ones_committed_at_the_end_of_the_epoch_before(model):
    (a, _), (b, _) = _two_epochs(model)
    fresh, _ = _train(_trainer(model), epoch=EPOCH + 1)
    # fresh moments need no history
    assert V.start_moments_problem(fresh, None, epoch=EPOCH + 1) == ("", True)
    # "fresh" with non-zero moments committed at step 0
    claimed_fresh = dataclasses.replace(b, t0=0)
    problem, checked = V.start_moments_problem(claimed_fresh, (EPOCH, a.carry), epoch=EPOCH + 1)
    assert checked and "fresh moments (t0 = 0) but commits non-zero moments" in problem
    # made-up start moments (say, the committed ones negated): not what the epoch before carried
    made_up = SnapshotCommit(0, tuple(-x for x in b.snapshots[0].exp_avg), b.snapshots[0].exp_avg_sq)
    forged = dataclasses.replace(b, snapshots=(made_up, *b.snapshots[1:]))
    problem, checked = V.start_moments_problem(forged, (EPOCH, a.carry), epoch=EPOCH + 1)
    assert checked and "not the ones it committed at the end of epoch" in problem
    # another optimizer step count than the one carried
    problem, _ = V.start_moments_problem(dataclasses.replace(b, t0=H + 7), (EPOCH, a.carry), epoch=EPOCH + 1)
    assert f"moments of {H + 7} optimizer steps, but committed {H}" in problem
    # a validator without the previous epoch's commitment (it was not in that round, or its
    # memory is of an older epoch) cannot check a carried start, and says so
    assert V.start_moments_problem(b, None, epoch=EPOCH + 1) == ("", False)
    # ... but one that saw the epoch before end without a step knows there was nothing to carry
    problem, checked = V.start_moments_problem(b, (EPOCH, None), epoch=EPOCH + 1)
    assert checked and "committed none at the end of epoch" in problem
    assert V.start_moments_problem(b, (EPOCH - 1, a.carry), epoch=EPOCH + 1) == ("", False)


@pytest.mark.parametrize("mutate,fragment", [
    (lambda w: w.pop("carry"), "must carry"),
    (lambda w: w["carry"].__setitem__(0, H + 1), "must carry"),
    (lambda w: w.__setitem__("t0", -1), "'t0' must be an integer"),
    (lambda w: w.__setitem__("t0", True), "'t0' must be an integer"),
    (lambda w: w["carry"].__setitem__(1, b"\0" * 3), "carry sketch"),
])
def test_malformed_carries_are_refused(model, mutate, fragment):
    report, _ = _train(_trainer(model))
    wire = report.to_wire()
    mutate(wire)
    with pytest.raises(WorkReportError, match=fragment):
        TrajectoryReport.from_wire(wire)
