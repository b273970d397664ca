"""Strict JSON for everything dtrain writes for machines: ``--json`` output, status files, JSON logs.

Python's ``json`` writes NaN and ±Infinity as bare ``NaN``/``Infinity``, which is not
JSON: jq, log shippers and other languages reject the whole document. dtrain writes
them as ``null``, which every reader takes as "unknown": a non-finite loss or score
is not a measured value.
"""

from __future__ import annotations

import json
import math
from typing import Any


def finite_or_none(value: Any) -> Any:
    """``value`` with every NaN/±inf float, at any depth, replaced by None (tuples become lists)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    return value


def dumps(doc: Any, **kwargs: Any) -> str:
    """``json.dumps`` of ``finite_or_none(doc)``; ``allow_nan=False`` backs the conversion up,
    so a non-finite number that slips through is an error to hear about, not invalid output."""
    kwargs.setdefault("default", str)
    return json.dumps(finite_or_none(doc), allow_nan=False, **kwargs)
