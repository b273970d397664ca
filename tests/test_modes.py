"""The training modes' contract (dtrain.modes): what each trains and contributes, what a round
changes, what a validator audits; and one real DiLoCo round between two loopback peers."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from dtrain.config import Config
from dtrain.modes import MODES, AuditRequest, DiLoCo, PerStep, UnknownMode, build_mode
from dtrain.swarm.records import RoundRecord
from dtrain.training import snapshots

H = 3  # DiLoCo inner steps per epoch in these tests
TARGET = 12  # the target global batch: three pages
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9


def _config(mode: str) -> Config:
    cfg = Config()
    cfg.model.preset, cfg.model.seq_len, cfg.model.run_id = "tiny", 32, "modes-test"
    cfg.data.source, cfg.data.tokenizer, cfg.data.page_sequences = "local", "shipped", 4
    cfg.training.device, cfg.training.precision = "cpu", "fp32"
    # one page per local batch: one page per DiLoCo inner step
    cfg.training.micro_batch_size, cfg.training.local_batch_size = 2, 4
    cfg.training.lr, cfg.training.warmup_steps, cfg.training.total_steps = 3e-3, 0, 100
    cfg.allreduce.mode, cfg.allreduce.diloco_inner_steps = mode, H
    cfg.allreduce.diloco_inner_warmup, cfg.allreduce.diloco_snapshot_every = 2, 2
    cfg.allreduce.outer_lr, cfg.allreduce.outer_momentum = OUTER_LR, OUTER_MOMENTUM
    cfg.validator.audit_pages = 2
    # gradient mode trains on past a local batch until its round, up to this target
    cfg.allreduce.target_batch_size = TARGET
    return cfg


@pytest.fixture(scope="module")
def bench_of():
    """build_workbench(cfg) per mode: the model, reader and mode a neuron of that mode runs."""
    from dtrain.neurons.runtime import build_workbench

    return lambda mode, **kw: build_workbench(_config(mode), **kw)


def _own_pages(bench, uid: int, epoch: int, count: int) -> list[int]:
    from dtrain.training.data import assign_pages

    return assign_pages(run_id=bench.run_id, uid=uid, epoch=epoch, page_counter=0, count=count,
                        num_pages=bench.reader.num_pages)


def _train(bench, uid: int = 1, epoch: int = 0, limit: int = 50) -> list[int]:
    """Train the miner's own pages until its mode wants no more; return the pages."""
    mode, done = bench.mode, []
    while mode.wants_data and len(done) < limit:
        page = _own_pages(bench, uid, epoch, len(done) + 1)[-1]
        mode.train_page(bench.reader.read_pages([page]), page=page, counter=len(done), epoch=epoch)
        done.append(page)
    return done


def _train_one(bench, uid: int = 1, epoch: int = 0) -> None:
    """One more page (one inner step here) of the miner's own, whether or not its mode wants it."""
    mode = bench.mode
    counter = mode.trajectory.steps_done
    page = _own_pages(bench, uid, epoch, counter + 1)[-1]
    mode.train_page(bench.reader.read_pages([page]), page=page, counter=counter, epoch=epoch)


def _record(ok: bool = True) -> RoundRecord:
    return RoundRecord(round_id="r", local_peer_id="me", started_at=0.0, duration_s=0.0,
                       fraction_averaged=1.0 if ok else 0.0, error="" if ok else "no group formed")


def _copy(tensors) -> list[torch.Tensor]:
    return [t.detach().clone() for t in tensors]


