"""A validator restarted mid-run keeps its scores, its model replica and its round history."""

from __future__ import annotations

import json

import pytest

from dtrain.sandbox import layout
from dtrain.sandbox.orchestrator import Sandbox, SandboxOptions

pytestmark = pytest.mark.slow


def _state(root):
    (path,) = layout.validator_state_files(root)
    return json.loads(path.read_text())


def test_validator_restart_keeps_state_and_stays_in_sync(tmp_path):
    box = Sandbox(SandboxOptions(miners=2, rounds=1, directory=tmp_path / "box"))
    try:
        members = box.setup()
        box.start()
        assert box.wait_for_validator() == 0
        first = _state(box.root)
        assert first["round_counter"] == 1
        miner_uids = {str(row["uid"]) for row in first["recent_rounds"][0]["miners"]}
        assert len(miner_uids) == 2
        ema_after_one = {uid: first["ema"][uid] for uid in miner_uids}
        assert all(score > 0 for score in ema_after_one.values())

        # Same validator, same data dir, a new process: it must resume, not start over.
        validator = next(m for m in members if m.role == "validator")
        box._spawn(validator, ["--max-rounds", "1"])
        restarted = box.children[-1]
        assert restarted.process.wait(timeout=600) == 0, restarted.log.read_text()[-3000:]
    finally:
        box.stop_all()
    second = _state(box.root)
    assert second["round_counter"] == 2
    assert [r["round"] for r in second["recent_rounds"]] == [1, 2]
    latest = second["recent_rounds"][-1]
    # The restarted replica resumed at epoch 1, so miners verified and averaged with it.
    assert latest["status"] == "success" and latest["epoch"] == 2
    assert all(row["outcome"] == "SUCCESS" and not row["gated"] for row in latest["miners"])
    for uid, score in ema_after_one.items():
        # EMA continued from the persisted value: it only grows while a miner keeps scoring well.
        assert second["ema"][uid] > score
