"""MinerClient against real loopback servers that misbehave the way a hostile or
broken miner can: every failure must surface as ApiError, within the call's timeout,
without reading unbounded data."""

from __future__ import annotations

import http.server
import json
import socket
import threading
import time
from typing import Callable

import pytest

bt = pytest.importorskip("bittensor")

from dtrain.api.client import MAX_JSON_BYTES, ApiError, MinerClient  # noqa: E402
from dtrain.api.messages import AllReduceRequest, TrainRequest  # noqa: E402

TRAIN = TrainRequest(nonce="c0ffee", epoch=7, pages=1, micro_batch_size=8)
ROUND = AllReduceRequest(round_id="r-7", epoch=7, weight_cap=16.0, deadline_s=30.0)

MINER = "5FHneW46xGXgs5mUiveU4sbTyGBzmstUspZC92UhjJM694ty"  # receiver for signed calls; not verified here


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    wallet = bt.Wallet("validator", "hot", path=str(tmp_path_factory.mktemp("wallets")))
    wallet.create_new_coldkey(use_password=False, suppress=True)
    wallet.create_new_hotkey(use_password=False, suppress=True)
    return MinerClient(wallet, timeout=10)


class RawServer:
    """One-behaviour TCP server: reads the request head, then lets ``behave`` write
    whatever bytes it likes. Counts what it sent so tests can check the client
    stopped early instead of timing wall clocks tightly."""

    def __init__(self, behave: Callable[["RawServer", socket.socket], None]):
        self.behave = behave
        self.sent = 0
        self.stop = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.2)
        self.api = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def send(self, conn: socket.socket, data: bytes) -> None:
        conn.sendall(data)
        self.sent += len(data)

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except (socket.timeout, OSError):
                continue
            with conn:
                conn.settimeout(5)
                try:
                    head = b""
                    while b"\r\n\r\n" not in head:
                        data = conn.recv(4096)
                        if not data:
                            break
                        head += data
                    self.behave(self, conn)
                except OSError:
                    pass  # the client hung up on us: exactly what these tests want

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.listener.close()


@pytest.fixture
def raw_server():
    servers: list[RawServer] = []

    def start(behave):
        servers.append(RawServer(behave))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def reply(body: bytes, *, status: str = "200 OK", headers: str = "") -> Callable:
    def behave(server: RawServer, conn: socket.socket) -> None:
        head = f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n{headers}\r\n"
        server.send(conn, head.encode() + body)

    return behave


# -- garbage at the HTTP layer ----------------------------------------------------------