def _equal(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


# ---------------------------------------------------------------------------------- registry


def test_every_configured_mode_has_a_class():
    from dtrain.config import section_fields

    _, field = section_fields("allreduce")["mode"]
    choices = set(field.metadata.get("choices") or ())
    assert choices == set(MODES) == {"gradient", "diloco"}
    assert MODES["gradient"] is PerStep and MODES["diloco"] is DiLoCo


def test_build_mode_rejects_an_unknown_mode():
    cfg = _config("gradient")
    cfg.allreduce.mode = "sparse"  # set past the schema's check, as a stale caller could
    with pytest.raises(UnknownMode, match=r"allreduce.mode 'sparse' .* expected one of diloco, gradient"):
        build_mode(cfg, torch.nn.Linear(2, 2), "cpu", None)


def test_the_workbench_holds_the_mode_and_its_shared_replica(bench_of):
    for name, cls in (("gradient", PerStep), ("diloco", DiLoCo)):
        bench = bench_of(name)
        assert isinstance(bench.mode, cls) and bench.mode.trainer is bench.trainer
        assert bench.model is bench.trainer.model
    diloco = bench_of("diloco").mode
    assert diloco.trainer.config.optimizer == "nesterov" and diloco.inner.config.optimizer == "adamw"
    assert diloco.inner.model is not diloco.trainer.model
    assert bench_of("diloco", fused=True).mode.inner.config.fused is True
    assert bench_of("gradient", fused=True).mode.trainer.config.fused is True


def test_weight_caps_and_empty_reports(bench_of):
    from dtrain.training.trajectory import TrajectoryReport
    from dtrain.training.work import WorkReport

    per_step, diloco = bench_of("gradient").mode, bench_of("diloco").mode
    assert per_step.weight_cap == float(TARGET) and diloco.weight_cap == 4.0 * H
    assert per_step.empty_report(7) == WorkReport(epoch=7)
    assert diloco.empty_report(7) == TrajectoryReport.empty(7)
    assert diloco.empty_report(7).samples == 0 and not diloco.empty_report(7).steps


# ---------------------------------------------------------------------------------- per-step


def test_per_step_contribution_is_the_mean_gradient_with_its_samples(bench_of):
    bench = bench_of("gradient")
    mode = bench.mode
    mode.start_epoch(0)
    pages = _train(bench)
    # past the local batch (4) until the target global batch: every sample it trains counts
    assert len(pages) == 3 and mode.samples == TARGET and not mode.wants_data
    grads = _copy(mode.trainer.gradients())
    c = mode.contribution(mode.samples, weight_cap=100.0)
    assert all(torch.allclose(t, g / TARGET) for t, g in zip(c.tensors, grads))
    assert c.weight == TARGET and [p.page for p in c.report.pages] == pages and c.report.samples == TARGET
    assert mode.contribution(mode.samples, weight_cap=3.0).weight == 3.0  # never above the cap
    progress = mode.progress()
    assert (progress.samples_accumulated, progress.local_batch, progress.inner_step) == (TARGET, TARGET, 0)


@pytest.mark.parametrize("mode_name", ["gradient", "diloco"])
def test_a_contribution_computed_into_the_round_buffers_is_the_same_bits(bench_of, tmp_path, mode_name):
    # The miner computes its contribution straight into the swarm's buffers (not held twice);
    # it must be exactly what it computes into tensors of its own.
    bench = bench_of(mode_name)
    mode = bench.mode
    mode.open_store(tmp_path)
    mode.start_epoch(0)
    _train(bench)
    alone = mode.contribution(mode.samples, weight_cap=mode.weight_cap)
    buffers = [torch.full_like(t, 7.0) for t in alone.tensors]
    into = mode.contribution(mode.samples, weight_cap=mode.weight_cap, out=buffers)
    assert all(a is b for a, b in zip(into.tensors, buffers))  # written in place
    assert _equal(into.tensors, alone.tensors) and into.weight == alone.weight


def test_the_average_is_adopted_as_the_gradient_not_copied(bench_of, tmp_path):
    # DiLoCo's anchor holds no gradient between rounds: the averaged buffer becomes it (no copy),
    # and the step leaves none behind. Per-step's accumulated gradient is dropped for it.
    bench = bench_of("diloco")
    mode = bench.mode
    mode.open_store(tmp_path)
    mode.start_epoch(0)
    _train(bench)
    average = mode.contribution(mode.samples, weight_cap=mode.weight_cap).tensors
    seen = []
    handle = mode.trainer.optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: seen.extend(p.grad.data_ptr() == a.data_ptr()
                                              for p, a in zip(mode.trainer.params, average)))
    try:
        assert mode.apply_average(_record(), average) is not None
    finally:
        handle.remove()
    assert seen and all(seen) and all(p.grad is None for p in mode.trainer.params)
    per_step_bench = bench_of("gradient")
    per_step = per_step_bench.mode
    _train(per_step_bench)
    mean = per_step.contribution(per_step.samples, weight_cap=100.0).tensors
    per_step.trainer.set_gradients(mean, num_samples=1, adopt=True)
    assert all(p.grad.data_ptr() == g.data_ptr() for p, g in zip(per_step.trainer.params, mean))
    copied = [torch.ones_like(g) for g in mean]
    per_step.trainer.set_gradients(copied, num_samples=1)  # without adopt: copied into the one held
    assert all(p.grad.data_ptr() == g.data_ptr() and bool((p.grad == 1).all())
               for p, g in zip(per_step.trainer.params, mean))


