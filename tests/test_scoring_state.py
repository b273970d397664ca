"""Validator state persistence: atomic save, restart, corrupt file handling."""

from __future__ import annotations

import json

import pytest

from dtrain.validation.scoring import EmaState, update_ema
from dtrain.validation.state import StateError, ValidatorState, load_state, save_state
from dtrain.validation.weights import WeightSetPolicy, WeightSetState, record_failure, record_success


def _state() -> ValidatorState:
    st = ValidatorState()
    st.ema = update_ema(EmaState(), {1: 0.8, 2: 0.3}, {1: "hk1", 2: "hk2", 3: "hk3"}, alpha=0.5)
    st.last_scores = {1: {"gradient": 1.0, "steps": 0.5, "combined": 0.8, "gated": []}}
    st.weight_set = record_failure(WeightSetPolicy(), record_success(WeightSetState(), 120), 230, "rpc down")
    st.add_round({"round": 1, "status": {"1": "SUCCESS"}})
    return st


def test_missing_file_gives_fresh_state(tmp_path):
    st = load_state(tmp_path / "nope.json")
    assert st.ema.scores == {} and st.weight_set.last_set_block is None


def test_restart_keeps_state(tmp_path):
    path = tmp_path / "validator" / "state.json"
    st = _state()
    save_state(path, st)
    back = load_state(path)
    assert back.ema.scores == st.ema.scores and back.ema.hotkeys == st.ema.hotkeys
    assert all(isinstance(u, int) for u in back.ema.scores)
    assert back.last_scores == st.last_scores
    assert back.weight_set == st.weight_set
    assert back.recent_rounds == st.recent_rounds and back.round_counter == 1
    # the restarted validator continues the EMA where it stopped
    cont = update_ema(back.ema, {1: 0.8}, back.ema.hotkeys, alpha=0.5)
    assert cont.scores[1] == pytest.approx(0.6)
    assert not (path.parent / "state.json.tmp").exists()


def test_second_save_keeps_backup_of_previous(tmp_path):
    path = tmp_path / "state.json"
    st = _state()
    save_state(path, st)
    assert not (tmp_path / "state.json.bak").exists()
    st.round_counter = 99
    save_state(path, st)
    bak = json.loads((tmp_path / "state.json.bak").read_text())
    assert bak["round_counter"] == 1
    assert load_state(path).round_counter == 99


def test_corrupt_file_names_file_and_backup(tmp_path):
    path = tmp_path / "state.json"
    save_state(path, _state())
    save_state(path, _state())
    path.write_text('{"version": 1, "ema": {"1": 0.5')  # truncated write by something else
    with pytest.raises(StateError) as ei:
        load_state(path)
    msg = str(ei.value)
    assert str(path) in msg and "invalid JSON" in msg and "state.json.bak" in msg
    # the backup is intact and loadable
    assert load_state(tmp_path / "state.json.bak").ema.scores


def test_saving_over_corrupt_file_does_not_clobber_backup(tmp_path):
    path = tmp_path / "state.json"
    save_state(path, _state())
    st = _state()
    st.round_counter = 7
    save_state(path, st)  # .bak now holds round_counter == 1
    path.write_text("garbage")
    save_state(path, st)
    assert load_state(tmp_path / "state.json.bak").round_counter == 1


@pytest.mark.parametrize(
    "doc, needle",
    [
        ("[1, 2]", "JSON object"),
        ('{"version": 2}', "'version'"),
        ('{"version": 1, "ema": {"x": 1.0}}', "malformed"),
        ('{"version": 1, "ema": {"1": -1.0}}', "'ema'"),
    ],
)
def test_bad_shapes(tmp_path, doc, needle):
    path = tmp_path / "s.json"
    path.write_text(doc)
    with pytest.raises(StateError, match=needle):
        load_state(path)


def test_nan_is_refused_at_save(tmp_path):
    st = ValidatorState(ema=EmaState(scores={1: float("nan")}, hotkeys={1: "a"}))
    with pytest.raises(ValueError):
        save_state(tmp_path / "s.json", st)
    assert not (tmp_path / "s.json").exists()


def test_recent_rounds_bounded():
    st = ValidatorState()
    for i in range(10):
        st.add_round({"i": i}, keep=3)
    assert [r["i"] for r in st.recent_rounds] == [7, 8, 9] and st.round_counter == 10
