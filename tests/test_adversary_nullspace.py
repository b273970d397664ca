"""Null-space cheats: vectors the public range sketch cannot see, and the adversaries built on them.

The sketch's seed (the epoch's work nonce) is public, so a cheater can add anything in the null
space of every part's sketch. These tests pin down the math (``sketch_buckets`` is the very
projection ``range_sketch`` applies; ``project_out_sketch`` lands in its null space) and that the
two adversaries' alterations are invisible to the public sketches while really sabotaging.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dtrain.sandbox.adversary import NULLSPACE_SCALE, _nullspace_reduce, nullspace_altered, nullspace_reduced
from dtrain.swarm.averaging.contribution import PartLayout, compute_claims
from dtrain.swarm.averaging.settings import AveragingConfig, part_size_for
from dtrain.swarm.wire import make_compression
from dtrain.sketch import DEFAULT_K, project_out_sketch, range_sketch, sketch_buckets
from dtrain.training.work import work_nonce

NONCE = work_nonce("nullspace-test", 3)


def _randn(n: int, seed: int, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||."""
    return float((a - b).norm() / b.norm())


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().reshape(-1), b.double().reshape(-1)
    return float(a @ b / (a.norm() * b.norm()))


@pytest.mark.parametrize("param_index, start, n, k", [
    (0, 0, 1000, DEFAULT_K),       # row-aligned
    (3, 37, 50, DEFAULT_K),        # less than a row, starting mid-row
    (2, 100, 5000, DEFAULT_K),     # several rows, starting mid-row
    (1, 5 * 64 + 63, 1, DEFAULT_K),  # a single element, last lane of its row
    (4, 10, 777, 16),              # k < 64: lanes of one row share buckets
])
def test_sketch_buckets_is_the_range_sketch_projection(param_index, start, n, k):
    values = _randn(n, seed=param_index)
    buckets, signs = sketch_buckets(n, param_index, start, NONCE, k)
    assert buckets.dtype == np.int64 and signs.dtype == np.float64
    assert buckets.shape == signs.shape == (n,)
    assert buckets.min() >= 0 and buckets.max() < k
    assert set(np.unique(signs)) <= {-1.0, 1.0}
    scattered = torch.from_numpy(np.bincount(buckets, weights=signs * values.numpy(), minlength=k))
    assert _relative(scattered, range_sketch(values, param_index, start, NONCE, k=k)) < 1e-9


def test_projection_lands_in_the_null_space_and_keeps_most_of_the_vector():
    values = _randn(100_000, seed=7)
    projected = project_out_sketch(values, 5, 123, NONCE)
    assert projected.dtype == values.dtype and projected.shape == values.shape
    before = range_sketch(values, 5, 123, NONCE).norm()
    assert float(range_sketch(projected, 5, 123, NONCE).norm() / before) < 1e-9
    # an orthogonal projection: idempotent, and what it removes is orthogonal to what it keeps
    assert _relative(project_out_sketch(projected, 5, 123, NONCE), projected) < 1e-12
    removed = values - projected
    assert abs(float(removed @ projected)) < 1e-9 * float(values @ values)
    # only k = 64 of 100k dimensions go
    assert _cosine(projected, values) > 0.99


def test_projection_keeps_float32_and_its_sketch_moves_by_rounding_only():
    values = _randn(4096, seed=8, dtype=torch.float32)
    projected = project_out_sketch(values, 0, 64, NONCE)
    assert projected.dtype == torch.float32
    before = range_sketch(values, 0, 64, NONCE).norm()
    assert float(range_sketch(projected, 0, 64, NONCE).norm() / before) < 1e-5


def _contribution() -> list[torch.Tensor]:
    """A small model's float32 mean gradient: a matrix, a vector, and a tensor smaller than a part."""
    shapes = [(30, 70), (1000,), (5, 7)]
    return [_randn(int(np.prod(s)), seed=10 + i, dtype=torch.float32).reshape(s) for i, s in enumerate(shapes)]


def test_nullspace_sender_keeps_every_public_part_sketch_and_sabotages():
    honest = _contribution()
    compression = make_compression("none")
    layout = PartLayout.of(honest, compression, part_size_bytes=1024)  # 256 values a part
    assert sum(1 for i, _, _ in layout.parts if i == 0) > 2  # several parts a tensor
    altered = nullspace_altered(honest, layout, NONCE)
    assert [t.shape for t in altered] == [t.shape for t in honest]
    assert all(t.dtype == torch.float32 for t in altered)
    for param_index, start, length in layout.parts:
        want = range_sketch(honest[param_index].reshape(-1)[start:start + length], param_index, start, NONCE)
        got = range_sketch(altered[param_index].reshape(-1)[start:start + length], param_index, start, NONCE)
        assert _relative(got, want) < 1e-6, (param_index, start)
    # the swarm's own claims of what it sends: those of the honest contribution
    claims = compute_claims(altered, layout, NONCE, compression)
    honest_claims = compute_claims(honest, layout, NONCE, compression)
    assert np.linalg.norm(claims - honest_claims) <= 1e-6 * np.linalg.norm(honest_claims)
    flat_honest = torch.cat([t.reshape(-1) for t in honest])
    flat_altered = torch.cat([t.reshape(-1) for t in altered])
    assert _cosine(flat_altered, flat_honest) < 0  # it points against the gradient
    if NULLSPACE_SCALE == 2.0:  # a reflection: the norm checks see the honest norm
        assert abs(float(flat_altered.norm() / flat_honest.norm()) - 1) < 1e-5


