"""A leader starts its all-reduce as soon as its group is formed, not after a DHT round trip.

hivemind's leader, once its group is assembled, tells the DHT it no longer looks for a group
and waited for that store before it started; under load the followers were seconds ahead of
it (docs/swarm.md "Measured"). dtrain fires that store and forgets it.
"""

from __future__ import annotations

import asyncio
import time

import hivemind
import pytest
from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.utils.timed_storage import get_dht_time

from dtrain.swarm.hivemind_internals import undeclare_in_background

STORE_DELAY_S = 1.5


@pytest.fixture
def dht():
    node = hivemind.DHT(start=True)
    yield node
    node.shutdown()


def _slow_key_manager(dht) -> tuple[GroupKeyManager, list]:
    """A real key manager whose DHT stores take STORE_DELAY_S longer, as on a saturated link."""
    km = GroupKeyManager(dht, "leaderstart", initial_group_bits="", target_group_size=4)
    real = km.declare_averager
    finished = []

    async def slow(group_key, peer_id, expiration_time, looking_for_group=True):
        await asyncio.sleep(STORE_DELAY_S)
        ok = await real(group_key, peer_id, expiration_time, looking_for_group)
        finished.append((looking_for_group, ok))
        return ok

    km.declare_averager = slow
    return km, finished


def _looking(dht, key: str, peer) -> bool | None:
    found = dht.get(key, latest=True)
    if found is None:
        return None
    entry = found.value.get(peer.to_bytes())
    return None if entry is None else bool(entry.value)


def test_leaving_the_queue_returns_at_once_and_still_reaches_the_dht(dht):
    km, finished = _slow_key_manager(dht)
    undeclare_in_background(km)
    undeclare_in_background(km)  # idempotent: the manager is wrapped once per process
    key = km.current_key
    expiration = get_dht_time() + 60

    async def scenario():
        t0 = time.monotonic()
        assert await km.declare_averager(key, dht.peer_id, expiration) is True
        declare_s = time.monotonic() - t0
        t0 = time.monotonic()
        assert await km.declare_averager(key, dht.peer_id, expiration, looking_for_group=False) is True
        leave_s = time.monotonic() - t0
        assert _looking(dht, key, dht.peer_id) is True  # the store is still on its way
        await asyncio.sleep(STORE_DELAY_S + 2.0)  # the loop keeps the background store alive
        return declare_s, leave_s

    declare_s, leave_s = asyncio.run(scenario())
    # declaring (joining the queue) is still awaited; leaving it is not
    assert declare_s >= STORE_DELAY_S
    assert leave_s < STORE_DELAY_S
    assert finished == [(True, True), (False, True)]
    assert _looking(dht, key, dht.peer_id) is False