@pytest.mark.parametrize("raw", [
    b"HELLO THERE\r\n\r\n",  # not a status line
    b"HTTP/1.1 abc OK\r\n\r\n",  # status not a number
    b"",  # connection closed without a word (RemoteDisconnected)
    b"HTTP/1.1 200 OK\r\nX-Long: " + b"a" * 70_000 + b"\r\n\r\n",  # header line too long
    b"HTTP/1.1 200 OK\r\n" + b"X-H: 1\r\n" * 200 + b"\r\n",  # too many headers
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",  # bad chunk size
    b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{\x00",  # valid HTTP, body not JSON
])
def test_http_garbage_is_api_error(client, raw_server, raw):
    server = raw_server(lambda s, conn: s.send(conn, raw))
    with pytest.raises(ApiError) as info:
        client.status(server.api)
    assert info.value.url.endswith("/v1/status")


def test_truncated_body_is_api_error(client, raw_server):
    # Content-Length promises 1000 bytes, 7 arrive, then the connection closes.
    server = raw_server(lambda s, conn: s.send(
        conn, b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n{\"a\":1}"))
    with pytest.raises(ApiError, match="truncated"):
        client.status(server.api)


def test_truncated_chunked_body_is_api_error(client, raw_server):
    server = raw_server(lambda s, conn: s.send(
        conn, b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n100\r\n{\"a\""))
    with pytest.raises(ApiError):
        client.status(server.api)


# -- slow miners: one total deadline per call ----------------------------------------------


def _trickle(prefix: bytes, total: int) -> Callable:
    def behave(server: RawServer, conn: socket.socket) -> None:
        server.send(conn, prefix)
        for _ in range(total):
            if server.stop.is_set():
                return
            server.send(conn, b" ")  # whitespace keeps the JSON valid if it ever completed
            time.sleep(0.5)

    return behave


def test_trickling_body_hits_the_total_deadline(client, raw_server):
    # 100 body bytes at 1 byte / 0.5 s would take 50 s; every single read is quick,
    # so only a total deadline stops it.
    server = raw_server(_trickle(b"HTTP/1.1 200 OK\r\nContent-Length: 102\r\n\r\n{", 100))
    started = time.monotonic()
    with pytest.raises(ApiError, match="timed out"):
        client.status(server.api, timeout=2)
    elapsed = time.monotonic() - started
    body_bytes = server.sent - len(b"HTTP/1.1 200 OK\r\nContent-Length: 102\r\n\r\n{")
    assert body_bytes < 20, body_bytes  # ~4 at 2 s; far from the 100 a full read needs
    assert elapsed < 10


def test_trickling_headers_hit_the_total_deadline(client, raw_server):
    # Header parsing happens inside http.client: the deadline must hold there too.
    def behave(server: RawServer, conn: socket.socket) -> None:
        for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 200:
            if server.stop.is_set():
                return
            server.send(conn, bytes([byte]))
            time.sleep(0.5)

    server = raw_server(behave)
    started = time.monotonic()
    with pytest.raises(ApiError, match="timed out"):
        client.status(server.api, timeout=2)
    assert server.sent < 20, server.sent
    assert time.monotonic() - started < 10


def test_silent_server_times_out(client, raw_server):
    server = raw_server(lambda s, conn: s.stop.wait(10))
    started = time.monotonic()
    with pytest.raises(ApiError, match="timed out"):
        client.status(server.api, timeout=1)
    assert time.monotonic() - started < 8


def test_trickling_error_body_still_bounded(client, raw_server):
    # A 500 whose error body trickles: the status is reported, the deadline holds.
    server = raw_server(_trickle(b"HTTP/1.1 500 Oops\r\nContent-Length: 100\r\n\r\n", 100))
    with pytest.raises(ApiError) as info:
        client.status(server.api, timeout=2)
    assert info.value.status == 500
    assert server.sent < 80


def test_trickling_state_slice_is_bounded(client, raw_server):
    server = raw_server(_trickle(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n", 100))
    with pytest.raises(ApiError, match="timed out"):
        client.state_slice(server.api, MINER, 0, 100, timeout=2)
    assert server.sent < 80


# -- hostile JSON -------------------------------------------------------------------------------


@pytest.mark.parametrize("body", [
    b'{"loss": NaN}', b'{"loss": Infinity}', b'{"loss": -Infinity}', b'{"a": [1, {"b": NaN}]}',
])
def test_non_finite_json_is_rejected(client, raw_server, body):
    server = raw_server(reply(body))
    with pytest.raises(ApiError, match="non-finite"):
        client.status(server.api)


def test_deeply_nested_json_is_api_error(client, raw_server):
    server = raw_server(reply(b"[" * 100_000 + b"]" * 100_000))
    with pytest.raises(ApiError):
        client.status(server.api)
    server = raw_server(reply(b'{"a":' * 100_000 + b"1" + b"}" * 100_000))
    with pytest.raises(ApiError):
        client.status(server.api)


@pytest.mark.parametrize("body", [
    b"\xff\xfe\x00{garbage",  # not UTF-anything
    b'{"a": "\xc3\x28"}',  # invalid UTF-8 inside a string
    b'{"n": ' + b"1" * 10_000 + b"}",  # past Python's int digit limit
    b"[1, 2]",  # valid JSON, not an object
    b"",
])
def test_undecodable_json_is_api_error(client, raw_server, body):
    server = raw_server(reply(body))
    with pytest.raises(ApiError):
        client.status(server.api)


def test_hostile_json_on_signed_calls(client, raw_server):
    server = raw_server(reply(b'{"joined": true, "x": NaN}'))
    with pytest.raises(ApiError):
        client.allreduce(server.api, MINER, ROUND)
    server = raw_server(reply(b"[" * 100_000))
    with pytest.raises(ApiError):
        client.train(server.api, MINER, TRAIN)


@pytest.mark.parametrize("body, field", [
    (b'{"joined": "yes", "epoch": 7, "round": null}', "'joined' must be true or false"),
    (b'{"joined": true, "epoch": -1, "round": null}', "'epoch' must be in"),
    (b'{"epoch": 7, "round": null}', "'joined' is required"),
])
def test_an_answer_that_is_not_its_message_type_is_an_api_error(client, raw_server, body, field):
    server = raw_server(reply(body))
    with pytest.raises(ApiError) as info:
        client.allreduce(server.api, MINER, ROUND)
    assert "malformed AllReduceResponse" in info.value.message and field in info.value.message


def test_a_train_answer_with_a_forged_shape_is_refused(client, raw_server):
    forged = (b'{"uid": 1, "epoch": 7, "samples_total": 8, "params_digest": "ab", '
              b'"microbatches": [{"page": 0, "loss": 2.5, "sketch": "not a list", "samples": 8}]}')
    server = raw_server(reply(forged))
    with pytest.raises(ApiError, match=r"'microbatches\[0\]\.sketch' must be a list"):
        client.train(server.api, MINER, TRAIN)


# -- oversized bodies ------------------------------------------------------------------------------


def test_declared_oversized_body_is_refused_unread(client, raw_server):
    size = MAX_JSON_BYTES + 1

    def behave(server: RawServer, conn: socket.socket) -> None:
        server.send(conn, f"HTTP/1.1 200 OK\r\nContent-Length: {size}\r\n\r\n".encode())
        block = b" " * (1 << 20)
        for _ in range(size // len(block) + 1):
            server.send(conn, block)

    server = raw_server(behave)
    with pytest.raises(ApiError, match="larger than"):
        client.status(server.api)


@pytest.mark.parametrize("framing", ["close", "chunked"])
def test_endless_body_is_cut_at_the_cap(client, raw_server, framing):
    # No Content-Length: the client only learns the size by reading, and must stop.
    def behave(server: RawServer, conn: socket.socket) -> None:
        if framing == "chunked":
            server.send(conn, b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            block = b"100000\r\n" + b" " * 0x100000 + b"\r\n"
        else:
            server.send(conn, b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n")
            block = b" " * (1 << 20)
        for _ in range(200):  # 200 MiB if nobody stopped reading
            if server.stop.is_set():
                return
            server.send(conn, block)

    server = raw_server(behave)
    with pytest.raises(ApiError, match="larger than"):
        client.status(server.api, timeout=30)
    # The cap plus what kernel socket buffers absorbed, nowhere near 200 MiB.
    assert server.sent < MAX_JSON_BYTES + (48 << 20), server.sent


def test_state_slice_longer_than_asked_is_refused(client, raw_server):
    server = raw_server(lambda s, conn: s.send(conn, b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + b"x" * 5000))
    with pytest.raises(ApiError, match="more than the 1000 bytes"):
        client.state_slice(server.api, MINER, 0, 1000)
    server = raw_server(lambda s, conn: s.send(conn, b"HTTP/1.1 200 OK\r\nContent-Length: 5000\r\n\r\n"))
    with pytest.raises(ApiError, match="more than the 1000 bytes"):
        client.state_slice(server.api, MINER, 0, 1000)


def test_metrics_garbage_is_bounded_and_decoded(client, raw_server):
    server = raw_server(reply(b"dtrain_up 1\n\xff\xfe\n"))
    assert client.metrics(server.api).startswith("dtrain_up 1\n")
    server = raw_server(reply(b"", headers=f"X-Pad: {'a' * 70_000}\r\n"))
    with pytest.raises(ApiError):
        client.metrics(server.api)


def test_unreachable_and_bad_addresses(client):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: connection refused
        with pytest.raises(ApiError, match="unreachable"):
            client.status(f"127.0.0.1:{port}", timeout=2)
    for api in ("127.0.0.1:notaport", "ftp://127.0.0.1:21", "127.0.0.1:80\r\nX: y"):
        with pytest.raises(ApiError):
            client.status(api, timeout=2)


# -- well-behaved miners still work --------------------------------------------------------------------


class _Good(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        if self.path.startswith("/v1/state-slice"):
            body, kind = bytes(range(256)) * 40, "application/octet-stream"
        elif self.path == "/v1/status":
            body, kind = json.dumps({"epoch": 3, "loss": 2.5, "samples": 8}).encode(), "application/json"
        else:
            body, kind = json.dumps({"error": "no such thing\x1b[31m"}).encode(), "application/json"
            self.send_response(404)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        # Chunked on purpose: the client must handle both framings.
        body = json.dumps({"joined": True, "epoch": request["epoch"] + 1, "round": None, "echo": request}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for piece in (body[:5], body[5:]):
            self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
        self.wfile.write(b"0\r\n\r\n")


@pytest.fixture
def good_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Good)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(5)


def test_normal_miner_still_works(client, good_server):
    status = client.status(good_server)
    assert (status.epoch, status.loss, status.samples, status.peer_id) == (3, 2.5, 8, None)
    assert client.status("http://" + good_server + "/").epoch == 3
    answer = client.allreduce(good_server, MINER, ROUND)
    assert answer.joined is True and answer.epoch == 8 and answer.round is None
    download = client.state_slice(good_server, MINER, 0, 10240, keep_data=True)
    assert download.bytes_received == 10240 and download.data == bytes(range(256)) * 40
    assert download.seconds >= download.first_byte_seconds >= 0
    with pytest.raises(ApiError) as info:
        client.metrics(good_server)
    # The miner's message arrives, minus the terminal escape it tried to smuggle into our logs.
    assert info.value.status == 404 and info.value.message.startswith("no such thing")
    assert "\x1b" not in info.value.message