def test_per_step_apply_average_steps_and_a_failed_round_changes_nothing(bench_of):
    bench = bench_of("gradient")
    mode = bench.mode
    _train(bench)
    c = mode.contribution(mode.samples, weight_cap=100.0)
    before = _copy(mode.trainer.params)
    assert mode.apply_average(_record(ok=False), c.tensors) is None
    assert mode.apply_average(_record(), [t * float("nan") for t in c.tensors]) is None
    assert _equal(before, mode.trainer.params) and mode.samples == TARGET  # the accumulation is kept too
    metrics = mode.apply_average(_record(), c.tensors)
    assert metrics is not None and metrics.inner_step == 1
    assert not _equal(before, mode.trainer.params) and mode.samples == 0 and mode.wants_data


def test_per_step_keeps_no_snapshots(bench_of, tmp_path):
    from dtrain.training.snapshots import SnapshotError

    mode = bench_of("gradient").mode
    mode.open_store(tmp_path / "snapshots")
    with pytest.raises(SnapshotError, match="keeps no DiLoCo snapshots"):
        mode.snapshot(0, 0, 0, 16)
    assert not (tmp_path / "snapshots").exists()


# ---------------------------------------------------------------------------------- DiLoCo


def test_diloco_contribution_is_anchor_minus_inner_params(bench_of, tmp_path):
    bench = bench_of("diloco")
    mode = bench.mode
    mode.open_store(tmp_path)
    mode.start_epoch(0)
    anchor = _copy(mode.trainer.params)
    pages = _train(bench)
    assert len(pages) == H and mode.trajectory.steps_done == H and mode.samples == 4 * H and not mode.wants_data
    assert _equal(anchor, mode.trainer.params)  # inner steps never move the anchor
    c = mode.contribution(mode.samples, weight_cap=mode.weight_cap)
    assert all(p.numel() == 0 for p in mode.inner.params)  # a miner's inner copy waits on disk (offload.py)
    mode.inner.resident()
    assert all(torch.equal(t, a - p.detach()) for t, a, p in zip(c.tensors, anchor, mode.inner.params))
    assert c.weight == 4.0 * H and len(c.report.steps) == H and [p.page for p in c.report.pages] == pages
    # the report commits to what is sent: the sum of the step updates is the pseudo-gradient's sketch
    from dtrain.sketch import WORK_SKETCH_K, gradient_sketch
    from dtrain.training.work import work_nonce

    sent = gradient_sketch(c.tensors, work_nonce(bench.run_id, 0), k=WORK_SKETCH_K).tolist()
    assert sent == pytest.approx(c.report.contribution_sketch(), rel=1e-4, abs=1e-6)
    assert [s.step for s in c.report.snapshots] == [0, 2]
    assert mode.snapshot(0, 2, 0, 8) and mode.progress().inner_step == H


