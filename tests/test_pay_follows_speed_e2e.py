"""Pay follows verified work when miners train continuously (issue #38), in one real sandbox.

Three honest miners train beside an honest miner on hardware a third as fast (``third-speed``:
each page holds its training thread three times as long). In gradient mode every miner trains
until its round begins, so each brings what its hardware trained: the slower one verifies fewer
samples and earns less, and no miner's share of the weights falls below 0.8 of its share of the
verified samples.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_dtrain

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

ROUNDS = 5


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("pay-follows-speed") / "box"
    result = run_dtrain("sandbox", "--miners", "3", "--adversary", "third-speed", "--rounds", str(ROUNDS),
                        "--dir", str(root), "--json", timeout=1000)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def _credited(run) -> dict[int, int]:
    """Verified samples per uid over the rounds after the first (before the first round, miners
    train for as long as the validator takes to start: not a round's worth)."""
    totals: dict[int, int] = {}
    for r in run["rounds"][1:]:
        for uid, samples in r["credited"].items():
            totals[int(uid)] = totals.get(int(uid), 0) + int(samples or 0)
    return totals


def test_every_miner_brings_more_than_a_local_batch_when_its_hardware_trains_more(run):
    # The previous release capped every contribution at the local batch (64 sequences here).
    honest = [m["uid"] for m in run["miners"] if m["kind"] == "honest"]
    rounds = run["rounds"][1:]
    assert all(r["status"] == "success" for r in rounds), rounds
    most = [max(r["credited"][str(uid)] or 0 for uid in honest) for r in rounds]
    assert any(m > 64 for m in most), [r["credited"] for r in rounds]


def test_the_slower_miner_verifies_fewer_samples_and_earns_less(run):
    credited = _credited(run)
    by_kind = {m["uid"]: m["kind"] for m in run["miners"]}
    slow = next(uid for uid, kind in by_kind.items() if kind == "third-speed")
    honest = [uid for uid, kind in by_kind.items() if kind == "honest"]
    assert 0 < credited[slow] < 0.6 * min(credited[uid] for uid in honest), credited
    weights = {m["uid"]: m["weight"] for m in run["miners"]}
    assert 0 < weights[slow] < 0.6 * min(weights[uid] for uid in honest), weights


def test_no_miner_is_paid_below_its_share_of_verified_samples(run):
    credited = _credited(run)
    weights = {m["uid"]: m["weight"] for m in run["miners"]}
    total_samples, total_weight = sum(credited.values()), sum(weights.values())
    assert total_samples > 0 and total_weight > 0
    for uid, samples in credited.items():
        share = samples / total_samples
        assert weights[uid] / total_weight >= 0.8 * share, (uid, weights, credited)
