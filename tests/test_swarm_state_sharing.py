"""Catching up over dtrain's own ``state`` protocol (dtrain/swarm/state_sharing.py), between real
peers on loopback: servers announced on the real DHT, tensors streamed in chunks."""

from __future__ import annotations

import time

import pytest
import torch

from dtrain.swarm.state_sharing import CHUNK_BYTES, StateServer, download_from, load_state, sharing_peers
from dtrain.swarm.transport import TransportError


def _state(epoch: int):
    gen = torch.Generator().manual_seed(epoch)
    big = torch.randn(CHUNK_BYTES // 4 * 2 + 123, generator=gen)  # more than two chunks
    return ({"epoch": epoch, "inner_step": 10 * epoch},
            [big, torch.randn(3, 5, generator=gen).to(torch.bfloat16), torch.arange(7, dtype=torch.int64)])


@pytest.fixture(scope="module")
def servers(four_peers):
    states = {0: _state(5), 1: _state(3)}
    failing = {"on": False}

    def provider(i):
        def give():
            if i == 1 and failing["on"]:
                raise RuntimeError("the model is being replaced")
            return states[i]
        return give

    made = [StateServer(four_peers[i].transport, provider(i)) for i in (0, 1)]
    made[0].announce(5)
    made[1].announce(3)
    return four_peers, states, failing


@pytest.mark.slow
def test_a_peer_catching_up_gets_the_highest_priority_state_whole(servers):
    peers, states, _ = servers
    asker = peers[2].transport
    deadline = time.monotonic() + 30
    while len(sharing_peers(asker)) < 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert [p for p, _ in sharing_peers(asker)] == [peers[0].transport.peer_id, peers[1].transport.peer_id]
    loaded = asker.run(load_state(asker, timeout_s=30), timeout_s=60)
    assert loaded is not None
    metadata, tensors = loaded
    assert metadata == states[0][0]
    assert len(tensors) == 3
    for got, sent in zip(tensors, states[0][1]):
        assert got.dtype == sent.dtype and got.shape == sent.shape and torch.equal(got, sent)


@pytest.mark.slow
def test_a_server_without_state_is_skipped_and_a_missing_one_is_named(servers):
    peers, states, failing = servers
    asker = peers[3].transport
    failing["on"] = True
    try:
        with pytest.raises(TransportError, match="shares no state"):
            asker.run(download_from(asker, peers[1].transport.peer_id, 20), timeout_s=30)
        # the order puts the failing server first: the next one serves
        loaded = asker.run(load_state(asker, 30, peers=[peers[1].transport.peer_id, peers[0].transport.peer_id]),
                           timeout_s=60)
    finally:
        failing["on"] = False
    assert loaded is not None and loaded[0] == states[0][0]
    # a peer that serves no state protocol at all
    assert asker.run(load_state(asker, 10, peers=[peers[2].transport.peer_id]), timeout_s=30) is None
