"""Identity persistence, bootstrap failure handling and the DHT progress tracker (real DHTs on loopback)."""

from __future__ import annotations

import time

import pytest

from dtrain.swarm.loopback import local_nodes
from dtrain.swarm.node import NoPeersReachable, SwarmNode, SwarmNodeConfig
from dtrain.swarm.progress import ProgressTracker

pytestmark = pytest.mark.slow

LOOP = ["/ip4/127.0.0.1/tcp/0"]


def test_identity_survives_restart(tmp_path):
    cfg = SwarmNodeConfig(data_dir=str(tmp_path / "n"), host_maddrs=LOOP)
    with SwarmNode(cfg) as node:
        first = node.peer_id
    assert (tmp_path / "n" / "p2p_identity.key").exists()
    with SwarmNode(cfg) as node:
        assert node.peer_id == first


def test_unreachable_bootstrap_does_not_crash_and_retries(tmp_path):
    # a well-formed address nobody listens on (the peer id is a throwaway identity of our own)
    with SwarmNode(SwarmNodeConfig(data_dir=str(tmp_path / "ghost"), host_maddrs=LOOP)) as ghost:
        ghost_id = ghost.peer_id
    dead = f"/ip4/127.0.0.1/tcp/9/p2p/{ghost_id}"
    cfg = SwarmNodeConfig(
        data_dir=str(tmp_path / "n"), host_maddrs=LOOP, initial_peers=[dead], bootstrap_timeout_s=1,
        retry_initial_s=0.2, retry_max_s=0.4,
    )
    retries = []
    with SwarmNode(cfg) as node:  # starts although nobody answers
        assert node.num_known_peers() == 0
        t0 = time.monotonic()
        with pytest.raises(NoPeersReachable):
            # 10 s leaves room for several 1 s attempts however slow the machine is
            node.ensure_connected(timeout_s=10, on_retry=lambda a, d: retries.append((a, d)))
        assert time.monotonic() - t0 < 60  # a hang guard: it gives up instead of waiting forever
    assert len(retries) >= 2 and retries[1][1] > retries[0][1]  # backoff grows


def test_bad_initial_peer_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="/p2p/"):
        SwarmNode(SwarmNodeConfig(data_dir=str(tmp_path), initial_peers=["/ip4/127.0.0.1/tcp/1"])).start()


def test_connects_and_progress_tracker():
    with local_nodes(3) as nodes:
        assert nodes[1].ensure_connected(timeout_s=10) >= 1
        trackers = [ProgressTracker(n.dht, "ptest", target_batch_size=100, expiration_s=300) for n in nodes]
        trackers[0].report(epoch=3, samples_accumulated=40, samples_per_second=10)
        trackers[1].report(epoch=3, samples_accumulated=500, samples_per_second=5)  # clipped to 100
        trackers[2].report(epoch=2, samples_accumulated=90)  # a lagging peer
        nodes[0].dht.store("ptest_progress", subkey="junk", value="not-a-dict", expiration_time=time.time() + 300)
        deadline = time.monotonic() + 60  # the loop ends as soon as both reports are visible
        while True:
            g = trackers[2].fetch()
            if g.num_peers == 2 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert g.epoch == 3 and g.num_peers == 2
        assert g.samples_accumulated == 40 + 100 and g.ready  # 500 was clipped to the target
        assert trackers[2].is_behind(local_epoch=2) and not trackers[0].is_behind(local_epoch=3)
        assert len(trackers[0].peers()) == 3  # the junk record is ignored
        assert g.to_dict()["ready"] is True


def test_a_node_that_started_alone_joins_when_a_peer_appears(tmp_path):
    """The re-dial behind ensure_connected: the first node of a swarm starts isolated and
    must reach a committed peer that comes up later."""
    with SwarmNode(SwarmNodeConfig(data_dir=str(tmp_path / "a"), host_maddrs=LOOP)) as first:
        with SwarmNode(SwarmNodeConfig(data_dir=str(tmp_path / "b"), host_maddrs=LOOP)) as late:
            assert late.num_known_peers() == 0
            late.config.initial_peers = [m for m in first.visible_maddrs() if "/127.0.0.1/" in m]
            assert late.config.initial_peers
            assert late.try_bootstrap_once() == 1
            assert late.num_known_peers() >= 1


def _alive(pid: int) -> bool:
    import os

    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return not os.path.exists(f"/proc/{pid}")


def test_a_killed_dht_process_is_reported_and_its_p2pd_is_stopped(tmp_path):
    import os
    import signal

    from dtrain.swarm.node import SwarmUnavailable

    cfg = SwarmNodeConfig(data_dir=str(tmp_path / "n"), host_maddrs=LOOP)
    node = SwarmNode(cfg).start()
    try:
        peer_id = node.peer_id
        daemon = node._daemon_pid
        assert node.problem() is None and node.alive()
        assert daemon and _alive(daemon)
        os.kill(node.dht.pid, signal.SIGKILL)
        node.dht.join(10)
        # every call now fails at once with the reason, instead of waiting for ever
        with pytest.raises(SwarmUnavailable, match="SIGKILL"):
            node.num_known_peers()
        assert "killed by SIGKILL" in node.problem()
        assert not node.alive()
        assert node.peer_id == peer_id  # still known: status pages keep naming it
    finally:
        node.shutdown()
    # p2pd outlives the killed process for a few seconds (longer with clients attached): the
    # shutdown stops it if it still runs, so a restart can take its port
    assert not _alive(daemon)
    with SwarmNode(cfg) as again:  # and a restarted node has the same identity
        assert again.peer_id == peer_id and again.problem() is None


def test_a_frozen_dht_process_is_reported_within_the_call_timeout(tmp_path):
    import os
    import signal

    from dtrain.swarm.node import SwarmUnavailable, _count_peers

    with SwarmNode(SwarmNodeConfig(data_dir=str(tmp_path / "n"), host_maddrs=LOOP)) as node:
        os.kill(node.dht.pid, signal.SIGSTOP)
        try:
            with pytest.raises(SwarmUnavailable, match="did not answer within 2 s"):
                node.call(_count_peers, timeout_s=2)
            assert "did not answer within 1 s" in node.problem(timeout_s=1)
            assert node.alive()  # alive but silent: the neuron restarts it only if it stays so
        finally:
            os.kill(node.dht.pid, signal.SIGCONT)
        assert node.problem() is None  # it answers again once thawed



def test_a_killed_averager_process_is_reported_and_a_round_does_not_wait_for_it(tmp_path):
    import os
    import signal

    import torch

    from dtrain.neurons.swarm_health import look_at
    from dtrain.swarm.averaging import AveragingConfig, GradientSwarm

    with SwarmNode(SwarmNodeConfig(data_dir=str(tmp_path / "n"), host_maddrs=LOOP)) as node:
        cfg = AveragingConfig(prefix="dead-averager", allow_state_sharing=False, matchmaking_timeout_s=60,
                              allreduce_timeout_s=5)
        swarm = GradientSwarm(node.dht, [torch.zeros(16)], "fp", cfg)
        try:
            assert swarm.problem() is None and look_at(node, swarm).problem is None
            os.kill(swarm._averager.pid, signal.SIGKILL)
            swarm._averager.join(10)
            assert "averager process is not running" in swarm.problem()
            finding = look_at(node, swarm, ping=False)
            assert finding.dead and "averager" in finding.problem
            # the round's wait is bounded: it ends with an error instead of hanging the caller
            record = swarm.run_round([torch.ones(16)], weight=1, cap=1)
            assert "averager process is not running" in record.error, record.error
        finally:
            swarm.shutdown()