def test_diloco_apply_average_takes_the_outer_step_then_the_inner_copy_restarts(bench_of, tmp_path):
    bench = bench_of("diloco")
    mode = bench.mode
    mode.open_store(tmp_path)
    mode.start_epoch(0)
    anchor = _copy(mode.trainer.params)
    _train(bench)
    c = mode.contribution(mode.samples, weight_cap=mode.weight_cap)
    averaged = _copy(c.tensors)
    assert mode.apply_average(_record(), averaged) is not None
    # the first Nesterov step from zero momentum: anchor - lr * (1 + momentum) * average
    for p, a, g in zip(mode.trainer.params, anchor, c.tensors):
        torch.testing.assert_close(p.detach(), a - OUTER_LR * (1 + OUTER_MOMENTUM) * g, rtol=1e-5, atol=1e-6)
    _, exp_avg, _ = snapshots.inner_state(mode.inner)
    mode.start_epoch(1)
    assert _equal(mode.inner.params, mode.trainer.params)
    assert mode.trajectory.epoch == 1 and mode.trajectory.steps_done == 0 and mode.samples == 0 and mode.wants_data
    # the moments it committed at the end of epoch 0 (its carry) go on into epoch 1
    assert mode.trajectory.t0 == H and _equal(snapshots.inner_state(mode.inner)[1], exp_avg)
    assert mode.snapshot(1, 0, 0, 8)


def test_diloco_keeps_its_moments_only_for_the_epoch_after_the_one_it_committed(bench_of, tmp_path):
    bench = bench_of("diloco")
    mode = bench.mode
    mode.open_store(tmp_path)

    def epoch_then_contribute(epoch: int):
        mode.start_epoch(epoch)
        _train(bench, epoch=epoch)
        return mode.contribution(mode.samples, weight_cap=mode.weight_cap)

    def fresh() -> bool:
        return mode.trajectory.t0 == 0 and not mode.inner.optimizer.state

    epoch_then_contribute(0)
    mode.start_epoch(2)  # a catch-up past the next epoch: nothing committed leads here
    assert fresh()
    epoch_then_contribute(2)
    _train(bench, epoch=2)  # nothing more to train at H steps; one more page would change the moments
    mode.start_epoch(2)  # the same epoch again (a resume): the trajectory restarts
    assert fresh()
    # no contribution this epoch: nothing was committed, so nothing carries over
    _train(bench, epoch=2)
    mode.start_epoch(3)
    assert fresh()
    # committed, then one more inner step before the next epoch: not the committed state any more
    mode.start_epoch(4)
    for _ in range(H - 1):
        _train_one(bench, epoch=4)
    mode.contribution(mode.samples, weight_cap=mode.weight_cap)
    _train_one(bench, epoch=4)
    mode.start_epoch(5)
    assert fresh()
    # the honest path: committed at the end of epoch 5, epoch 6 starts from those moments
    report = epoch_then_contribute(5).report
    mode.start_epoch(6)
    assert mode.trajectory.t0 == report.carry.step == H


def test_diloco_failed_round_changes_nothing(bench_of, tmp_path):
    bench = bench_of("diloco")
    mode = bench.mode
    mode.open_store(tmp_path)
    mode.start_epoch(0)
    _train(bench)
    assert all(p.numel() == 0 for p in mode.inner.params)  # H steps taken: idle on disk until the round
    mode.inner.resident()
    anchor, inner = _copy(mode.trainer.params), _copy(mode.inner.params)
    c = mode.contribution(mode.samples, weight_cap=mode.weight_cap)
    assert mode.apply_average(_record(ok=False), c.tensors) is None
    assert mode.apply_average(_record(), [t * float("inf") for t in c.tensors]) is None
    mode.inner.resident()  # back from disk bit for bit
    assert _equal(anchor, mode.trainer.params) and _equal(inner, mode.inner.params)
    # the inner steps wait for the next round: the same contribution, the same report
    again = mode.contribution(mode.samples, weight_cap=mode.weight_cap)
    assert _equal(c.tensors, again.tensors) and again.report == c.report


# ---------------------------------------------------------------------------------- audits


