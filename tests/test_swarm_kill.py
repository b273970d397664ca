"""A peer SIGKILLed in the middle of the butterfly: the others finish with local values for its share."""

from __future__ import annotations

import pytest
import torch

from dtrain.swarm.averaging import AveragingConfig, GradientSwarm
from dtrain.swarm.records import Outcome
from dtrain.swarm.testing import PeerProcess, local_nodes, run_concurrently
from tests.swarm_checks import LOOPBACK_MATCHMAKING

pytestmark = pytest.mark.slow


def test_peer_killed_mid_round():
    numel = 60_000  # 240 KB, 4 KB parts: the victim needs ~20 s to send its ~20 parts per reducer
    with local_nodes(2) as nodes:
        boot = nodes[0].visible_maddrs()[0]
        victim = PeerProcess(
            [
                # value 10: within 10x of the others' norms, so not refused as out of scale
                "--initial-peer", boot, "--prefix", "killtest", "--numel", str(numel), "--value", "10",
                "--group-size", "3", "--part-size-bytes", "4096", "--send-delay", "1.0",
                "--sender-timeout", "3", "--matchmaking-time", str(LOOPBACK_MATCHMAKING["min_matchmaking_time_s"]),
            ]
        )
        try:
            victim_id = victim.wait_for_line("PEER ", timeout_s=60).split()[1]
            cfg = AveragingConfig(
                prefix="killtest", min_group_size=3, target_group_size=3, **LOOPBACK_MATCHMAKING, sender_timeout_s=3, part_size_bytes=4096,
                matchmaking_timeout_s=60, allreduce_timeout_s=60, allow_state_sharing=False,
            )
            data = [torch.full((numel,), 1.0), torch.full((numel,), 3.0)]
            swarms = [GradientSwarm(n.dht, [d], "fp", cfg) for n, d in zip(nodes, data)]

            def kill_when_running():
                victim.wait_for_line("RUNNING", timeout_s=60)
                victim.kill()

            try:
                records = run_concurrently(
                    [lambda i=i: swarms[i].run_round([data[i]], weight=1, cap=1) for i in range(2)]
                    + [kill_when_running],
                    timeout_s=90,
                )[:2]
            finally:
                for s in swarms:
                    s.shutdown()
        finally:
            victim.kill()
    assert victim.proc.returncode is not None
    for rec, d, local in zip(records, data, (1.0, 3.0)):
        assert not rec.error, rec.error
        assert victim_id in rec.group
        assert rec.outcome_of(victim_id) == Outcome.FAIL
        assert bool(torch.isfinite(d).all())
        assert bool((d != local).any())  # the rest was averaged
        assert 0.0 < rec.fraction_averaged <= 1.0
        if rec.fraction_averaged < 1.0:  # the usual case: the victim died before returning its share
            kept_local = int((d == local).sum())
            # the victim's share (about a third of the vector) keeps this peer's LOCAL values
            assert kept_local >= numel * 0.2, kept_local
        # Otherwise (a loaded machine) the victim returned its share before the kill landed; its
        # uploads were still cut off, which the FAIL outcome above records.
