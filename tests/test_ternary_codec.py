"""The ternary wire codec (dtrain.swarm.ternary): its format, its refusals, and the projection
property every check of a ternary part relies on, for any input and over many rounds."""

from __future__ import annotations

import math

import pytest
import torch

from dtrain.swarm import ternary, wire
from dtrain.swarm.codecs import canonical_compression, wire_format
from dtrain.swarm.ternary import BLOCK, BlockwiseTernary, expand, packed_size, ternarize


def _inputs():
    g = torch.Generator().manual_seed(7)
    n = 3 * BLOCK * 40 + 77  # a last block that is not full
    yield "gaussian", torch.randn(n, generator=g)
    yield "student-t(2)", torch.distributions.StudentT(2.0).sample((n,))
    sparse = torch.randn(n, generator=g)
    sparse[torch.rand(n, generator=g) < 0.99] = 0.0
    yield "99% zeros", sparse
    spikes = torch.randn(n, generator=g) * 1e-3
    spikes[::BLOCK] = 50.0
    yield "one spike a block", spikes
    yield "tiny", torch.randn(n, generator=g) * 1e-30
    yield "huge", torch.randn(n, generator=g) * 1e30
    yield "near float32's largest", torch.randn(n, generator=g).clamp(-3, 3) * 1e38
    yield "all zero", torch.zeros(n)
    yield "constant", torch.full((n,), -0.25)


INPUTS = list(_inputs())


@pytest.mark.parametrize("name,x", INPUTS, ids=[name for name, _ in INPUTS])
def test_decoded_blocks_are_the_projection_of_each_block_onto_its_sign_pattern(name, x):
    """Per block: the error is orthogonal to the decoded values, so the decoded block is never
    longer than the block and the error never longer either; the block's largest value is coded."""
    buffer, shape, dtype = BlockwiseTernary.encode(x)
    d = BlockwiseTernary.decode(buffer, shape, dtype)
    assert torch.equal(d, expand(*ternarize(x)))
    pad = (-x.numel()) % BLOCK
    xb = torch.nn.functional.pad(x.double(), (0, pad)).view(-1, BLOCK)
    db = torch.nn.functional.pad(d.double(), (0, pad)).view(-1, BLOCK)
    e = xb - db
    norms = xb.norm(dim=1)
    assert torch.all((db * e).sum(dim=1).abs() <= 1e-5 * norms ** 2 + 1e-300)
    assert torch.all(db.norm(dim=1) <= norms * (1 + 1e-6))
    assert torch.all(e.norm(dim=1) <= norms * (1 + 1e-6))
    nonzero = norms > 0
    peak = xb.abs().argmax(dim=1)
    rows = torch.arange(xb.shape[0])
    assert torch.all(db[rows, peak][nonzero] != 0)  # the largest value is never dropped
    assert torch.all(db[~nonzero] == 0)  # a zero block is exact
    for row in range(0, xb.shape[0], 37):
        assert len(set(db[row].abs().tolist()) - {0.0}) <= 1


