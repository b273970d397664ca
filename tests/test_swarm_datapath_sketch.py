"""The CPU path of the work/fingerprint sketch is the device path's projection, bit for bit.

``dtrain.training.fingerprint`` computes a sketch on CPU with numpy's native uint64 hashing
and an integer sign flip, range by range, and on other devices (GPUs) with torch's int64 ops
and a ``torch.where``, many ranges in one pass. Both must give the same projection: a CPU validator recomputes what a GPU
miner reports, and a reducer's check recomputes the claims a sender computed. On CPU, where
torch's additions run in order, the two paths must agree to the last bit; the documented
definition itself is tested in test_training_fingerprint.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dtrain import sketch as fp
from dtrain.sketch import gradient_sketch, range_sketch


def _device_path_add(out, piece, seed, start):
    # _add_range through the torch-only path (what a GPU runs), here on CPU
    fp._add_pieces_torch(out, [(piece, seed, start)])


def _device_path_range_sketch(values, param_index, start, nonce, k=fp.DEFAULT_K, chunk=fp.CHUNK):
    flat = values.detach().reshape(-1)
    out = torch.zeros(k, dtype=torch.float64)
    seed = fp._param_seed(nonce, param_index)
    for offset in range(0, flat.numel(), chunk):
        _device_path_add(out, flat[offset:offset + chunk], seed, start + offset)
    return out


def _values(n: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # magnitudes over many orders, signed zeros and huge values: a wrong sign, bucket or
    # widening shows up in the last bits
    scale = torch.exp(torch.randn(n, generator=g, dtype=torch.float64) * 8)
    x = torch.randn(n, generator=g, dtype=torch.float64) * scale
    x[::97] = 0.0
    x[1::101] = -0.0
    x[2::1009] = 3.0e38
    return x.to(dtype)


@pytest.mark.parametrize("k", [64, 1, 7, 100, 128])
@pytest.mark.parametrize("n,start", [(32768, 0), (32768, 12_345_678), (1, 5), (4097, 2**40 + 3), (131072, 99),
                                     (64, 64), (130, 62)])
def test_cpu_range_sketch_is_bit_identical_to_the_device_path(k, n, start):
    values = _values(n, seed=n + k)
    for nonce, param in (("dtrain/work/v1:run:3", 0), ("other", 17)):
        want = _device_path_range_sketch(values, param, start, nonce, k=k)
        got = range_sketch(values, param, start, nonce, k=k)
        assert got.numpy().tobytes() == want.numpy().tobytes()  # signed zeros included


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_every_float_dtype_is_widened_exactly(dtype):
    # values inside every dtype's range (3e38 is inf in float16: the sums would be NaN)
    values = (torch.randn(5000, generator=torch.Generator().manual_seed(3)) * 100).to(dtype)
    values[::97] = 0.0
    want = _device_path_range_sketch(values.double(), 2, 64 * 7, "n")
    assert torch.equal(range_sketch(values, 2, 64 * 7, "n"), want)
    assert torch.equal(range_sketch(values, 2, 64 * 7 + 5, "n"), _device_path_range_sketch(values.double(), 2,
                                                                                               64 * 7 + 5, "n"))


def test_gradient_sketch_over_chunks_and_parameters_is_bit_identical():
    grads = [_values(5 * 7, seed=1).reshape(5, 7), None, _values(300_001, seed=2),
             _values(3, seed=3, dtype=torch.float16)]
    for chunk in (1 << 16, 1000, fp.CHUNK):  # 1000: chunks that start inside a row
        want = torch.zeros(64, dtype=torch.float64)
        for i, g in enumerate(grads):
            if g is None:
                continue
            flat = g.reshape(-1)
            seed = fp._param_seed("n", i)
            for start in range(0, flat.numel(), chunk):
                _device_path_add(want, flat[start:start + chunk], seed, start)
        assert gradient_sketch(grads, "n", chunk=chunk).numpy().tobytes() == want.numpy().tobytes()


def test_the_device_path_batches_many_pieces_into_one_pass():
    # a GPU sketches all of a model's parameters in one set of kernels: the batch must be the
    # sum of its pieces' sketches, whatever their sizes and alignments
    gen = torch.Generator().manual_seed(9)
    pieces = [(torch.randn(n, generator=gen), fp._param_seed("b", i), start)
              for i, (n, start) in enumerate([(768, 0), (1, 5), (4097, 2**40 + 3), (64, 64), (130, 62), (100_000, 0)])]
    for k in (64, 7, 256):
        want = torch.zeros(k, dtype=torch.float64)
        for values, seed, start in pieces:
            fp._add_range(want, values, seed, start)
        got = torch.zeros(k, dtype=torch.float64)
        fp._add_pieces_torch(got, pieces)
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    # and the batching (DEVICE_BATCH) splits a model's pieces without changing the sum
    grads = [torch.randn(5000, generator=gen), None, torch.randn(3, 70, generator=gen), torch.randn(1, generator=gen)]
    want = gradient_sketch(grads, "m", chunk=1000)
    pieces = [(g.reshape(-1)[s:s + 1000], fp._param_seed("m", i), s)
              for i, g in enumerate(grads) if g is not None for s in range(0, g.numel(), 1000)]
    for limit, count in ((1000, 6), (2500, 3), (1 << 20, 1)):  # 5 x 1000 values, then 210 and 1
        batches = fp._device_batches(pieces + [(torch.zeros(0), 0, 0)], limit)
        assert len(batches) == count and [p for b in batches for p in b] == pieces
        assert all(sum(p[0].numel() for p in b) <= limit for b in batches)
        got = torch.zeros(64, dtype=torch.float64)
        for batch in batches:
            fp._add_pieces_torch(got, batch)
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-12), limit


def test_range_sketches_of_the_pieces_add_up_to_the_whole():
    x = torch.randn(100_003, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    whole = range_sketch(x, 1, 12_345, "a")
    cuts = (0, 7, 4100, 50_001, 100_003)
    pieces = sum(range_sketch(x[a:b], 1, 12_345 + a, "a") for a, b in zip(cuts, cuts[1:]))
    assert torch.allclose(whole, pieces, rtol=1e-12, atol=1e-9)


def test_claims_are_the_range_sketches_of_the_parts():
    # compute_claims (sender) and part_matches_claim (reducer) both go through range_sketch
    from hivemind.compression import NoCompression

    from dtrain.swarm.averaging.contribution import PartLayout, compute_claims, part_matches_claim

    # gradient-like values: claims are float32, so sketches must stay in float32's range
    tensors = [torch.randn(100_000, generator=torch.Generator().manual_seed(11)),
               torch.randn(777, generator=torch.Generator().manual_seed(12))]
    layout = PartLayout.of(tensors, NoCompression(), 2**15)
    claims = compute_claims(tensors, layout, "nonce", NoCompression())
    for g, (i, start, length) in enumerate(layout.parts):
        piece = tensors[i].reshape(-1)[start:start + length]
        want = _device_path_range_sketch(piece, i, start, "nonce").numpy().astype("<f4")
        assert np.array_equal(claims[g], want)
        assert part_matches_claim(piece, claims[g], i, start, "nonce")
        assert not part_matches_claim(-piece, claims[g], i, start, "nonce")
