"""The miner API over real loopback sockets with real sr25519 hotkeys (btauth/1)."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import http.client
import json
import socket
import threading
import time

import pytest

bt = pytest.importorskip("bittensor")

from dtrain.api.client import ApiError, MinerClient  # noqa: E402
from dtrain.api.messages import (  # noqa: E402
    AllReduceRequest, AllReduceResponse, MicroBatchReport, QueryLimits, StatusResponse, TrainRequest, TrainResponse,
)
from dtrain.api.server import Handlers, HandlerError, MinerApiServer  # noqa: E402

STATE = bytes(range(256)) * 4096  # 1 MiB of model state
TRAIN = {"nonce": "c0ffee", "epoch": 3, "pages": 2, "micro_batch_size": 4}
ALLREDUCE = {"round_id": "r-1", "epoch": 3, "weight_cap": 1.5, "deadline_s": 30.0}
TRAIN_REQ = TrainRequest.parse(TRAIN)
ALLREDUCE_REQ = AllReduceRequest.parse(ALLREDUCE)


def _wallet(root, name):
    wallet = bt.Wallet(name, "hot", path=str(root))
    wallet.create_new_coldkey(use_password=False, suppress=True)
    wallet.create_new_hotkey(use_password=False, suppress=True)
    return wallet


@pytest.fixture(scope="module")
def wallets(tmp_path_factory):
    root = tmp_path_factory.mktemp("wallets")
    return {name: _wallet(root, name) for name in ("validator", "miner", "stranger", "other_miner")}


class Recorder:
    """Handlers that record every call, so tests can prove none happened."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.lock = threading.Lock()
        self.train_gate: threading.Event | None = None
        self.train_error: Exception | None = None

    def _note(self, *call):
        with self.lock:
            self.calls.append(call)

    def handlers(self) -> Handlers:
        def status():
            return StatusResponse(epoch=3, samples=10)

        def train(request, caller):
            self._note("train", request.to_json(), caller)
            if self.train_error is not None:
                raise self.train_error
            if self.train_gate is not None:
                assert self.train_gate.wait(60)
            return TrainResponse(uid=1, epoch=request.epoch, samples_total=8, params_digest="ab12",
                                 microbatches=(MicroBatchReport(page=0, loss=2.5, sketch=(0.1, -0.2), samples=4),))

        def allreduce(request, caller):
            self._note("allreduce", request.to_json(), caller)
            return AllReduceResponse(joined=True, epoch=request.epoch, round=None)

        def state_slice(offset, length, snapshot=None):
            if snapshot is not None:  # a DiLoCo snapshot: (epoch, step) decides the bytes
                self._note("snapshot", offset, length, snapshot)
                return bytes([snapshot[1]]) * length
            self._note("state_slice", offset, length)
            return STATE[offset:offset + length]

        return Handlers(status=status, train=train, allreduce=allreduce, state_slice=state_slice)


@pytest.fixture
def served(wallets):
    recorder = Recorder()
    allowed = {wallets["validator"].hotkey.ss58_address}
    permit_error: list[Exception] = []

    def is_allowed(hotkey):
        if permit_error:
            raise permit_error[0]
        return hotkey in allowed

    server = MinerApiServer(
        recorder.handlers(), self_hotkey=wallets["miner"].hotkey.ss58_address,
        is_allowed=is_allowed, max_body_bytes=4096, limits=QueryLimits(max_pages=64, max_slice_bytes=len(STATE)),
    ).start()
    server.permit_error = permit_error  # type: ignore[attr-defined]
    yield server, recorder
    server.stop()