def test_measured_error_on_gaussian_values_and_the_bits_per_value():
    x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(0))
    buffer, shape, dtype = BlockwiseTernary.encode(x)
    d = BlockwiseTernary.decode(buffer, shape, dtype)
    rel = float((d - x).norm() / x.norm())
    assert 0.40 < rel < 0.47  # measured 0.435 (the L2-optimal ternary code of a Gaussian: about 0.40)
    assert len(buffer) == packed_size(x.numel()) == 1 + 4 * (x.numel() // BLOCK) + math.ceil(x.numel() / 5)
    assert 8 * len(buffer) / x.numel() == pytest.approx(1.85, abs=1e-3)
    assert BlockwiseTernary.compression_ratio(32) == pytest.approx(1.85 / 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_shape_and_dtype_travel_beside_the_buffer(dtype):
    x = torch.randn(3, 5, 7).to(dtype)
    buffer, shape, name = BlockwiseTernary.encode(x)
    d = BlockwiseTernary.decode(buffer, shape, name)
    assert d.shape == x.shape and d.dtype == x.dtype
    with pytest.raises(ValueError, match="does not support"):
        BlockwiseTernary.encode(torch.arange(10))


def _valid(n=1000):
    return bytearray(BlockwiseTernary.encode(torch.randn(n))[0]), n


def test_a_malformed_buffer_is_refused_by_name_never_decoded():
    buffer, n = _valid()
    BlockwiseTernary.decode(bytes(buffer), (n,), "float32")
    bad_version = bytearray(buffer)
    bad_version[0] = 2
    with pytest.raises(ValueError, match=r"format version 2.*ternary/128/5-per-byte/v1"):
        BlockwiseTernary.decode(bytes(bad_version), (n,), "float32")
    with pytest.raises(ValueError, match="must be"):
        BlockwiseTernary.decode(bytes(buffer[:-1]), (n,), "float32")
    with pytest.raises(ValueError, match="must be"):
        BlockwiseTernary.decode(bytes(buffer), (n + 1,), "float32")
    past = bytearray(buffer)
    past[-3] = 243
    with pytest.raises(ValueError, match="past 242"):
        BlockwiseTernary.decode(bytes(past), (n,), "float32")
    short = BlockwiseTernary.encode(torch.randn(998))[0]  # the last byte holds three values and two zeros
    padding = bytearray(short)
    padding[-1] = (padding[-1] % 27) + 27 * 2  # the fourth trit (past the end) set to +1
    with pytest.raises(ValueError, match="padding"):
        BlockwiseTernary.decode(bytes(padding), (998,), "float32")
    for scale in (float("nan"), float("inf"), -1.0):
        negative = bytearray(buffer)
        negative[1:5] = torch.tensor([scale]).numpy().astype("<f4").tobytes()
        with pytest.raises(ValueError, match="scale"):
            BlockwiseTernary.decode(bytes(negative), (n,), "float32")


def test_error_feedback_over_many_rounds_keeps_the_residual_bounded_and_the_sum_exact():
    """Sending ``x_t + r_t`` and keeping ``r_{t+1}`` = what the code missed: what arrived over T
    rounds is what was sent in, to within the last residual, which stays within a small multiple
    of one round's values for every kind of input (the codec's error is a projection's: it never
    exceeds the values it codes, and on these inputs stays well below them)."""
    g = torch.Generator().manual_seed(3)
    n = BLOCK * 64
    for name, draw in (("gaussian", lambda: torch.randn(n, generator=g)),
                       ("student-t(2)", lambda: torch.distributions.StudentT(2.0).sample((n,))),
                       ("drifting sparse", lambda: torch.randn(n, generator=g) * (torch.rand(n, generator=g) < 0.05))):
        residual = torch.zeros(n, dtype=torch.float64)
        sent_total = torch.zeros(n, dtype=torch.float64)
        true_total = torch.zeros(n, dtype=torch.float64)
        largest = 0.0
        for _ in range(300):
            x = draw().double()
            largest = max(largest, float(x.norm()))
            u = x + residual
            d = expand(*ternarize(u.float())).double()
            residual = u - d
            sent_total += d
            true_total += x
            assert float(residual.norm()) <= 4.0 * largest, name
        # float32 coding of u: the sum is exact to within the residual and float32 rounding
        gap = float((true_total - sent_total - residual).norm())
        assert gap <= 1e-4 * float(true_total.norm()) + 1e-3 * largest, name


def test_ternary_is_a_named_wire_with_its_own_hivemind_codec():
    assert canonical_compression("ternary") == canonical_compression("1.5bit") == "ternary"
    assert wire_format("ternary") == ternary.FORMAT == "blockwise-ternary/128/5-per-byte/v1"
    comp = wire.make_compression("ternary")
    assert comp.codec is BlockwiseTernary
    x = torch.randn(4096)
    raw, decoded = wire.wire_form(x, comp)
    assert len(raw) == packed_size(4096)
    assert torch.equal(wire.decode_wire(raw, 4096, comp), decoded)
    assert torch.equal(wire.as_received(x, comp), decoded)
    with pytest.raises(ValueError):
        wire.decode_wire(raw[:-1], 4096, comp)
    # an 8-bit part is not a ternary part: other lengths, refused rather than misread
    eight = wire.wire_form(x, wire.make_compression("8bit"))[0]
    with pytest.raises(ValueError):
        wire.decode_wire(eight, 4096, comp)
