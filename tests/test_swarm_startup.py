"""Starting the averager and DHT processes never waits forever (dtrain/swarm/startup.py).

hivemind's parent waits for its child's "ready" with no limit, and never notices a child that
died first. These start real averager and DHT processes whose child dies or hangs before it
is ready, and check that the parent stops with a reason (and, for a hang, the child's stacks)
instead of waiting forever.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from dtrain.swarm import startup
from dtrain.swarm.averaging.averager import SwarmAverager, matchmaking_key
from dtrain.swarm.hivemind_internals import AveragerProcess, DHTProcess
from dtrain.swarm.loopback import local_nodes

pytestmark = pytest.mark.slow


def averager(cls, dht, prefix: str, start: bool = True):
    """An averager process of class ``cls`` with dtrain's round handler, as a GradientSwarm starts one."""
    return cls([torch.zeros(4)], dht, handler=SwarmAverager(), matchmaking_key=matchmaking_key(prefix), start=start,
               prefix=prefix, target_group_size=2)


class _DiesAtStart(AveragerProcess):
    def run(self):
        os._exit(7)  # what a crash before hivemind's try block looks like to the parent


class _HangsAtStart(AveragerProcess):
    def run(self):
        startup.enable_stack_dumps()  # as AveragerProcess.run does first
        stuck_before_ready()


def stuck_before_ready():
    time.sleep(3600)


class _DHTDiesAtStart(DHTProcess):
    def run(self):
        os._exit(5)


@pytest.fixture(scope="module")
def node():
    with local_nodes(1) as started:
        yield started[0]


def test_an_averager_that_dies_before_ready_is_an_error_not_a_hang(node):
    began = time.monotonic()
    with pytest.raises(startup.ProcessStartError, match=r"averager process .* exited with code 7 before it was ready"):
        averager(_DiesAtStart, node.dht, "dies")
    assert time.monotonic() - began < startup.START_TIMEOUT_S / 2  # noticed, not timed out


def test_an_averager_stuck_before_ready_is_dumped_and_stopped(node, capfd):
    hanging = averager(_HangsAtStart, node.dht, "hangs", start=False)
    with pytest.raises(startup.ProcessStartError, match=r"averager process .* was not ready after 3 s and was stopped"):
        hanging.run_in_background(await_ready=True, timeout=3)
    assert not hanging.is_alive()
    err = capfd.readouterr().err
    assert "stuck_before_ready" in err  # the child's own stack, written on SIGUSR1


def test_a_ready_averager_starts_and_shuts_down(node):
    fine = averager(AveragerProcess, node.dht, "fine")
    try:
        assert fine.is_alive()
    finally:
        fine.shutdown()


def test_a_dht_that_dies_before_ready_is_an_error_not_a_hang():
    with pytest.raises(startup.ProcessStartError, match=r"DHT process .* exited with code 5 before it was ready"):
        _DHTDiesAtStart(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start_timeout_s=60)


def test_the_start_up_exception_of_the_child_still_reaches_the_caller():
    # The child's p2pd refuses an initial peer without /p2p/<id>; hivemind hands that
    # exception to the parent through the ready future, and it must arrive as itself.
    with pytest.raises(Exception, match="invalid p2p multiaddr") as info:
        DHTProcess(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=["/ip4/127.0.0.1/tcp/1"],
                  start_timeout_s=60)
    assert not isinstance(info.value, startup.ProcessStartError)