def send(server, method, target, body=b"", headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.request(method, target, body=body, headers=headers or {})
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def signed(wallet, receiver, method, target, body=b"", **kwargs):
    headers = bt.http_auth.sign(wallet, method=method, path=target, body=body, receiver_ss58=receiver, **kwargs)
    headers["Content-Type"] = "application/json"
    return headers


def body_of(payload) -> bytes:
    return json.dumps(payload).encode()


def error_of(raw: bytes) -> str:
    doc = json.loads(raw)
    assert set(doc) == {"error", "status"}
    return doc["error"]


def test_signed_train_reaches_handler_with_caller(served, wallets):
    server, rec = served
    body = body_of(TRAIN)
    status, headers, raw = send(server, "POST", "/v1/train", body,
                                signed(wallets["validator"], server.self_hotkey, "POST", "/v1/train", body))
    assert status == 200, raw
    assert json.loads(raw)["microbatches"][0]["loss"] == 2.5
    assert rec.calls == [("train", TRAIN, wallets["validator"].hotkey.ss58_address)]


def test_signed_allreduce(served, wallets):
    server, rec = served
    body = body_of(ALLREDUCE)
    status, _, raw = send(server, "POST", "/v1/allreduce", body,
                          signed(wallets["validator"], server.self_hotkey, "POST", "/v1/allreduce", body))
    assert (status, json.loads(raw)) == (200, {"joined": True, "epoch": 3, "round": None})
    assert rec.calls[0][0] == "allreduce"


def _attacks(wallets, receiver):
    """(name, headers, body, expected status) for every rejected request kind."""
    v, stranger = wallets["validator"], wallets["stranger"]
    body = body_of(TRAIN)
    path = "/v1/train"
    good = lambda **kw: signed(v, receiver, "POST", path, body, **kw)  # noqa: E731

    tampered_sig = good()
    sig = tampered_sig["X-Bittensor-Signature"]
    tampered_sig["X-Bittensor-Signature"] = sig[:-2] + ("00" if sig[-2:] != "00" else "11")
    impersonation = signed(stranger, receiver, "POST", path, body)
    impersonation["X-Bittensor-Hotkey"] = v.hotkey.ss58_address  # stranger's sig, validator's name
    return [
        ("unsigned", {"Content-Type": "application/json"}, body, 401),
        ("stale", good(nonce_ns=time.time_ns() - 60 * 10**9), body, 401),
        ("future", good(nonce_ns=time.time_ns() + 60 * 10**9), body, 401),
        ("tampered body", good(), body_of(dict(TRAIN, pages=64)), 401),
        ("tampered signature", tampered_sig, body, 401),
        ("impersonation", impersonation, body, 401),
        ("wrong receiver", signed(v, wallets["other_miner"].hotkey.ss58_address, "POST", path, body), body, 401),
        ("other path", signed(v, receiver, "POST", "/v1/allreduce", body), body, 401),
        ("bad version", dict(good(), **{"X-Bittensor-Version": "2"}), body, 401),
        ("garbage nonce", dict(good(), **{"X-Bittensor-Nonce": "soon"}), body, 401),
        ("unknown hotkey", signed(stranger, receiver, "POST", path, body), body, 403),
    ]


@pytest.mark.parametrize("index", range(11))
def test_rejected_requests_never_reach_handler(served, wallets, index):
    server, rec = served
    name, headers, body, expected = _attacks(wallets, server.self_hotkey)[index]
    status, _, raw = send(server, "POST", "/v1/train", body, headers)
    assert status == expected, (name, raw)
    assert error_of(raw)
    assert rec.calls == [], name


def test_replay_is_rejected(served, wallets):
    server, rec = served
    body = body_of(TRAIN)
    headers = signed(wallets["validator"], server.self_hotkey, "POST", "/v1/train", body)
    assert send(server, "POST", "/v1/train", body, headers)[0] == 200
    status, _, raw = send(server, "POST", "/v1/train", body, headers)
    assert status == 401 and "already accepted" in error_of(raw)
    assert len(rec.calls) == 1


def test_oversized_body_is_413_signed_or_not(served, wallets):
    server, rec = served
    big = body_of(dict(TRAIN, pad="x" * 5000))
    assert send(server, "POST", "/v1/train", big, {"Content-Type": "application/json"})[0] == 413
    headers = signed(wallets["validator"], server.self_hotkey, "POST", "/v1/train", big)
    status, _, raw = send(server, "POST", "/v1/train", big, headers)
    assert status == 413 and "4096" in error_of(raw)
    assert rec.calls == []


def test_chunked_oversized_body_is_413(served):
    server, rec = served
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        chunk = b"x" * 3000
        sock.sendall(b"POST /v1/train HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                     b"Content-Type: application/json\r\nConnection: close\r\n\r\n")
        for _ in range(3):
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        sock.sendall(b"0\r\n\r\n")
        reply = sock.makefile("rb").readline()
    assert b" 413 " in reply
    assert rec.calls == []


@pytest.mark.parametrize(
    "body, content_type, expected, words",
    [
        (b'{"nonce": "ab", "epoch": ', "application/json", 400, "malformed JSON"),
        (b"\xff\xfe", "application/json", 400, "not UTF-8"),
        (b'{"nonce": NaN}', "application/json", 400, "NaN"),
        (body_of(TRAIN), "text/plain", 415, "Content-Type"),
        (b"[1, 2]", "application/json", 422, "JSON object"),
        (body_of(dict(TRAIN, pages=0)), "application/json", 422, "'pages'"),
        (body_of(dict(TRAIN, epoch=True)), "application/json", 422, "'epoch'"),
        (body_of(dict(TRAIN, nonce="not hex")), "application/json", 422, "'nonce'"),
        (body_of({k: v for k, v in TRAIN.items() if k != "micro_batch_size"}), "application/json", 422,
         "'micro_batch_size'"),
    ],
)
def test_bad_content_is_named_and_not_handled(served, wallets, body, content_type, expected, words):
    server, rec = served
    headers = signed(wallets["validator"], server.self_hotkey, "POST", "/v1/train", body)
    headers["Content-Type"] = content_type
    status, _, raw = send(server, "POST", "/v1/train", body, headers)
    assert status == expected and words in error_of(raw), raw
    assert rec.calls == []


def test_allreduce_schema(served, wallets):
    server, rec = served
    for bad in (dict(ALLREDUCE, deadline_s=0), dict(ALLREDUCE, weight_cap=-1), dict(ALLREDUCE, round_id="a b")):
        body = body_of(bad)
        status, _, raw = send(server, "POST", "/v1/allreduce", body,
                              signed(wallets["validator"], server.self_hotkey, "POST", "/v1/allreduce", body))
        assert status == 422, raw
    assert rec.calls == []


def test_unknown_path_and_method(served):
    server, _ = served
    status, _, raw = send(server, "GET", "/v2/anything")
    assert status == 404 and error_of(raw)
    status, _, raw = send(server, "GET", "/v1/train")
    assert status == 405 and error_of(raw)


def test_permit_check_outage_is_503_and_safe(served, wallets):
    server, rec = served
    server.permit_error.append(RuntimeError("chain down"))
    body = body_of(TRAIN)
    status, _, raw = send(server, "POST", "/v1/train", body,
                          signed(wallets["validator"], server.self_hotkey, "POST", "/v1/train", body))
    assert status == 503 and "chain down" not in error_of(raw)
    assert rec.calls == []


def test_handler_errors(served, wallets):
    server, rec = served
    body = body_of(TRAIN)
    rec.train_error = HandlerError(409, "already training this epoch")
    status, _, raw = send(server, "POST", "/v1/train", body,
                          signed(wallets["validator"], server.self_hotkey, "POST", "/v1/train", body))
    assert (status, error_of(raw)) == (409, "already training this epoch")
    rec.train_error = RuntimeError("secret detail")
    status, _, raw = send(server, "POST", "/v1/train", body,
                          signed(wallets["validator"], server.self_hotkey, "POST", "/v1/train", body))
    assert status == 500 and "secret" not in error_of(raw)
    assert send(server, "GET", "/v1/status")[0] == 200  # still serving


def test_status_is_public_and_secret_free(served, wallets):
    server, rec = served
    status, headers, raw = send(server, "GET", "/v1/status")
    doc = json.loads(raw)
    assert status == 200 and headers["Content-Type"].startswith("application/json")
    assert doc == {"api_version": "1", "hotkey": server.self_hotkey, "epoch": 3, "samples": 10}
    assert rec.calls == []


def test_state_slice_get_and_post(served, wallets):
    server, rec = served
    target = "/v1/state-slice?offset=1000&length=5000"
    status, headers, raw = send(server, "GET", target,
                                headers=signed(wallets["validator"], server.self_hotkey, "GET", target))
    assert status == 200 and headers["Content-Type"] == "application/octet-stream"
    assert raw == STATE[1000:6000] and headers["X-Dtrain-Offset"] == "1000"
    body = body_of({"offset": 10, "length": 20})
    status, _, raw = send(server, "POST", "/v1/state-slice", body,
                          signed(wallets["validator"], server.self_hotkey, "POST", "/v1/state-slice", body))
    assert status == 200 and raw == STATE[10:30]
    assert [c[0] for c in rec.calls] == ["state_slice", "state_slice"]


def test_state_slice_of_a_diloco_snapshot_passes_its_epoch_and_step(served, wallets):
    server, rec = served
    target = "/v1/state-slice?offset=8&length=16&epoch=5&snapshot=4"
    status, _, raw = send(server, "GET", target, headers=signed(wallets["validator"], server.self_hotkey, "GET", target))
    assert status == 200 and raw == bytes([4]) * 16
    assert rec.calls[-1][1:3] == (8, 16) and rec.calls[-1][3] == (5, 4)
    bad = "/v1/state-slice?offset=0&length=4&snapshot=x"
    status, _, _ = send(server, "GET", bad, headers=signed(wallets["validator"], server.self_hotkey, "GET", bad))
    assert status == 422


@pytest.mark.parametrize(
    "target, expected",
    [("/v1/state-slice?offset=0", 422), ("/v1/state-slice?offset=-1&length=5", 422),
     ("/v1/state-slice?offset=0&length=0", 422), (f"/v1/state-slice?offset=0&length={len(STATE) + 1}", 422),
     ("/v1/state-slice?offset=x&length=5", 422)],
)
def test_state_slice_bad_params(served, wallets, target, expected):
    server, rec = served
    status, _, _ = send(server, "GET", target,
                        headers=signed(wallets["validator"], server.self_hotkey, "GET", target))
    assert status == expected
    assert rec.calls == []


def test_state_slice_query_is_signed(served, wallets):
    server, rec = served
    headers = signed(wallets["validator"], server.self_hotkey, "GET", "/v1/state-slice?offset=0&length=10")
    status, _, _ = send(server, "GET", "/v1/state-slice?offset=0&length=999999", headers=headers)
    assert status == 401
    assert send(server, "GET", "/v1/state-slice?offset=0&length=10")[0] == 401
    assert rec.calls == []


def test_metrics_count_requests_and_auth_failures(served, wallets):
    server, _ = served
    send(server, "GET", "/v1/status")
    send(server, "POST", "/v1/train", b"{}", {"Content-Type": "application/json"})
    body = body_of(TRAIN)
    send(server, "POST", "/v1/train", body, signed(wallets["stranger"], server.self_hotkey, "POST", "/v1/train", body))
    send(server, "GET", "/no/such/path")
    status, headers, raw = send(server, "GET", "/metrics")
    text = raw.decode()
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    assert 'dtrain_api_requests_total{endpoint="status",status="200"} 1.0' in text
    assert 'dtrain_api_requests_total{endpoint="train",status="401"} 1.0' in text
    assert 'dtrain_api_requests_total{endpoint="train",status="403"} 1.0' in text
    assert 'dtrain_api_requests_total{endpoint="other",status="404"} 1.0' in text
    assert 'dtrain_api_auth_failures_total{reason="MalformedAuth"} 1.0' in text
    assert 'dtrain_api_auth_failures_total{reason="forbidden"} 1.0' in text


def test_two_servers_keep_separate_metrics(wallets):
    rec = Recorder()
    kwargs = dict(self_hotkey=wallets["miner"].hotkey.ss58_address, is_allowed=lambda _h: True)
    with MinerApiServer(rec.handlers(), **kwargs) as one, MinerApiServer(rec.handlers(), **kwargs) as two:
        assert one.port != two.port
        send(one, "GET", "/v1/status")
        send(one, "GET", "/v1/status")
        assert 'endpoint="status",status="200"} 2.0' in send(one, "GET", "/metrics")[2].decode()
        assert 'endpoint="status",status="200"}' not in send(two, "GET", "/metrics")[2].decode()


def test_openapi_document(served):
    server, _ = served
    status, _, raw = send(server, "GET", "/v1/openapi.json")
    doc = json.loads(raw)
    assert status == 200 and doc["openapi"].startswith("3.")
    assert {"/v1/status", "/v1/train", "/v1/allreduce", "/v1/state-slice", "/metrics"} <= set(doc["paths"])
    body = doc["paths"]["/v1/train"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert doc["components"]["schemas"][body["$ref"].rsplit("/", 1)[1]]["required"] == [
        "nonce", "epoch", "pages", "micro_batch_size"]
    # what is served over HTTP is exactly the message types (which also write docs/protocol.md)
    from dtrain.api.messages import MESSAGES

    assert doc["components"]["schemas"] == json.loads(json.dumps({m.__name__: m.json_schema() for m in MESSAGES}))


def test_slow_handler_does_not_block_status(served, wallets):
    server, rec = served
    rec.train_gate = threading.Event()
    body = body_of(TRAIN)
    headers = signed(wallets["validator"], server.self_hotkey, "POST", "/v1/train", body)
    result: list = []
    worker = threading.Thread(target=lambda: result.append(send(server, "POST", "/v1/train", body, headers)))
    worker.start()
    try:
        for _ in range(600):  # wait until the handler is running (it records first)
            if rec.calls:
                break
            time.sleep(0.05)
        assert rec.calls, "train handler never started"
        assert send(server, "GET", "/v1/status")[0] == 200  # answered while train is blocked
        assert not result  # train really is still in flight
    finally:
        rec.train_gate.set()
        worker.join(60)
    assert result[0][0] == 200


def test_stop_is_clean_and_bind_errors_surface(wallets):
    rec = Recorder()
    server = MinerApiServer(rec.handlers(), self_hotkey="x", is_allowed=lambda _h: False).start()
    port = server.port
    clash = MinerApiServer(rec.handlers(), self_hotkey="x", is_allowed=lambda _h: False, port=port)
    with pytest.raises(OSError):
        clash.start()
    server.stop()
    server.stop()  # idempotent
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_runs_on_a_caller_loop(wallets):
    rec = Recorder()

    async def main():
        server = MinerApiServer(rec.handlers(), self_hotkey="x", is_allowed=lambda _h: False)
        await server.start_async()
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(None, send, server, "GET", "/v1/status")
        finally:
            await server.stop_async()

    status, _, raw = asyncio.run(main())
    assert status == 200 and json.loads(raw)["hotkey"] == "x"


# -- validator client -----------------------------------------------------------------


def test_client_round_trip(served, wallets):
    server, rec = served
    client = MinerClient(wallets["validator"], timeout=30)
    api = f"127.0.0.1:{server.port}"
    assert client.status(api).epoch == 3 and client.status(api).hotkey == server.self_hotkey
    assert client.train(api, server.self_hotkey, TRAIN_REQ).samples_total == 8
    assert client.allreduce(api, server.self_hotkey, ALLREDUCE_REQ).joined is True
    assert rec.calls[0] == ("train", TRAIN, wallets["validator"].hotkey.ss58_address)
    download = client.state_slice(api, server.self_hotkey, 4096, 300_000, keep_data=True)
    assert download.bytes_received == 300_000 and download.data == STATE[4096:304096]
    assert download.sha256 == hashlib.sha256(STATE[4096:304096]).hexdigest()
    assert download.seconds >= download.first_byte_seconds >= 0 and download.bytes_per_second > 0
    assert "dtrain_api_requests_total" in client.metrics(server.url)


def test_client_errors_carry_status_and_message(served, wallets):
    server, rec = served
    with pytest.raises(ApiError) as info:
        MinerClient(wallets["stranger"]).train(server.url, server.self_hotkey, TRAIN_REQ)
    assert info.value.status == 403 and "not allowed" in info.value.message
    with pytest.raises(ApiError) as info:
        MinerClient(wallets["validator"]).train(server.url, server.self_hotkey, dataclasses.replace(TRAIN_REQ, pages=-1))
    assert info.value.status == 422 and "'pages'" in info.value.message
    with pytest.raises(ApiError) as info:
        MinerClient(wallets["validator"]).train(server.url, server.self_hotkey, dataclasses.replace(TRAIN_REQ, pages=65))
    assert info.value.status == 422 and "at most 64 on this miner" in info.value.message
    with pytest.raises(ApiError) as info:
        MinerClient(wallets["validator"]).train(server.url, wallets["other_miner"].hotkey.ss58_address, TRAIN_REQ)
    assert info.value.status == 401
    assert rec.calls == []


def test_client_unreachable(wallets):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(ApiError, match="unreachable") as info:
        MinerClient(wallets["validator"], timeout=5).status(f"127.0.0.1:{port}")
    assert info.value.status is None


def test_sandbox_registered_validator_is_the_allowed_caller(wallets, tmp_path):
    """End to end: the permit check is the sandbox chain's registered validator."""
    from dtrain.chain import sandbox
    from dtrain.chain.permits import ValidatorPermits

    sandbox.create(tmp_path / "chain")
    chain = sandbox.SandboxChain(tmp_path / "chain")
    chain.register(wallets["validator"].hotkey.ss58_address, validator_permit=True, stake=1.0)
    chain.register(wallets["stranger"].hotkey.ss58_address)  # a registered miner, no permit
    rec = Recorder()
    with MinerApiServer(rec.handlers(), self_hotkey=wallets["miner"].hotkey.ss58_address,
                        is_allowed=ValidatorPermits(chain)) as server:
        assert MinerClient(wallets["validator"]).train(server.url, server.self_hotkey, TRAIN_REQ).uid == 1
        with pytest.raises(ApiError) as info:
            MinerClient(wallets["stranger"]).train(server.url, server.self_hotkey, TRAIN_REQ)
        assert info.value.status == 403
    assert len(rec.calls) == 1
    chain.close()


def _api_pool_threads():
    return sorted(t.name for t in threading.enumerate() if t.name.startswith(("dtrain-api-handler", "dtrain-api-light")))


def test_pool_threads_are_all_running_from_the_start_and_gone_after_stop(wallets):
    """The thread count must not climb in steps as requests overlap (a weeks-long neuron
    could not tell that from a leak), and a stopped server leaves no thread behind."""
    before = _api_pool_threads()
    recorder = Recorder()
    server = MinerApiServer(recorder.handlers(), self_hotkey=wallets["miner"].hotkey.ss58_address,
                            is_allowed=lambda hotkey: True, handler_workers=3).start()
    try:
        started = _api_pool_threads()
        assert len(started) == len(before) + 3 + 2, started
        recorder.train_gate = threading.Event()  # hold every train call, so requests overlap
        body = body_of(TRAIN)

        def call():
            headers = signed(wallets["validator"], wallets["miner"].hotkey.ss58_address, "POST", "/v1/train", body)
            send(server, "POST", "/v1/train", body, headers)

        callers = [threading.Thread(target=call) for _ in range(6)]
        for c in callers:
            c.start()
        deadline = time.monotonic() + 30
        while len(recorder.calls) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(recorder.calls) == 3  # every handler thread busy, the rest queued
        assert _api_pool_threads() == started
        recorder.train_gate.set()
        for c in callers:
            c.join(60)
        assert len(recorder.calls) == 6
        assert _api_pool_threads() == started
    finally:
        server.stop()
    deadline = time.monotonic() + 10
    while _api_pool_threads() != before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _api_pool_threads() == before


def test_a_server_that_cannot_bind_leaves_no_pool_thread(wallets):
    before = _api_pool_threads()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = MinerApiServer(Recorder().handlers(), self_hotkey=wallets["miner"].hotkey.ss58_address,
                                is_allowed=lambda hotkey: True, port=taken.getsockname()[1])
        with pytest.raises(OSError):
            server.start()
    deadline = time.monotonic() + 10
    while _api_pool_threads() != before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _api_pool_threads() == before