def test_nullspace_sender_under_the_swarm_default_wire_settings():
    # the layout a miner's swarm uses by default for this vector (8-bit parts of 128 KiB): parts
    # of ~110k values
    settings = AveragingConfig()
    honest = [_randn(250_000, seed=20, dtype=torch.float32)]
    layout = PartLayout.of(honest, make_compression(settings.compression), part_size_for(4 * 250_000))
    assert len(layout) > 1
    altered = nullspace_altered(honest, layout, NONCE)
    for param_index, start, length in layout.parts:
        want = range_sketch(honest[0][start:start + length], param_index, start, NONCE)
        got = range_sketch(altered[0][start:start + length], param_index, start, NONCE)
        assert _relative(got, want) < 1e-6
    assert _cosine(altered[0], honest[0]) < -0.9


def test_nullspace_reducer_keeps_the_part_sketch_and_about_negates():
    averaged = _randn(5000, seed=30, dtype=torch.float32)
    returned = nullspace_reduced(averaged, 2, 1234, NONCE)
    assert returned.dtype == averaged.dtype and returned.shape == averaged.shape
    assert _relative(range_sketch(returned, 2, 1234, NONCE), range_sketch(averaged, 2, 1234, NONCE)) < 1e-6
    assert _cosine(returned, averaged) < -0.9


def test_nullspace_reducer_finds_the_part_from_the_round_plan():
    # a stand-in for what the alteration reads of the round's plan (formation.RoundPlan): the layout,
    # our share (parts 2 and 3, this peer is member 1) and the claims' nonce
    layout = PartLayout(((0, 0, 300), (0, 300, 300), (1, 0, 500), (1, 500, 200)))
    plan = SimpleNamespace(layout=layout, me=1, share_of=lambda k: (2, 4),
                           rules=SimpleNamespace(commitments={}, claims_nonce=NONCE))
    averaged = _randn(200, seed=31, dtype=torch.float32)
    returned = _nullspace_reduce(averaged, plan=plan, part_index=1)  # global part 3: (1, 500, 200)
    assert _relative(range_sketch(returned, 1, 500, NONCE), range_sketch(averaged, 1, 500, NONCE)) < 1e-6
    assert _cosine(returned, averaged) < 0
    # without commitments there is no public sketch to hide in: the part goes back unchanged
    plain = SimpleNamespace(layout=layout, me=1, share_of=lambda k: (2, 4),
                            rules=SimpleNamespace(commitments=None, claims_nonce=""))
    assert _nullspace_reduce(averaged, plan=plain, part_index=0) is averaged


@pytest.mark.parametrize("mode", ["gradient", "diloco"])
def test_nullspace_sender_contribution_passes_the_binding_check_in_both_modes(mode):
    # The real miner and mode (a tiny model on CPU), trained on one batch; of its swarm only the
    # wire settings are read, so a stand-in holds them (small parts: several per tensor).
    import threading

    from dtrain.sandbox.adversary import miner_class
    from dtrain.neurons.runtime import build_workbench
    from dtrain.swarm.averaging.contribution import BINDING_RTOL, Commitment, binding_error
    from dtrain.telemetry import Telemetry
    from tests.test_modes import _config, _train

    cfg = _config(mode)
    bench = build_workbench(cfg)
    bench.mode.start_epoch(0)
    _train(bench, uid=3, epoch=0)
    miner = miner_class("nullspace-sender")(cfg, Telemetry("miner"), threading.Event())
    miner.bench, miner.trainer, miner.uid, miner.epoch = bench, bench.trainer, 3, 0
    settings = AveragingConfig(compression="none", part_size_bytes=4096)
    miner.swarm = SimpleNamespace(config=settings)

    honest = bench.mode.contribution(bench.mode.samples, 1e9)
    sent = miner._contribution(bench.mode.samples, 1e9)
    assert honest.weight > 0  # trained: a round it would join, and cheat in
    assert sent.weight == honest.weight and sent.report == honest.report
    compression = make_compression(settings.compression)
    layout = PartLayout.of(sent.tensors, compression, settings.part_size_bytes)
    nonce = work_nonce(cfg.model.run_id, 0)
    claims = compute_claims(sent.tensors, layout, nonce, compression)
    # the swarm's own binding check: what it sends adds up to the honest report's sketch
    assert binding_error(Commitment.of_claims(nonce, sent.report, claims)) <= BINDING_RTOL["none"]
    flat_honest = torch.cat([t.reshape(-1) for t in honest.tensors])
    flat_sent = torch.cat([t.reshape(-1) for t in sent.tensors])
    assert _cosine(flat_sent, flat_honest) < 0
