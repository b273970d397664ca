"""RoundRecord JSON round trip and the JSON-lines log."""

from __future__ import annotations

import json

from dtrain.swarm.records import Outcome, PeerResult, RoundLog, RoundRecord, read_records


def _record(i: int = 0) -> RoundRecord:
    return RoundRecord(
        round_id=f"ab{i}",
        local_peer_id="QmA",
        started_at=1.5,
        duration_s=2.0,
        group=["QmA", "QmB"],
        peers=[PeerResult("QmA", Outcome.SUCCESS, 3, 3), PeerResult("QmB", Outcome.WRONG_MODEL, 9, 0, "fp")],
        bytes_sent=10,
        bytes_received=20,
        allreduce_s=0.5,
        fraction_averaged=0.75,
        tokens=1000,
    )


def test_roundtrip_is_json():
    rec = _record()
    d = json.loads(json.dumps(rec.to_dict()))
    back = RoundRecord.from_dict(d)
    assert back == rec
    assert d["peers"][1]["outcome"] == "WRONG_MODEL"
    assert back.outcome_of("QmB") is Outcome.WRONG_MODEL and back.outcome_of("QmZ") is None
    assert {o.value for o in Outcome} == {"SUCCESS", "FAIL", "NON_PARTICIPATING", "NOT_ALIVE", "WRONG_MODEL"}


def test_jsonl_log_skips_torn_line(tmp_path):
    path = tmp_path / "sub" / "rounds.jsonl"
    log = RoundLog(path)
    log.append(_record(1))
    log.append(_record(2))
    with open(path, "a") as f:
        f.write('{"round_id": "torn"')  # a crash mid-write
    recs = read_records(path)
    assert [r.round_id for r in recs] == ["ab1", "ab2"]
    assert [r.round_id for r in log] == ["ab1", "ab2"]
    assert read_records(tmp_path / "missing.jsonl") == []
