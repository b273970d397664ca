"""The reducer's data path in real rounds: CenteredClip off the event loop, checks in the decode thread.

dtrain's reducer runs CenteredClip in a worker thread (the next part accumulates meanwhile),
checks each received part (finite, within its sender's announced norm, as claimed) in the
thread that deserialises it, and serialises each averaged part once for all its senders.
These tests run real hivemind peers on loopback and check that what a round computes and
whom it bans are what the rules say: every part is the CenteredClip of the senders' parts,
all peers hold the same bits, and a bad sender is refused for its own reason.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from dtrain.swarm.averaging import AveragingConfig
from dtrain.swarm.averaging.centered_clip import centered_clip
from dtrain.swarm.averaging.contribution import PartLayout
from dtrain.swarm.wire import as_received, make_compression
from dtrain.swarm.loopback import local_nodes, run_concurrently
from dtrain.swarm.records import Outcome
from tests.faults import FaultInjection
from tests.faults import swarm as make_swarm
from tests.swarm_checks import check_round_contract, loopback_config

pytestmark = pytest.mark.slow

_prefix = itertools.count()
PART_BYTES = 4096
N = 6000


@pytest.fixture(scope="module")
def nodes():
    with local_nodes(4) as started:
        yield started


def _cfg(**kw) -> AveragingConfig:
    return loopback_config(f"dp{next(_prefix)}", 4, **{"part_size_bytes": PART_BYTES, "aggregation": "centered_clip",
                                                       **kw})


def _round(nodes, data, cfg, faults=None):
    swarms = [make_swarm(nodes[i].dht, [data[i]], "model-a", cfg, fault=(faults or {}).get(i)) for i in range(4)]
    try:
        return swarms, run_concurrently([lambda i=i: swarms[i].run_round([data[i]], weight=8, cap=100)
                                         for i in range(4)])
    finally:
        for s in swarms:
            s.shutdown()


def _clip_per_part(contributions, compression: str) -> torch.Tensor:
    """What the rule gives: each part is the CenteredClip of the senders' parts as received."""
    comp = make_compression(compression)
    layout = PartLayout.of([contributions[0]], comp, PART_BYTES)
    out = torch.empty(N)
    for _, start, length in layout.parts:
        parts = [as_received(c[start:start + length].clone(), comp) for c in contributions]
        out[start:start + length] = centered_clip(parts, [8.0] * len(parts))
    return out


@pytest.mark.parametrize("compression", ["none", "fp16"])
def test_every_part_is_the_centered_clip_and_all_peers_hold_the_same_bits(nodes, compression):
    torch.manual_seed(11)
    g = torch.randn(N)
    # three honest senders around g and one far off: the clip iterates, it is not the mean
    contributions = [g + 0.3 * torch.randn(N) for _ in range(3)] + [-4.0 * g]
    data = [c.clone() for c in contributions]
    _, recs = _round(nodes, data, _cfg(compression=compression))
    everyone = check_round_contract(contributions, data, recs)  # identical bits wherever averaged
    assert bool(everyone.all()), [[(p.outcome.value, p.reason) for p in r.peers] for r in recs]
    want = _clip_per_part(contributions, compression)
    # the reducer adds its senders in arrival order, so float32 sums may differ in the last bits
    tol = 1e-5 if compression == "none" else 2e-3
    assert torch.allclose(data[0], want, rtol=tol, atol=tol * float(want.abs().max()))
    mean = torch.stack(contributions).mean(0)
    assert float((data[0] - mean).norm()) > 0.1 * float(mean.norm())  # the clip really acted


@pytest.mark.parametrize("fault,reason", [
    (FaultInjection(send_nonfinite=True), "non-finite"),
    (FaultInjection(scale_parts=1000.0), "larger than its announced norm"),
])
def test_a_bad_sender_is_refused_for_its_reason_under_centered_clip(nodes, fault, reason):
    torch.manual_seed(12)
    g = torch.randn(N)
    contributions = [g + 0.3 * torch.randn(N) for _ in range(4)]
    data = [c.clone() for c in contributions]
    swarms, recs = _round(nodes, data, _cfg(), faults={3: fault})
    bad = swarms[3].peer_id
    for r in recs[:3]:
        assert not r.error, r.error
        assert r.outcome_of(bad) == Outcome.FAIL
        assert reason in next(p.reason for p in r.peers if p.peer_id == bad)
    honest = [d.clone() for d in data[:3]]
    for d in honest:
        assert bool(torch.isfinite(d).all())
    # the parts the honest peers reduced never took the bad sender's values: there they hold
    # the clip of the three honest contributions, the same bits on every honest peer
    want = _clip_per_part(contributions[:3], "none")
    close = torch.isclose(honest[0], want, rtol=1e-5, atol=1e-5)
    assert float(close.double().mean()) >= 0.5  # three of four shares (the bad peer reduces one)
    for d in honest[1:]:
        assert torch.equal(d[close], honest[0][close])
