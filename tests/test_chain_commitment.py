"""Commitments are data: strict parsing, size limits, hostile strings stay inert."""

from __future__ import annotations

import builtins
import json
import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dtrain.chain.commitment import (
    MAX_COMMITMENT_BYTES,
    CommitmentError,
    MinerCommitment,
    parse_commitment,
    parse_commitments,
    split_api,
)

PEER = "12D3KooWabcdefghijkmnopqrstuvwxyzABCDEFGHJKLMNPQRSTU"
GOOD = {"v": 1, "peer_id": PEER, "api": "203.0.113.7:8091", "repo": "hf://owner/gpt2-250m"}


def test_valid_round_trip():
    record = parse_commitment(json.dumps(GOOD))
    assert record == MinerCommitment(peer_id=PEER, api="203.0.113.7:8091", repo="hf://owner/gpt2-250m")
    assert (record.host, record.port) == ("203.0.113.7", 8091)
    assert parse_commitment(record.to_json()) == record
    assert parse_commitment(record.to_json().encode()) == record


@pytest.mark.parametrize(
    "api, host, port",
    [("miner.example.org:443", "miner.example.org", 443), ("[2001:db8::1]:8091", "2001:db8::1", 8091),
     ("localhost:1", "localhost", 1)],
)
def test_api_forms(api, host, port):
    assert split_api(api) == (host, port)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.pop("peer_id"), "missing peer_id"),
        (lambda d: d.update(extra=1), "unknown keys"),
        (lambda d: d.update(v=2), "version"),
        (lambda d: d.update(v=True), "version"),  # bool is not the int 1
        (lambda d: d.update(v="1"), "version"),
        (lambda d: d.update(peer_id="0OIl" * 10), "peer_id"),  # not base58
        (lambda d: d.update(peer_id=123), "peer_id"),
        (lambda d: d.update(api="203.0.113.7"), "host:port"),
        (lambda d: d.update(api="203.0.113.7:0"), "port"),
        (lambda d: d.update(api="203.0.113.7:99999"), "port"),
        (lambda d: d.update(api="host name:80"), "hostname"),
        (lambda d: d.update(api="[::zz]:80"), "IPv6"),
        (lambda d: d.update(repo="owner/repo; rm -rf /"), "repo"),
        (lambda d: d.update(repo="{0.__class__}"), "repo"),
        (lambda d: d.update(repo=""), "repo"),
        (lambda d: d.update(repo=["a"]), "repo"),
    ],
)
def test_field_validation(mutate, message):
    data = dict(GOOD)
    mutate(data)
    with pytest.raises(CommitmentError, match=message):
        parse_commitment(json.dumps(data))


@pytest.mark.parametrize(
    "raw",
    [
        "", "null", "[]", "1", '"str"', "{", "{}", "NaN",
        '{"v":1,"v":1,"peer_id":"%s","api":"a:1","repo":"r"}' % PEER,  # duplicate key
        '{"v":1,"peer_id":"%s","api":"a:1","repo":"r","x":NaN}' % PEER,
        b"\xff\xfe{}",
        "[" * 100_000,
    ],
)
def test_malformed_rejected(raw):
    with pytest.raises(CommitmentError):
        parse_commitment(raw)


def test_oversized_rejected_before_parsing():
    padded = json.dumps(dict(GOOD)) + " " * MAX_COMMITMENT_BYTES
    with pytest.raises(CommitmentError, match="larger than"):
        parse_commitment(padded)
    with pytest.raises(CommitmentError, match="larger than"):
        parse_commitment(padded.encode())
    with pytest.raises(CommitmentError, match="larger than"):
        parse_commitment("x" * (MAX_COMMITMENT_BYTES + 1))


HOSTILE = [
    "__import__('os').system('touch {marker}')",
    "eval(\"__import__('os').system('touch {marker}')\")",
    '{{"v":1,"peer_id":"{peer}","api":"a:1","repo":"__import__(\'os\').system(\'touch {marker}\')"}}',
    '{{"v":1,"peer_id":"{peer}","api":"{{0.__init__.__globals__}}:1","repo":"r"}}',
]


@pytest.mark.parametrize("template", HOSTILE)
def test_hostile_strings_are_data(template, tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    raw = template.format(marker=marker, peer=PEER)

    def forbidden(*_args, **_kwargs):
        raise AssertionError("the parser must never evaluate input")

    monkeypatch.setattr(builtins, "eval", forbidden)
    monkeypatch.setattr(builtins, "exec", forbidden)
    with pytest.raises(CommitmentError):
        parse_commitment(raw)
    assert not marker.exists()


def test_reader_skips_and_logs_bad_commitments(caplog):
    raw = {
        "hk-good": json.dumps(GOOD),
        "hk-evil": "__import__('os')",
        "hk-big": "x" * 10_000,
        "hk-empty": "",
        "hk-none": None,
        "hk-bytes": b"\x00\x01",
    }
    with caplog.at_level(logging.WARNING, logger="dtrain.chain"):
        parsed = parse_commitments(raw)
    assert list(parsed) == ["hk-good"]
    assert caplog.text.count("malformed commitment") == 3


def test_constructor_refuses_what_readers_reject():
    with pytest.raises(CommitmentError):
        MinerCommitment(peer_id=PEER, api="nope", repo="r")


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=2000), st.binary(max_size=2000),
                 st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=50),
                              lambda c: st.lists(c, max_size=5) | st.dictionaries(st.text(max_size=10), c, max_size=5),
                              max_leaves=20).map(lambda v: json.dumps(v))))
def test_parser_only_ever_raises_commitment_error(raw):
    try:
        record = parse_commitment(raw)
    except CommitmentError:
        return
    assert isinstance(record, MinerCommitment)
    assert parse_commitment(record.to_json()) == record


@settings(max_examples=100, deadline=None)
@given(st.fixed_dictionaries({k: st.sampled_from([v, None, 0, "", "x" * 300, [v], {"k": v}])
                              for k, v in GOOD.items()}))
def test_mutated_records_are_valid_or_rejected(data):
    try:
        record = parse_commitment(json.dumps(data))
    except CommitmentError:
        assert data != GOOD
    else:
        assert data == GOOD and record.to_dict() == GOOD
