"""Machine output is strict JSON: NaN and infinities become null everywhere (dtrain.jsonutil)."""

from __future__ import annotations

import json
import math

from dtrain import jsonutil


def _strict(text: str):
    return json.loads(text, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))


def test_non_finite_numbers_become_null_at_any_depth():
    doc = {"loss": math.nan, "rounds": [{"bps": math.inf}, (1.0, -math.inf)], "ok": 2.5, "n": 3, "s": "nan"}
    assert _strict(jsonutil.dumps(doc)) == {"loss": None, "rounds": [{"bps": None}, [1.0, None]], "ok": 2.5,
                                            "n": 3, "s": "nan"}


def test_unknown_objects_are_written_as_text():
    class Thing:
        def __str__(self):
            return "thing"

    assert _strict(jsonutil.dumps({"x": Thing()})) == {"x": "thing"}

