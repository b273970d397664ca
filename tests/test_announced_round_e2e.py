"""End to end on dtrain's own round protocol (allreduce.protocol = dtrain, docs/protocol.md 3a,
"The announced round"): real neurons, where the validator announces each round, signs its
membership, and every miner, checked (it comes on the query) or not (it joins from the notice),
averages with exactly that group on dtrain's butterfly. Both modes."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_dtrain

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

MINERS = 3


@pytest.fixture(scope="module", params=["gradient", "diloco"])
def sandbox(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"announced-{request.param}") / "box"
    # two of three checked: each round one miner comes only from the round notice
    result = run_dtrain("sandbox", "--protocol", "dtrain", "--mode", request.param, "--miners", str(MINERS),
                        "--check", "2", "--rounds", "2", "--dir", str(root), "--json", timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return root, json.loads(result.stdout)


def _round_logs(root, name: str) -> list[dict]:
    logs = list((root / "neurons" / name / "data").glob("*/rounds.jsonl"))
    assert len(logs) == 1, logs
    return [json.loads(line) for line in logs[0].read_text().splitlines() if line.strip()]


def test_every_round_averages_every_miner_and_nobody_is_at_fault(sandbox):
    _, doc = sandbox
    uids = set(range(1, MINERS + 1))
    assert [r["round"] for r in doc["rounds"]] == [1, 2]
    for r in doc["rounds"]:
        assert r["status"] == "success" and r["error"] == "", r
        assert set(r["averaged"]) == uids and r["fraction_averaged"] == 1.0, r
        # the two miners the validator checked (and scores) this round
        assert len(r["outcomes"]) == 2 and set(r["outcomes"]) <= {str(u) for u in uids}, r
        assert set(r["outcomes"].values()) == {"SUCCESS"} and not r["notes"], r
    loss = doc["loss"]
    assert loss["end"] < loss["start"]


def test_honest_miners_are_paid_alike_and_none_is_gated(sandbox):
    _, doc = sandbox
    for m in doc["miners"]:
        assert m["kind"] == "honest" and not m["gated"], m
        assert 0.5 / MINERS <= m["weight"] <= 1.5 / MINERS, m


def test_every_member_ran_the_announced_round_with_the_one_signed_group(sandbox):
    root, doc = sandbox
    logs = {name: _round_logs(root, name) for name in ["validator"] + [f"miner{i}" for i in range(1, MINERS + 1)]}
    validator_rounds = [r for r in logs["validator"] if not r["error"]]
    assert len(validator_rounds) == 2
    for record in validator_rounds:
        # the validator's own round id (its run, epoch and round number), not a matchmade group's hex id
        assert record["round_id"].startswith("sandbox-") and len(record["group"]) == MINERS + 1
        for name in logs:
            mine = [r for r in logs[name] if r["round_id"] == record["round_id"]]
            assert len(mine) == 1 and mine[0]["error"] == "", (name, mine)
            assert mine[0]["group"] == record["group"]  # exactly the signed membership, on every member


REDUCER_CHEATS = {
    # kind -> what names it in the round it cheated in: every receiver's public check of its
    # account, or (the null-space one, which passes it) the validator's secret-seed round audit
    "negating-reducer": "refused as a reducer: returned a part its account does not explain",
    "scaling-reducer": "refused as a reducer: returned a part its account does not explain",
    "nullspace-reducer": "not the combination its account states",
}


@pytest.fixture(scope="module")
def reducer_cheats(tmp_path_factory):
    root = tmp_path_factory.mktemp("announced-reducers") / "box"
    args = ["sandbox", "--protocol", "dtrain", "--miners", str(MINERS), "--rounds", "3", "--dir", str(root), "--json"]
    for kind in REDUCER_CHEATS:
        args += ["--adversary", kind]
    result = run_dtrain(*args, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def test_cheating_reducers_are_caught_re_reduced_benched_and_unpaid(reducer_cheats):
    doc = reducer_cheats
    honest = [m for m in doc["miners"] if m["kind"] == "honest"]
    cheats = {m["kind"]: m for m in doc["miners"] if m["kind"] != "honest"}
    assert all(r["status"] == "success" for r in doc["rounds"]) and doc["loss"]["end"] < doc["loss"]["start"]
    first, *later = doc["rounds"]
    for kind, why in REDUCER_CHEATS.items():
        uid = str(cheats[kind]["uid"])
        assert first["outcomes"][uid] == "FAIL" and why in first["notes"][uid], (kind, first["notes"])
        # on probation from then on (caught with proof), so its weight is capped to 0: never averaged
        assert all(r["outcomes"].get(uid) != "FAIL" or "probation" in r["notes"].get(uid, "") for r in later)
        assert all(cheats[kind]["uid"] not in r["averaged"] for r in doc["rounds"])
        assert cheats[kind]["weight"] <= 0.25 * min(m["weight"] for m in honest), (kind, cheats[kind], honest)
    # in the round they cheated in every receiver re-reduces their shares from the senders' bytes;
    # after it they reduce nothing (benched): the whole vector is averaged every round
    assert all(r["fraction_averaged"] == 1.0 for r in doc["rounds"]), [r["fraction_averaged"] for r in doc["rounds"]]
    for m in honest:
        assert not m["gated"] and m["weight"] > 0, m
        assert all(m["uid"] in r["averaged"] for r in doc["rounds"]), doc["rounds"]


@pytest.fixture(scope="module")
def two_validators(tmp_path_factory):
    root = tmp_path_factory.mktemp("announced-validators") / "box"
    result = run_dtrain("sandbox", "--protocol", "dtrain", "--miners", str(MINERS), "--validators", "2",
                        "--rounds", "3", "--dir", str(root), "--json", timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return root, json.loads(result.stdout)


def test_two_validators_average_every_round_in_one_announced_group(two_validators):
    """The first validator of each epoch's announcer_order announces; the other declares in that
    round with weight 0 (docs/protocol.md, "Several validators on dtrain's round"): one group per
    round holds both validators and every miner, and both score from it."""
    root, doc = two_validators
    uids = {m["uid"] for m in doc["miners"]}
    assert len(uids) == MINERS
    for v in doc["validators"]:
        assert v["round_counter"] == 3 and v["statuses"] == ["success"] * 3, v
    logs = {name: [r for r in _round_logs(root, name) if not r["error"]] for name in ("validator1", "validator2")}
    ids = {name: [r["round_id"] for r in rounds] for name, rounds in logs.items()}
    assert ids["validator1"] == ids["validator2"] and len(ids["validator1"]) == 3, ids
    for r1, r2 in zip(logs["validator1"], logs["validator2"]):
        assert r1["group"] == r2["group"] and len(r1["group"]) == MINERS + 2, (r1["group"], r2["group"])
    for r in doc["rounds"]:
        assert set(r["averaged"]) == uids and r["fraction_averaged"] == 1.0, r
    for m in doc["miners"]:
        assert not m["gated"] and all(w > 0 for w in m["weights_by_validator"].values()), m
    assert doc["validator_spread"] <= 0.05, doc["validator_spread"]
