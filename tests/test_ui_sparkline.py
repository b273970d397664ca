"""Sparkline/text-plot edge cases and the small console formatting helpers."""

from __future__ import annotations

import math

from dtrain.ui.console import ago, duration, human_bytes, short_hotkey, short_id
from dtrain.ui.sparkline import BLOCKS, resample, sparkline, text_plot


def test_sparkline_empty_constant_and_nan():
    assert sparkline([]) == ""
    flat = sparkline([2.0] * 5)
    assert len(flat) == 5 and len(set(flat)) == 1 and flat[0] not in (BLOCKS[0], " ")  # steady is not zero
    assert sparkline([1.0, math.nan, 3.0, math.inf]) == BLOCKS[0] + " " + BLOCKS[-1] + " "
    assert sparkline([math.nan, None, "x"]) == "   "


def test_sparkline_shape_and_width():
    up = sparkline(range(100), width=20)
    assert len(up) == 20 and up[0] == BLOCKS[0] and up[-1] == BLOCKS[-1]
    assert list(up) == sorted(up)  # monotone input stays monotone after resampling
    assert sparkline([3, 1, 2], width=10) == BLOCKS[-1] + BLOCKS[0] + BLOCKS[4]
    assert sparkline([1, 2, 3], width=0) == ""


def test_resample_averages_buckets_and_skips_nan():
    assert resample([1, 3, 5, 7], 2) == [2.0, 6.0]
    assert resample([math.nan, 4, math.nan, math.nan], 2) == [4.0, None]
    assert resample([1, 2], 5) == [1.0, 2.0]


def test_text_plot():
    assert text_plot([]) == []
    rows = text_plot([10, 8, 6, 4], width=4, height=4)
    assert len(rows) == 5 and rows[0].startswith("10 ┤•") and rows[3].startswith(" 4 ┤   •")
    assert rows[-1].endswith("└────")


def test_console_helpers():
    assert human_bytes(0) == "0 B" and human_bytes(1536) == "1.5 KiB" and human_bytes(3 * 2**30) == "3.0 GiB"
    assert human_bytes(None) == "—"
    assert short_hotkey("5GrwvaEF5zXb26Fz9rcQpDWS57CtERHpNehXCPcNoHGKutQY") == "5Grwv…KutQY"
    assert short_hotkey("5Gabc") == "5Gabc" and short_hotkey("") == "—"
    assert short_id("12D3KooWAbcdef123456") == "…123456"
    assert ago(5) == "5.0s ago" and ago(75) == "1m 15s ago" and ago(-3) == "0.0s ago" and ago(None) == "never"
    assert duration(7322) == "2h 02m" and duration(90000) == "1d 1h"