def _reader_of(miner):
    return lambda epoch, step, offset, length, timeout_s: miner.snapshot(epoch, step, offset, length)


def test_per_step_audit_passes_honest_pages_and_catches_another_miners(bench_of):
    miner, validator = bench_of("gradient"), bench_of("gradient")
    _train(miner, uid=3)
    report = miner.mode.contribution(miner.mode.samples, 100.0).report
    verdicts = validator.mode.audit([AuditRequest(uid=3, report=report), AuditRequest(uid=4, report=report),
                                     AuditRequest(uid=5, report=validator.mode.empty_report(0))],
                                    epoch=0, rng=random.Random(1))
    assert verdicts[0].passed and verdicts[0].audits, verdicts[0]
    assert not verdicts[1].passed and "page" in verdicts[1].problem  # uid 4's assignment names other pages
    assert verdicts[2] is None  # nothing committed, nothing to audit


def test_diloco_audit_replays_an_honest_trajectory_and_catches_made_up_steps(bench_of, tmp_path):
    miner, validator = bench_of("diloco"), bench_of("diloco")
    miner.mode.open_store(tmp_path)
    miner.mode.start_epoch(0)
    _train(miner, uid=2)
    report = miner.mode.contribution(miner.mode.samples, miner.mode.weight_cap).report
    honest = AuditRequest(uid=2, report=report, read_snapshot=_reader_of(miner.mode))
    # every stretch (steps 1-2 and 3) passes its replay
    for seed in range(4):
        verdict, = validator.mode.audit([honest], epoch=0, rng=random.Random(seed))
        assert verdict.passed and verdict.audits, verdict.problem
    # a step whose update sketch was made up fails the replay of its stretch
    steps = list(report.steps)
    steps[0] = dataclasses.replace(steps[0], grad_sketch=tuple(-v for v in steps[0].grad_sketch))
    forged = AuditRequest(uid=2, report=dataclasses.replace(report, steps=tuple(steps)),
                          read_snapshot=_reader_of(miner.mode))
    caught = [v for seed in range(8) for v in validator.mode.audit([forged], epoch=0, rng=random.Random(seed))]
    assert any(not v.passed and "inner step 1 failed its replay" in v.problem for v in caught)
    # a snapshot the miner does not serve fails the audit
    unserved = AuditRequest(uid=2, report=report, read_snapshot=lambda *a: b"")
    verdict, = validator.mode.audit([unserved], epoch=0, rng=random.Random(0))
    assert not verdict.passed and "not served" in verdict.problem
    # a trajectory that did not start from this epoch's anchor is refused before any replay
    moved = AuditRequest(uid=2, report=dataclasses.replace(report, start=tuple(v + 1.0 for v in report.start)),
                         read_snapshot=_reader_of(miner.mode))
    verdict, = validator.mode.audit([moved], epoch=0, rng=random.Random(0))
    assert not verdict.passed and "did not start" in verdict.problem


