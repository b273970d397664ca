"""End to end: validators check a few miners per round, and every miner averages every round.

A live subnet has up to 256 miners and a validator checks 8 of them a round. Here a sandbox
with more miners than each validator checks (``--check``) stands in for it: every honest miner
is in every round's average, none is ever FAIL, each is paid about 1/N, and a miner that
cheats whenever it is not checked is caught by the audits of unchecked work drawn after each
round (docs/protocol.md "Every miner in every round", docs/scoring.md "Sampled checks").
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_dtrain

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def sandbox(root, *args: str) -> dict:
    result = run_dtrain("sandbox", "--dir", str(root), "--json", *args, timeout=1500)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def assert_every_honest_miner_averaged_every_round_and_is_paid_its_share(doc: dict, checked: int) -> None:
    honest = {m["uid"] for m in doc["miners"] if m["kind"] == "honest"}
    for r in doc["rounds"]:
        assert r["status"] == "success", r
        # every honest miner, checked or not, is in the round's average
        assert honest <= set(r["averaged"]), (r["round"], r["averaged"], r["notes"])
        # each validator checks exactly --check miners, and never finds an honest one FAIL
        assert len(r["outcomes"]) == checked, r
        for uid, outcome in r["outcomes"].items():
            if int(uid) in honest:
                assert outcome == "SUCCESS", (r["round"], uid, outcome, r["notes"])
    share = 1.0 / len(honest)
    for m in doc["miners"]:
        if m["kind"] == "honest":
            assert 0.5 * share <= m["weight"] <= 1.5 * share, (m["uid"], m["weight"], share)


def test_six_miners_two_checked_a_round(tmp_path):
    doc = sandbox(tmp_path / "box", "--miners", "6", "--check", "2", "--rounds", "4")
    assert_every_honest_miner_averaged_every_round_and_is_paid_its_share(doc, checked=2)
    # the checks rotate: the first three rounds check all six miners once
    checked = [set(r["outcomes"]) for r in doc["rounds"]]
    assert set().union(*checked[:3]) == {str(u) for u in range(1, 7)}, checked
    curve = doc["loss"]["curve"]
    assert curve[-1] < curve[0] - 0.4, curve


def test_diloco_with_two_validators_each_checking_two(tmp_path):
    doc = sandbox(tmp_path / "box", "--miners", "5", "--check", "2", "--validators", "2", "--mode", "diloco",
                  "--rounds", "3")
    assert_every_honest_miner_averaged_every_round_and_is_paid_its_share(doc, checked=2)


def test_a_miner_that_cheats_only_when_unchecked_is_caught_and_unpaid(tmp_path):
    # 3 honest miners and the cheat, 2 checked a round: the validator audits both unchecked
    # miners' work after the round (the sandbox audits as many as it checks), so the cheat is
    # caught in the first round it cheats in, and the catch forfeits what it earned when checked
    doc = sandbox(tmp_path / "box", "--miners", "3", "--check", "2", "--rounds", "5", "--adversary", "selective")
    honest = [m for m in doc["miners"] if m["kind"] == "honest"]
    weakest = min(m["weight"] for m in honest)
    assert weakest > 0
    for m in doc["miners"]:
        if m["kind"] != "honest":
            assert m["weight"] <= 0.25 * weakest, (m["kind"], m["weight"], weakest)
    for r in doc["rounds"]:
        assert {m["uid"] for m in honest} <= set(r["averaged"]), (r["round"], r["averaged"], r["notes"])
