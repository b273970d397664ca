"""The sandbox summary's round notes say why each miner was not SUCCESS: the checked ones from
their scoring, and the unchecked ones the round's audits or record caught (validator_report's
``caught``), which are put on probation without being scored."""

from __future__ import annotations

from dtrain.sandbox.summary import _round_row


def test_notes_name_the_checked_miners_and_the_unchecked_ones_the_round_caught():
    row = _round_row({"round": 3, "status": "success", "participants": [1],
                      "miners": [{"uid": 1, "outcome": "SUCCESS", "note": ""},
                                 {"uid": 2, "outcome": "FAIL", "note": "miner is at epoch 1"}],
                      "caught": {"7": "refused in the round for what it published: contribution does not match "
                                      "its committed pages (sketch error 0.47)"}})
    assert row["outcomes"] == {"1": "SUCCESS", "2": "FAIL"}  # the scored ones only
    assert row["notes"] == {"2": "miner is at epoch 1",
                            "7": "not checked this round: refused in the round for what it published: "
                                 "contribution does not match its committed pages (sketch error 0.47)"}


def test_a_round_kept_before_caught_was_recorded_still_reads():
    row = _round_row({"round": 1, "status": "success", "miners": [{"uid": 4, "outcome": "FAIL", "note": "x"}]})
    assert row["notes"] == {"4": "x"}