def test_diloco_audit_checks_an_epoch_that_starts_from_carried_moments(bench_of, tmp_path):
    """Epoch 0 from fresh moments, epoch 1 from the moments committed at its end: the validator
    that audited epoch 0 checks epoch 1's start against that commitment, and every stretch of
    epoch 1 (the first from the carried moments, the last against the next carry) replays."""
    miner, validator = bench_of("diloco"), bench_of("diloco")
    miner.mode.open_store(tmp_path)
    miner.mode.start_epoch(0)
    _train(miner, uid=2, epoch=0)
    c0 = miner.mode.contribution(miner.mode.samples, miner.mode.weight_cap)
    read = _reader_of(miner.mode)
    verdict, = validator.mode.audit([AuditRequest(uid=2, report=c0.report, read_snapshot=read)], epoch=0,
                                    rng=random.Random(0))
    assert verdict.passed, verdict.problem
    # the round: both take the same outer step with the (single miner's) average
    for bench in (miner, validator):
        assert bench.mode.apply_average(_record(), _copy(c0.tensors)) is not None
    assert _equal(miner.mode.trainer.params, validator.mode.trainer.params)
    miner.mode.start_epoch(1)
    _train(miner, uid=2, epoch=1)
    report = miner.mode.contribution(miner.mode.samples, miner.mode.weight_cap).report
    assert report.t0 == H and report.carry.step == 2 * H
    honest = AuditRequest(uid=2, report=report, read_snapshot=read)
    for seed in range(6):  # both stretches (steps 1-2 from the carried moments, and step 3)
        verdict, = validator.mode.audit([honest], epoch=1, rng=random.Random(seed))
        assert verdict.passed and verdict.audits, verdict.problem
    # made-up start moments (committed in the step-0 snapshot and served): not what epoch 0 carried
    snap0 = report.snapshots[0]
    forged_start = dataclasses.replace(report, snapshots=(
        dataclasses.replace(snap0, exp_avg=tuple(2 * x for x in snap0.exp_avg)), *report.snapshots[1:]))
    verdict, = validator.mode.audit([AuditRequest(uid=2, report=forged_start, read_snapshot=read)], epoch=1,
                                    rng=random.Random(0))
    assert not verdict.passed and "not the ones it committed at the end of epoch 0" in verdict.problem
    # a carry into epoch 2 that is not where the steps end: caught by the replay of the last stretch
    forged_carry = dataclasses.replace(report, carry=dataclasses.replace(
        report.carry, exp_avg_sq=tuple(x * 0.5 for x in report.carry.exp_avg_sq)))
    caught = [v for seed in range(8) for v in validator.mode.audit(
        [AuditRequest(uid=2, report=forged_carry, read_snapshot=read)], epoch=1, rng=random.Random(seed))]
    assert any("moments carried into the next epoch are not what steps 3-3 produce" in v.problem for v in caught)
    # served start moments other than the committed ones: caught when the replay starts at step 0
    def other_moments(epoch, step, offset, length, timeout_s):
        data = bytearray(miner.mode.snapshot(epoch, step, 0, 1 << 30))
        if step == 0:
            p, m, v = snapshots.decode(data, [q.shape for q in miner.mode.trainer.params])
            data = bytearray(snapshots.encode(p, [-x for x in m], v))
        return bytes(data[offset:offset + length])
    verdicts = [v for seed in range(8) for v in validator.mode.audit(
        [AuditRequest(uid=2, report=report, read_snapshot=other_moments)], epoch=1, rng=random.Random(seed))]
    assert any("snapshot at inner step 0 is not the committed optimizer state" in v.problem for v in verdicts)
    # a validator that did not see epoch 0 cannot check the carried start; it replays the rest
    newcomer = bench_of("diloco")
    newcomer.mode.trainer.copy_parameters_from(validator.mode.trainer.params)
    verdict, = newcomer.mode.audit([honest], epoch=1, rng=random.Random(0))
    assert verdict.passed, verdict.problem
    # one that saw this miner end epoch 0 without a step knows there was nothing to carry
    other = bench_of("diloco")
    other.mode.trainer.copy_parameters_from(validator.mode.trainer.params)
    assert other.mode.audit([AuditRequest(uid=2, report=other.mode.empty_report(0))], epoch=0,
                            rng=random.Random(0)) == [None]
    verdict, = other.mode.audit([honest], epoch=1, rng=random.Random(0))
    assert not verdict.passed and "committed none at the end of epoch 0" in verdict.problem



