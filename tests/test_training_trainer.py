"""The trainer on the shipped text: loss falls, accumulation and the swarm seam, optimizers, precision."""

from __future__ import annotations

import math

import pytest
import torch

from dtrain.training.data import DataSource, PageReader, PageSpec, assign_pages
from dtrain.training.errors import TrainerStateError
from dtrain.training.models import create_model
from dtrain.training.optimizers import lr_factor
from dtrain.training.precision import resolve_precision
from dtrain.training.trainer import Trainer, TrainerConfig

torch.set_num_threads(2)


@pytest.fixture(scope="module")
def reader():
    from dtrain.training.tokenizer import load_tokenizer

    tok, _ = load_tokenizer(allow_fallback=True, local_files_only=True)
    return PageReader(DataSource.shipped(), tok, PageSpec(seq_len=64, page_sequences=4, docs_per_page=8))


def _model(reader, seed=0):
    return create_model("tiny", vocab_size=len(reader.tokenizer), n_positions=64, seed=seed)


def _batch(reader, counter, count=2, uid=0):
    pages = assign_pages(run_id="t", uid=uid, epoch=0, page_counter=counter, num_pages=reader.num_pages, count=count)
    return reader.read_pages(pages)


@pytest.mark.parametrize("optimizer", ["adamw", "lamb"])
def test_loss_falls_on_shipped_text(reader, optimizer):
    # LAMB steps are relative to each tensor's norm (trust ratio), so it takes a larger lr
    lr = 3e-3 if optimizer == "adamw" else 5e-2
    seen = []
    tr = Trainer(_model(reader), TrainerConfig(micro_batch_size=4, lr=lr, warmup_steps=3, total_steps=40,
                                               optimizer=optimizer), on_metrics=seen.append)
    losses = [tr.train_step(_batch(reader, 2 * s)).loss for s in range(30)]
    assert all(math.isfinite(x) for x in losses)
    assert sum(losses[-5:]) / 5 < losses[0] - 1.5, losses
    assert [m.inner_step for m in seen] == list(range(1, 31))
    assert tr.counters.samples == 30 * 8 and tr.counters.tokens == 30 * 8 * 64
    assert all(m.tokens_per_s > 0 and m.grad_norm > 0 for m in seen)
    # warmup then cosine decay
    assert seen[0].lr < seen[2].lr and seen[-1].lr < seen[5].lr


def test_micro_batching_gives_the_full_batch_gradient(reader):
    x = _batch(reader, 0)
    grads = []
    for mb in (8, 2):
        tr = Trainer(_model(reader), TrainerConfig(micro_batch_size=mb))
        results = tr.accumulate(x)
        assert len(results) == 8 // mb and tr.accumulated_samples == 8
        grads.append(torch.cat([g.reshape(-1) for g in tr.gradients()]) / tr.accumulated_samples)
    assert torch.allclose(grads[0], grads[1], rtol=1e-4, atol=1e-6)


def test_swarm_seam_replace_gradients_then_step(reader):
    x = _batch(reader, 0)
    a = Trainer(_model(reader), TrainerConfig(micro_batch_size=4, local_batch_size=8, grad_clip=None))
    b = Trainer(_model(reader), TrainerConfig(micro_batch_size=4, grad_clip=None))
    a.accumulate(x[:4])
    assert a.accumulated_samples == 4 and not a.local_batch_full
    a.accumulate(x[4:])
    assert a.accumulated_samples == 8 and a.local_batch_full
    summed = [g.clone() for g in a.gradients()]
    # b accumulated other data, then receives a's gradients (as after an all-reduce) as a per-sample mean
    b.accumulate(_batch(reader, 5))
    b.set_gradients([g / 8 for g in summed], num_samples=1)
    a.step()
    b.step()
    assert torch.equal(a.flat_parameters(), b.flat_parameters())
    assert a.accumulated_samples == 0 and all(p.grad is None for p in a.params)


def test_zero_grad_and_step_without_samples(reader):
    tr = Trainer(_model(reader), TrainerConfig(micro_batch_size=4))
    with pytest.raises(TrainerStateError):
        tr.step()
    before = tr.flat_parameters()
    tr.accumulate(_batch(reader, 0))
    tr.zero_grad()
    with pytest.raises(TrainerStateError):
        tr.step()
    assert torch.equal(before, tr.flat_parameters())


def test_flat_parameters_round_trip(reader):
    a, b = Trainer(_model(reader, seed=1), TrainerConfig()), Trainer(_model(reader, seed=2), TrainerConfig())
    flat = a.flat_parameters()
    assert flat.numel() == sum(p.numel() for p in a.params)
    assert not torch.equal(flat, b.flat_parameters())
    b.set_flat_parameters(flat)
    assert torch.equal(flat, b.flat_parameters())
    with pytest.raises(ValueError):
        b.set_flat_parameters(flat[:-1])


def test_gradient_clipping_bounds_the_update(reader):
    x = _batch(reader, 0)
    tr = Trainer(_model(reader), TrainerConfig(micro_batch_size=8, grad_clip=1e-3))
    tr.accumulate(x)
    m = tr.step()
    assert m.grad_norm > 1e-3  # reported norm is before clipping


def test_lr_schedule_shape():
    f = [lr_factor(s, warmup_steps=10, total_steps=110, min_lr_ratio=0.1) for s in range(130)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert f[60] == pytest.approx(0.55) and f[110] == pytest.approx(0.1) and f[129] == pytest.approx(0.1)
    assert all(f[i] >= f[i + 1] for i in range(10, 129))


def test_precision_resolution():
    assert resolve_precision("auto", "cpu") == "fp32"
    assert resolve_precision("bf16", "cpu") == "bf16"
    with pytest.raises(ValueError):
        Trainer(torch.nn.Linear(2, 2), TrainerConfig(precision="fp16"))


def test_bf16_autocast_on_cpu_is_close_to_fp32(reader):
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            torch.ones(2, 2) @ torch.ones(2, 2)
    except RuntimeError:
        pytest.skip("this torch build has no CPU bf16 autocast")
    x = _batch(reader, 0)
    out = {}
    for prec in ("fp32", "bf16"):
        tr = Trainer(_model(reader), TrainerConfig(micro_batch_size=8, precision=prec))
        loss = tr.accumulate(x)[0].loss
        out[prec] = (loss, torch.cat([g.reshape(-1) for g in tr.gradients()]))
        assert tr.params[0].dtype == torch.float32  # master weights stay fp32
    assert math.isfinite(out["bf16"][0]) and abs(out["bf16"][0] - out["fp32"][0]) < 0.05
    assert out["bf16"][0] != out["fp32"][0]  # autocast really ran in bf16
    cos = torch.nn.functional.cosine_similarity(out["bf16"][1], out["fp32"][1], dim=0)
    assert cos > 0.99


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_auto_precision_trains(reader):
    tr = Trainer(_model(reader), TrainerConfig(micro_batch_size=4, device="cuda"))
    assert tr.precision == ("bf16" if torch.cuda.is_bf16_supported() else "fp32")
    losses = [tr.train_step(_batch(reader, 2 * s)).loss for s in range(10)]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
