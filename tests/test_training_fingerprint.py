"""Gradient fingerprints: honest recomputation matches; other data, model, nonce or tampering do not."""

from __future__ import annotations

import copy
import hashlib

import pytest
import torch

from dtrain.training.data import DataSource, PageReader, PageSpec, assign_pages
from dtrain.sketch import gradient_sketch, range_sketch
from dtrain.training.fingerprint import Fingerprint, Tolerance, compare_fingerprints
from dtrain.training.models import create_model
from dtrain.training.trainer import (
    Trainer,
    TrainerConfig,
    microbatch_gradients,
    recompute_fingerprints,
    trainable_parameters,
)

torch.set_num_threads(2)
MB = 4


@pytest.fixture(scope="module")
def setup():
    from dtrain.training.tokenizer import load_tokenizer

    tok, _ = load_tokenizer(allow_fallback=True, local_files_only=True)
    reader = PageReader(DataSource.shipped(), tok, PageSpec(seq_len=64, page_sequences=4, docs_per_page=8))
    model = create_model("tiny", vocab_size=len(tok), n_positions=64, seed=0)
    # a few steps so the gradients are not those of a random init
    tr = Trainer(model, TrainerConfig(micro_batch_size=8, lr=3e-3, warmup_steps=1))
    for s in range(5):
        tr.train_step(reader.read_pages(assign_pages(run_id="f", uid=0, epoch=0, page_counter=2 * s,
                                                     num_pages=reader.num_pages, count=2)))
    pages = assign_pages(run_id="f", uid=1, epoch=0, page_counter=0, num_pages=reader.num_pages, count=2, nonce="n")
    return model, reader.read_pages(pages), reader.read_pages([pages[0] + 1, pages[1] + 1])


def test_miner_and_validator_agree_exactly_on_the_same_hardware(setup):
    model, x, _ = setup
    miner = Trainer(copy.deepcopy(model), TrainerConfig(micro_batch_size=MB))
    claimed = [r.fingerprint for r in miner.accumulate(x, fingerprint_nonce="nonce-1")]
    before = [p.detach().clone() for p in model.parameters()]
    reference = recompute_fingerprints(model, x, nonce="nonce-1", micro_batch_size=MB)
    assert len(claimed) == len(reference) == 2
    for c, r in zip(claimed, reference):
        assert c.sketch == r.sketch and c.loss == r.loss and c.samples == r.samples == MB
        res = compare_fingerprints(c, r)
        assert res.passed and res.cosine == pytest.approx(1.0)
    # the validator's recomputation changed neither the weights nor any .grad
    assert all(p.equal(b) for p, b in zip(model.parameters(), before))
    assert all(p.grad is None for p in model.parameters())
    # and the fingerprinted accumulation is the same gradient as the plain one
    plain = Trainer(copy.deepcopy(model), TrainerConfig(micro_batch_size=MB))
    plain.accumulate(x)
    for a, b in zip(plain.gradients(), miner.gradients()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)


def test_other_batch_fails(setup):
    model, x, y = setup
    ref = recompute_fingerprints(model, x, nonce="n", micro_batch_size=MB)
    other = recompute_fingerprints(model, y, nonce="n", micro_batch_size=MB)
    for o, r in zip(other, ref):
        res = compare_fingerprints(o, r)
        assert not res.passed and res.cosine < 0.9, res


def test_other_model_fails(setup):
    model, x, _ = setup
    ref = recompute_fingerprints(model, x, nonce="n", micro_batch_size=MB)
    stranger = create_model("tiny", vocab_size=model.config.vocab_size, n_positions=64, seed=99)
    other = recompute_fingerprints(stranger, x, nonce="n", micro_batch_size=MB)
    for o, r in zip(other, ref):
        assert not compare_fingerprints(o, r).passed


def test_other_nonce_gives_another_sketch(setup):
    model, x, _ = setup
    a = recompute_fingerprints(model, x[:MB], nonce="n1", micro_batch_size=MB)[0]
    b = recompute_fingerprints(model, x[:MB], nonce="n2", micro_batch_size=MB)[0]
    assert a.loss == b.loss
    assert not compare_fingerprints(a, b).passed  # a precomputed sketch is useless for a new nonce