def test_diloco_drops_a_part_batch_left_at_its_round_so_the_next_epoch_commits_only_its_own_pages(tmp_path):
    """The round ends an epoch one inner step and half a local batch in: the half batch (taken at
    the old parameters) must not go into the next epoch's first step, whose moments are carried,
    or that step claims more samples than its pages hold and its replay fails (an honest miner
    on probation; issue #50's CI failure)."""
    from dtrain.neurons.runtime import build_workbench

    cfg = _config("diloco")
    cfg.training.local_batch_size = 8  # two pages per inner step
    miner, validator = build_workbench(cfg), build_workbench(cfg)
    miner.mode.open_store(tmp_path)
    miner.mode.start_epoch(0)
    for counter, page in enumerate(_own_pages(miner, 2, 0, 3)):
        miner.mode.train_page(miner.reader.read_pages([page]), page=page, counter=counter, epoch=0)
    assert miner.mode.trajectory.steps_done == 1 and miner.mode.inner.accumulated_samples == 4
    c0 = miner.mode.contribution(miner.mode.samples, miner.mode.weight_cap)
    read = _reader_of(miner.mode)
    verdict, = validator.mode.audit([AuditRequest(uid=2, report=c0.report, read_snapshot=read)], epoch=0,
                                    rng=random.Random(0))
    assert verdict.passed, verdict.problem
    for bench in (miner, validator):
        assert bench.mode.apply_average(_record(), _copy(c0.tensors)) is not None
    miner.mode.start_epoch(1)
    assert miner.mode.trajectory.t0 == 1  # the committed moments carry on
    assert miner.mode.inner.accumulated_samples == 0
    _train(miner, uid=2, epoch=1)
    report = miner.mode.contribution(miner.mode.samples, miner.mode.weight_cap).report
    assert [(s.samples, len(s.pages)) for s in report.steps] == [(8, 2)] * H
    for seed in range(6):  # every stretch replays, the first from the carried moments
        verdict, = validator.mode.audit([AuditRequest(uid=2, report=report, read_snapshot=read)], epoch=1,
                                        rng=random.Random(seed))
        assert verdict.passed, verdict.problem

# ---------------------------------------------------------------------------------- one real round


@pytest.mark.slow
def test_a_real_diloco_round_between_two_peers_keeps_their_replicas_identical(bench_of, tmp_path):
    from dtrain.swarm.averaging import GradientSwarm
    from dtrain.swarm.loopback import local_nodes, run_concurrently
    from dtrain.training.work import work_nonce
    from tests.swarm_checks import loopback_config

    benches = [bench_of("diloco") for _ in range(2)]
    for i, b in enumerate(benches):
        b.mode.open_store(tmp_path / f"m{i}")
        b.mode.start_epoch(0)
        _train(b, uid=i + 1)
    anchor = _copy(benches[0].trainer.params)
    contributions = [b.mode.contribution(b.mode.samples, b.mode.weight_cap) for b in benches]
    sent = [_copy(c.tensors) for c in contributions]
    cfg = loopback_config("modes-diloco", 2, require_commitments=True, aggregation="centered_clip")
    with local_nodes(2) as nodes:
        swarms = [GradientSwarm(n.dht, [p.detach() for p in b.trainer.params], b.swarm_fingerprint, cfg,
                                mode="diloco", report_type=b.mode.report_type) for n, b in zip(nodes, benches)]
        try:
            records = run_concurrently(
                [lambda s=s, c=c: s.run_round(c.tensors, weight=c.weight, cap=c.weight, tokens=int(c.weight) * 32,
                                              work=c.report, work_nonce=work_nonce("modes-test", 0))
                 for s, c in zip(swarms, contributions)], timeout_s=300)
        finally:
            for s in swarms:
                s.shutdown()
    assert all(r.ok and r.fraction_averaged == 1.0 for r in records), [r.error for r in records]
    for b, c, r in zip(benches, contributions, records):
        assert b.mode.apply_average(r, c.tensors) is not None
        b.mode.start_epoch(1)
    assert _equal(benches[0].trainer.params, benches[1].trainer.params)
    # equal weights: the outer step applies the mean pseudo-gradient (CenteredClip keeps two honest peers' mean)
    mean = [(x + y) / 2 for x, y in zip(*sent)]
    for p, a, g in zip(benches[0].trainer.params, anchor, mean):
        torch.testing.assert_close(p.detach(), a - OUTER_LR * (1 + OUTER_MOMENTUM) * g, rtol=1e-4, atol=1e-6)
    assert all(_equal(b.mode.inner.params, b.trainer.params) for b in benches)
