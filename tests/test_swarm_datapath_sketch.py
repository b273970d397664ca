"""The CPU fast path of the work/fingerprint sketch is the documented projection, bit for bit.

``dtrain.training.fingerprint`` hashes ranges with numpy's native uint64 arithmetic on CPU,
caches the hash of part-sized ranges (a reducer checks the same part of every sender) and
applies signs by multiplying with +-1.0. Sketches are compared with exact equality between
peers' claims and a reducer's recomputation, and between a miner's and a validator's
fingerprints, so the fast path must give exactly what the reference torch path gives: the
same buckets, the same signs, the same additions in the same order.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dtrain.training import fingerprint as fp
from dtrain.training.fingerprint import gradient_sketch, range_sketch


def _reference_add_range(out: torch.Tensor, values: torch.Tensor, seed: int, start: int) -> None:
    # the device-independent torch path (what GPUs run, and what CPUs ran before the fast path)
    part = values.double()
    h = fp._mix64(torch.arange(start, start + part.numel(), dtype=torch.int64) + seed)
    bucket = fp._lshr(h, 32) % out.numel()
    out.index_add_(0, bucket, torch.where((h & 1).bool(), part, -part))


def _reference_range_sketch(values, param_index, start, nonce, k=fp.DEFAULT_K, chunk=fp.CHUNK):
    flat = values.detach().reshape(-1)
    out = torch.zeros(k, dtype=torch.float64)
    seed = fp._param_seed(nonce, param_index)
    for offset in range(0, flat.numel(), chunk):
        _reference_add_range(out, flat[offset:offset + chunk], seed, start + offset)
    return out


def _values(n: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # magnitudes over many orders, signed zeros and huge values: any change in the order of the
    # additions, a bucket or a sign shows up in the last bits
    scale = torch.exp(torch.randn(n, generator=g, dtype=torch.float64) * 8)
    x = torch.randn(n, generator=g, dtype=torch.float64) * scale
    x[::97] = 0.0
    x[1::101] = -0.0
    x[2::1009] = 3.0e38
    return x.to(dtype)


@pytest.mark.parametrize("k", [64, 1, 7, 100, 128])
@pytest.mark.parametrize("n,start", [(32768, 0), (32768, 12_345_678), (1, 5), (4097, 2**40 + 3), (131072, 99)])
def test_range_sketch_is_bit_identical_to_the_reference(k, n, start):
    values = _values(n, seed=n + k)
    for nonce, param in (("dtrain/work/v1:run:3", 0), ("other", 17)):
        want = _reference_range_sketch(values, param, start, nonce, k=k)
        fp._hash_cache.clear()
        cold = range_sketch(values, param, start, nonce, k=k)
        warm = range_sketch(values, param, start, nonce, k=k)  # the cached hash
        assert torch.equal(cold, want) and torch.equal(warm, want)
        assert cold.numpy().tobytes() == want.numpy().tobytes()  # signed zeros included


def test_cached_hash_is_shared_by_senders_and_never_mixed_up():
    # A reducer checks one range of several senders (same hash, other values), then neighbouring
    # ranges and other nonces: every answer must still be the reference's.
    fp._hash_cache.clear()
    for part in range(3):
        start = part * 32768
        for sender in range(4):
            values = _values(32768, seed=100 * part + sender)
            for nonce in ("a", "b"):
                want = _reference_range_sketch(values, 0, start, nonce)
                assert torch.equal(range_sketch(values, 0, start, nonce), want)
    assert len(fp._hash_cache) <= fp._HASH_CACHE_ENTRIES
    # a longer range at the same start is another entry, not a prefix of the cached one
    values = _values(40000, seed=7)
    assert torch.equal(range_sketch(values, 0, 0, "a"), _reference_range_sketch(values, 0, 0, "a"))


def test_gradient_sketch_over_chunks_and_parameters_is_bit_identical():
    grads = [_values(5 * 7, seed=1).reshape(5, 7), None, _values(300_001, seed=2),
             _values(3, seed=3, dtype=torch.float16)]
    for chunk in (1 << 16, fp.CHUNK):
        want = torch.zeros(64, dtype=torch.float64)
        for i, g in enumerate(grads):
            if g is None:
                continue
            flat = g.reshape(-1)
            seed = fp._param_seed("n", i)
            for start in range(0, flat.numel(), chunk):
                _reference_add_range(want, flat[start:start + chunk], seed, start)
        assert torch.equal(gradient_sketch(grads, "n", chunk=chunk), want)


def test_claims_are_unchanged_by_the_fast_path():
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
        want = _reference_range_sketch(piece, i, start, "nonce").numpy().astype("<f4")
        assert np.array_equal(claims[g], want)
        assert part_matches_claim(piece, claims[g], i, start, "nonce")
        assert not part_matches_claim(-piece, claims[g], i, start, "nonce")