@pytest.mark.parametrize("tamper", ["scale", "noise", "drop_layer", "sign_flip_block"])
def test_tampered_gradient_fails(setup, tamper):
    model, x, _ = setup
    params = trainable_parameters(model)
    loss, grads = microbatch_gradients(model, params, x[:MB], "fp32")
    honest = Fingerprint(float(loss), tuple(gradient_sketch(grads, "t").tolist()), MB)
    g = [t.clone() for t in grads]
    gen = torch.Generator().manual_seed(0)
    norm = torch.sqrt(sum((t.double() ** 2).sum() for t in g))
    if tamper == "scale":
        g = [t * 1.5 for t in g]
    elif tamper == "noise":  # noise with 30% of the gradient's norm
        total = sum(t.numel() for t in g)
        g = [t + torch.randn(t.shape, generator=gen) * float(norm) * 0.3 / total**0.5 for t in g]
    elif tamper == "drop_layer":  # zero the largest tensor's gradient (e.g. skip the embeddings)
        i = max(range(len(g)), key=lambda j: float(g[j].norm()))
        g[i] = torch.zeros_like(g[i])
    else:  # flip the sign of the first block's gradients
        for j, (name, _) in enumerate([(n, p) for n, p in model.named_parameters() if p.requires_grad]):
            if ".h.0." in name:
                g[j] = -g[j]
    tampered = Fingerprint(float(loss), tuple(gradient_sketch(g, "t").tolist()), MB)
    res = compare_fingerprints(tampered, honest)
    assert not res.passed, res


def test_loss_and_sample_mismatch_fail():
    s = tuple(float(i) for i in range(1, 17))
    ref = Fingerprint(3.0, s, 4)
    assert compare_fingerprints(Fingerprint(3.0, s, 4), ref).passed
    assert not compare_fingerprints(Fingerprint(3.2, s, 4), ref).passed
    assert not compare_fingerprints(Fingerprint(3.0, s, 3), ref).passed
    assert not compare_fingerprints(Fingerprint(float("nan"), s, 4), ref).passed
    # tolerance is configurable and documented
    assert compare_fingerprints(Fingerprint(3.2, s, 4), ref, Tolerance(loss_atol=0.5)).passed
    # The same numbers answered for another challenge prove nothing about this one.
    assert not compare_fingerprints(Fingerprint(3.0, s, 4, nonce="other"), ref).passed
    assert Fingerprint.from_dict(ref.to_dict()) == ref


def _mix64(x: int) -> int:
    # reference splitmix64 finaliser in plain Python integers (the protocol definition)
    m = (1 << 64) - 1
    x = (x * 0x9E3779B97F4A7C15) & m
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


def _reference_sketch(entries, nonce: str, k: int) -> list[float]:
    """The documented projection (docs/training.md, "Gradient fingerprint") in plain Python
    integers, for ``entries`` = (parameter index, flat element index, value)."""

    def seed(i):
        h = hashlib.sha256()
        for part in (b"dtrain/fingerprint/v2", nonce.encode(), str(i).encode()):
            h.update(len(part).to_bytes(8, "big"))
            h.update(part)
        return int.from_bytes(h.digest()[:8], "big")  # unsigned view of the same 64 bits

    want = [0.0] * k
    for i, n, v in entries:
        row, lane = divmod(n, 64)
        signs = _mix64((seed(i) + 2 * row) % (1 << 64))
        offset = (_mix64((seed(i) + 2 * row + 1) % (1 << 64)) >> 32) % k
        want[(offset + lane) % k] += v if (signs >> lane) & 1 else -v
    return want


def test_sketch_matches_the_documented_projection():
    nonce = "proto"
    g0 = torch.zeros(3, 5)
    g1 = torch.zeros(70_000)
    g0[1, 2] = 1.0  # flat index 7 of parameter 0
    g1[66_000] = 2.0
    g1[5] = -0.5
    g1[63] = 0.25  # lane 63: the sign word's top bit
    g1[64] = 8.0  # the next row
    entries = ((0, 7, 1.0), (2, 66_000, 2.0), (2, 5, -0.5), (2, 63, 0.25), (2, 64, 8.0))
    for k in (64, 7, 256):
        sketch = gradient_sketch([g0, None, g1], nonce, k=k, chunk=1 << 16)  # g1 spans two chunks
        assert sketch.tolist() == _reference_sketch(entries, nonce, k)
        assert sketch.abs().sum() == 11.75
    # any range, aligned to the rows or not, is the same projection of its elements
    values = torch.tensor([1.0, -2.0, 4.0, 0.5, 16.0])
    for start in (0, 62, 64, 1000, 2**40 + 3):
        got = range_sketch(values, 3, start, nonce, k=64)
        assert got.tolist() == _reference_sketch([(3, start + j, float(v)) for j, v in enumerate(values)], nonce, 64)


def test_sketch_estimates_the_gradient_norm(setup):
    model, x, _ = setup
    _, grads = microbatch_gradients(model, trainable_parameters(model), x[:MB], "fp32")
    sk = gradient_sketch(grads, "norm")
    true = float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads)))
    est = float(sk.norm())  # E[|S g|^2] = |g|^2
    assert 0.6 * true < est < 1.4 * true
