"""Hypothesis fuzzing of the miner API: arbitrary bodies, headers and paths.

Invariants: the server never answers 5xx and never dies; unauthenticated input
never reaches a handler; signed input reaches a handler only when it parses as
its message type (dtrain.api.messages).
"""

from __future__ import annotations

import http.client
import json
import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

bt = pytest.importorskip("bittensor")

from dtrain.api.messages import (  # noqa: E402
    AllReduceResponse, StatusResponse, TrainRequest, TrainResponse,
)
from dtrain.api.rules import PayloadError  # noqa: E402
from dtrain.api.server import Handlers, MinerApiServer  # noqa: E402

AUTH_HEADERS = ["X-Bittensor-Version", "X-Bittensor-Hotkey", "X-Bittensor-Receiver",
                "X-Bittensor-Nonce", "X-Bittensor-Signature", "X-Bittensor-Crypto"]
HEADER_TEXT = st.text(alphabet=string.ascii_letters + string.digits + " -_.:/+=0x", max_size=120)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz-wallets")
    wallets = {}
    for name in ("validator", "miner"):
        wallet = bt.Wallet(name, "hot", path=str(root))
        wallet.create_new_coldkey(use_password=False, suppress=True)
        wallet.create_new_hotkey(use_password=False, suppress=True)
        wallets[name] = wallet
    calls: list = []
    handlers = Handlers(
        status=lambda: StatusResponse(state="fuzzed"),
        train=lambda request, caller: calls.append(("train", request)) or TrainResponse(
            uid=0, epoch=request.epoch, samples_total=0, params_digest="00", microbatches=()),
        allreduce=lambda request, caller: calls.append(("allreduce", request)) or AllReduceResponse(
            joined=False, epoch=request.epoch, round=None),
        state_slice=lambda offset, length, snapshot: calls.append(("slice", offset)) or b"\0" * min(length, 16),
    )
    validator = wallets["validator"].hotkey.ss58_address
    server = MinerApiServer(handlers, self_hotkey=wallets["miner"].hotkey.ss58_address,
                            is_allowed=lambda hk: hk == validator, max_body_bytes=2048).start()
    yield server, wallets, calls
    server.stop()


def send(server, method, target, body, headers):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.request(method, target, body=body, headers=headers)
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=12), c, max_size=4),
    max_leaves=15,
)
bodies = st.one_of(
    st.binary(max_size=3000),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries({"nonce": st.text(max_size=10), "epoch": st.integers(),
                           "pages": st.integers(), "micro_batch_size": st.integers()}).map(lambda v: json.dumps(v).encode()),
)
FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE"]),
    path=st.sampled_from(["/v1/train", "/v1/allreduce", "/v1/state-slice", "/v1/state-slice?offset=0&length=4",
                          "/v1/status", "/metrics", "/v1/openapi.json", "/v1/../v1/train", "/x%00y", "/v1/train?a=b"]),
    body=bodies,
    headers=st.dictionaries(st.sampled_from(AUTH_HEADERS + ["Content-Type", "X-Other"]), HEADER_TEXT, max_size=7),
)
def test_unauthenticated_noise_never_5xx_or_handled(env, method, path, body, headers):
    server, _, calls = env
    before = len(calls)
    status = send(server, method, path, body, headers)
    assert status < 500, (method, path, status)
    assert len(calls) == before  # forged/garbage auth never reaches a handler


@FUZZ
@given(body=bodies, content_type=st.sampled_from(["application/json", "text/plain", ""]))
def test_signed_noise_is_handled_only_when_valid(env, body, content_type):
    server, wallets, calls = env
    headers = bt.http_auth.sign(wallets["validator"], method="POST", path="/v1/train", body=body,
                                receiver_ss58=server.self_hotkey)
    if content_type:
        headers["Content-Type"] = content_type
    before = len(calls)
    status = send(server, "POST", "/v1/train", body, headers)
    assert status in (200, 400, 413, 415, 422), status
    try:
        # Mirror the server: strict UTF-8, no NaN/Infinity constants.
        payload = json.loads(body.decode("utf-8"), parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
        TrainRequest.parse(payload)
        valid = content_type == "application/json" and len(body) <= 2048
    except (ValueError, PayloadError):
        valid = False
    assert (status == 200) == valid
    assert len(calls) == before + (1 if valid else 0)


def test_server_still_healthy_after_fuzzing(env):
    server, _, _ = env
    assert send(server, "GET", "/v1/status", b"", {}) == 200
