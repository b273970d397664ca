"""Wire messages are defined once: the types parse untrusted JSON, write it, and are what the
served OpenAPI document and docs/protocol.md describe."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from dtrain.api.messages import (
    MESSAGES, AllReduceRequest, AllReduceResponse, MicroBatchReport, QueryLimits, StateSliceRequest, StatusResponse,
    TrainRequest, TrainResponse,
)
from dtrain.api.openapi import openapi_document
from dtrain.api.rules import PayloadError
from tests.conftest import REPO

TRAIN = {"nonce": "0xc0ffee", "epoch": 3, "pages": 2, "micro_batch_size": 4, "params_digest": "a1b2c3d4e5f60718"}
ALLREDUCE = {"round_id": "sn38-3-1", "epoch": 3, "weight_cap": 32.0, "deadline_s": 45.0,
             "weight_caps": {"QmMiner": 32.0, "QmCheat": 0.0}}
ANSWER = {"uid": 2, "epoch": 3, "samples_total": 48, "params_digest": "a1b2c3d4e5f60718",
          "microbatches": [{"page": 7, "loss": 3.25, "sketch": [0.5, -1.0], "samples": 4, "nonce": "0xc0ffee"}]}


def test_round_trip_through_json():
    for message, data in ((TrainRequest, TRAIN), (AllReduceRequest, ALLREDUCE), (TrainResponse, ANSWER)):
        parsed = message.parse(json.loads(json.dumps(data)))
        assert parsed.to_json() == data
        assert message.parse(parsed.to_json()) == parsed
    answer = TrainResponse.parse(ANSWER)
    assert answer.microbatches == (MicroBatchReport(page=7, loss=3.25, sketch=(0.5, -1.0), samples=4, nonce="0xc0ffee"),)


def test_unknown_fields_are_ignored_so_newer_validators_can_talk_to_older_miners():
    assert TrainRequest.parse({**TRAIN, "future_field": [1, 2]}) == TrainRequest.parse(TRAIN)


@pytest.mark.parametrize("message, data, field", [
    (TrainRequest, {**TRAIN, "pages": 0}, "'pages' must be in 1..4096"),
    (TrainRequest, {**TRAIN, "pages": True}, "'pages' must be an integer"),
    (TrainRequest, {**TRAIN, "nonce": "xyz"}, "'nonce' must be a hex string"),
    (TrainRequest, {k: v for k, v in TRAIN.items() if k != "epoch"}, "'epoch' is required"),
    (TrainRequest, {**TRAIN, "params_digest": "NOT HEX"}, "'params_digest' must be lower-case hex"),
    (AllReduceRequest, {**ALLREDUCE, "deadline_s": 0}, "'deadline_s' must be in (0, 86400]"),
    (AllReduceRequest, {**ALLREDUCE, "weight_cap": float("inf")}, "'weight_cap' must be a finite number"),
    (AllReduceRequest, {**ALLREDUCE, "round_id": "a b"}, "'round_id' must be 1-128 chars"),
    (AllReduceRequest, {**ALLREDUCE, "weight_caps": {"Qm": -1}}, "'weight_caps' must map peer ids to numbers"),
    (AllReduceRequest, {**ALLREDUCE, "weight_caps": {"": 1.0}}, "'weight_caps' must map peer ids to numbers"),
    (AllReduceRequest, {**ALLREDUCE, "weight_caps": [1]}, "'weight_caps' must be an object of at most 4096"),
    (AllReduceRequest, {**ALLREDUCE, "weight_caps": {f"p{i}": 1.0 for i in range(4097)}}, "at most 4096 entries"),
    (TrainResponse, {**ANSWER, "microbatches": [{"page": 7, "loss": 3.2, "sketch": [0.5], "samples": 0}]},
     "'microbatches[0].samples' must be in 1..4096"),
    (TrainResponse, {**ANSWER, "microbatches": [{"page": 7, "loss": 3.2, "sketch": ["x"], "samples": 4}]},
     "'microbatches[0].sketch[0]' must be a finite number"),
    (TrainResponse, {**ANSWER, "microbatches": {"0": {}}}, "'microbatches' must be a list"),
    (AllReduceResponse, {"joined": "yes", "epoch": 1, "round": None}, "'joined' must be true or false"),
    (AllReduceResponse, {"joined": True, "epoch": 1}, "'round' is required"),
    (StateSliceRequest, {"offset": -1, "length": 5}, "'offset' must be in 0.."),
])
def test_bad_fields_are_named(message, data, field):
    with pytest.raises(PayloadError) as info:
        message.parse(data)
    assert field in str(info.value)


@pytest.mark.parametrize("raw", [[1, 2], {"peer": -1}, {"peer": float("nan")}, {"": 1.0}, {"p": True},
                                 {f"p{i}": 1.0 for i in range(4097)}, {"p": "1"}, {"p" * 129: 1.0}])
def test_malformed_weight_caps_are_refused(raw):
    with pytest.raises(PayloadError, match="'weight_caps'"):
        AllReduceRequest.parse({**ALLREDUCE, "weight_caps": raw})


def test_weight_caps_are_read_as_floats_and_absent_means_none():
    assert AllReduceRequest.parse({**ALLREDUCE, "weight_caps": {"QmA": 0, "QmB": 32}}).weight_caps == {
        "QmA": 0.0, "QmB": 32.0}
    assert AllReduceRequest.parse({k: v for k, v in ALLREDUCE.items() if k != "weight_caps"}).weight_caps is None


def test_not_an_object():
    with pytest.raises(PayloadError, match="body must be a JSON object"):
        TrainRequest.parse([TRAIN])


def test_null_is_accepted_only_where_documented():
    assert AllReduceResponse.parse({"joined": False, "epoch": 1, "round": None, "reason": "busy"}).round is None
    with pytest.raises(PayloadError, match="'reason'"):
        AllReduceResponse.parse({"joined": False, "epoch": 1, "round": None, "reason": None})


def test_public_status_is_read_field_by_field():
    doc = {"epoch": "x", "loss": 2.5, "samples": -3, "maddrs": ["/ip4/1.2.3.4/tcp/1/p2p/Qm"], "peer_id": 7}
    status = StatusResponse.parse(doc, lenient=True)
    assert (status.epoch, status.loss, status.samples, status.peer_id) == (None, 2.5, None, None)
    assert status.maddrs == ("/ip4/1.2.3.4/tcp/1/p2p/Qm",)
    with pytest.raises(PayloadError):
        StatusResponse.parse(doc)  # strict reading names the bad field


def test_state_slice_query_form():
    assert StateSliceRequest.from_query({"offset": "10", "length": "5"}) == StateSliceRequest(offset=10, length=5)
    for bad in ({"offset": "-1", "length": "5"}, {"offset": "1e3", "length": "5"}, {"offset": "9" * 19, "length": "1"}):
        with pytest.raises(PayloadError, match="'offset' must be a non-negative integer"):
            StateSliceRequest.from_query(bad)
    with pytest.raises(PayloadError, match="'length' is required"):
        StateSliceRequest.from_query({"offset": "1"})


def test_a_miners_own_limits_name_the_field_and_the_limit():
    limits = QueryLimits(max_pages=64, max_deadline_s=90.0, max_slice_bytes=1024)
    limits.check(TrainRequest.parse({**TRAIN, "pages": 64}))
    with pytest.raises(PayloadError, match="'pages' must be at most 64 on this miner"):
        limits.check(TrainRequest.parse({**TRAIN, "pages": 65}))
    with pytest.raises(PayloadError, match="'deadline_s' must be at most 90 on this miner"):
        limits.check(AllReduceRequest.parse({**ALLREDUCE, "deadline_s": 91}))
    with pytest.raises(PayloadError, match="'length' must be <= 1024"):
        limits.check(StateSliceRequest(offset=0, length=1025))


def test_openapi_components_are_the_message_types():
    doc = openapi_document(max_body_bytes=1 << 20, max_slice_bytes=64 << 20)
    assert doc["components"]["schemas"] == {m.__name__: m.json_schema() for m in MESSAGES}
    refs = set(re.findall(r'"#/components/schemas/(\w+)"', json.dumps(doc)))
    assert refs == {m.__name__ for m in MESSAGES}  # every type is used, and nothing else is referred to
    train = doc["components"]["schemas"]["TrainRequest"]
    assert set(train["properties"]) == {"nonce", "epoch", "pages", "micro_batch_size", "params_digest",
                                           "params_sketch"}
    assert set(doc["components"]["schemas"]["MicroBatchReport"]["properties"]) == {
        "page", "loss", "sketch", "samples", "nonce"}
    assert "weight_caps" in doc["components"]["schemas"]["AllReduceRequest"]["properties"]


def test_protocol_doc_tables_are_generated_from_the_types():
    result = subprocess.run([sys.executable, "scripts/gen_protocol_docs.py", "--check"], cwd=REPO,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    text = (REPO / "docs" / "protocol.md").read_text()
    documented = set(re.findall(r"<!-- fields:(\w+) -->", text))
    assert documented == {m.__name__ for m in MESSAGES}
    # Each documented table lists exactly the type's fields, in order.
    for message in MESSAGES:
        block = text.split(f"<!-- fields:{message.__name__} -->", 1)[1].split("<!-- /fields -->", 1)[0]
        assert re.findall(r"^\| `(\w+)` \|", block, flags=re.M) == [s.name for s in message.specs()]
