"""Validator-side client for the miner API: btauth/1-signed, synchronous, with timeouts.

Miners are untrusted: every call runs under one total deadline with capped bodies and strict
JSON, and fails only with ApiError (docs/protocol.md, "Calling a miner"). It uses http.client
directly, so the socket carries the deadline, the request target goes out byte-for-byte as
signed, and no redirects or environment proxies apply; it needs no event loop.
"""

from __future__ import annotations

import hashlib
import http.client
import io
import json
import socket
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any, Optional, TypeVar

from dtrain.api.message_base import Message
from dtrain.api.messages import (
    AllReduceRequest, AllReduceResponse, RoundAuditRequest, RoundAuditResponse, StatusResponse, TrainRequest,
    TrainResponse,
)
from dtrain.api.rules import PayloadError

M = TypeVar("M", bound=Message)

_CHUNK = 1 << 16
MAX_JSON_BYTES = 16 << 20  # generous for any status/train/allreduce answer
MAX_ERROR_BYTES = 64 << 10  # an error body only has to carry a message
MAX_METRICS_BYTES = 16 << 20
_MAX_MESSAGE_CHARS = 300  # miner-chosen text that ends up in our logs


class ApiError(Exception):
    """A miner call failed. ``status`` is the HTTP status, or None when the
    miner could not be reached or answered garbage."""

    def __init__(self, message: str, *, status: Optional[int] = None, url: str = ""):
        super().__init__(f"{url}: {message}" if url else message)
        self.status = status
        self.message = message
        self.url = url


@dataclass(frozen=True)
class SliceDownload:
    """One measured state-slice download (the bandwidth score's raw input)."""

    offset: int
    requested: int
    bytes_received: int
    seconds: float  # request sent → last byte received
    first_byte_seconds: float  # request sent → response headers (≈ latency)
    sha256: str  # of the received bytes, so callers can check content
    data: Optional[bytes] = None  # only when keep_data=True

    @property
    def bytes_per_second(self) -> float:
        return self.bytes_received / self.seconds if self.seconds > 0 else 0.0


def base_url(api: str) -> str:
    """``"host:port"`` (a commitment's ``api``) or a full http(s) URL → base URL."""
    if api.startswith(("http://", "https://")):
        return api.rstrip("/")
    return f"http://{api}"


# -- deadline plumbing ------------------------------------------------------------------


class _DeadlineExceeded(TimeoutError):
    """The call's total deadline passed (a TimeoutError, so OSError handlers see it)."""


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise _DeadlineExceeded("deadline exceeded")
    return left


class _DeadlineRaw(io.RawIOBase):
    """Raw reader over a socket that re-arms the socket timeout to the time left
    before *every* recv: http.client's header parsing and body reads all go
    through here, so no sequence of slow reads can outlive the deadline."""

    def __init__(self, sock: socket.socket, deadline: float):
        super().__init__()
        self._sock = sock
        self._deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        self._sock.settimeout(_remaining(self._deadline))
        return self._sock.recv_into(buffer)


class _DeadlineSocket:
    """Proxy for the connected socket that http.client sees after connect()."""

    def __init__(self, sock: socket.socket, deadline: float):
        self._sock = sock
        self._deadline = deadline

    def makefile(self, mode: str = "r", *args: Any, **kwargs: Any):
        if "b" not in mode or "w" in mode:  # http.client only reads responses via makefile("rb")
            raise ValueError(f"unsupported makefile mode {mode!r}")
        return io.BufferedReader(_DeadlineRaw(self._sock, self._deadline))

    def sendall(self, data: Any, *args: Any) -> None:
        # sendall's timeout is total for the whole buffer (Python >= 3.5).
        self._sock.settimeout(_remaining(self._deadline))
        self._sock.sendall(data, *args)

    def close(self) -> None:
        # http.client closes its socket as soon as it has the headers of a
        # "Connection: close" response, relying on makefile()'s reference count to
        # keep the fd open for the body. Our reader holds no such reference, so the
        # real socket is closed by MinerClient._call when the whole call is over.
        pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


def _connection_class(base: type) -> type:
    class _Conn(base):  # type: ignore[misc, valid-type]
        deadline = 0.0
        real_sock: Optional[socket.socket] = None

        def connect(self) -> None:
            self.timeout = _remaining(self.deadline)  # bounds the TCP (and TLS) handshake
            super().connect()
            self.real_sock = self.sock
            # Wrapped after the handshake: TLS needs the real socket to wrap.
            self.sock = _DeadlineSocket(self.sock, self.deadline)

    return _Conn


_HTTPConnection = _connection_class(http.client.HTTPConnection)
_HTTPSConnection = _connection_class(http.client.HTTPSConnection)


def _clean(text: Any) -> str:
    """Miner-supplied text made safe to log: printable, one line, bounded."""
    text = str(text)[:_MAX_MESSAGE_CHARS]
    return "".join(ch if ch.isprintable() else "?" for ch in text)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name} is not JSON")


def _loads_strict(raw: bytes) -> Any:
    """json.loads that refuses NaN/Infinity (Python's json accepts them by default);
    raises ValueError, RecursionError or UnicodeDecodeError on bad input."""
    return json.loads(raw, parse_constant=_reject_constant)


# Everything a hostile or broken peer can make the stdlib raise while we talk to it.
# RecursionError: deeply nested JSON; ValueError covers UnicodeDecodeError and
# http.client.InvalidURL is an HTTPException; OSError covers socket timeouts.
_PEER_ERRORS = (http.client.HTTPException, OSError, ValueError, RecursionError)


def _peer_failure(exc: BaseException, url: str, *, responded: bool, timeout: float) -> ApiError:
    """One of ``_PEER_ERRORS`` as the ApiError a caller sees; the first matching case wins."""
    if isinstance(exc, _DeadlineExceeded):
        return ApiError(f"timed out after {timeout:g}s", url=url)
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return ApiError(f"timed out: {_clean(exc) or 'no data'}", url=url)
    if isinstance(exc, http.client.HTTPException):
        # BadStatusLine, LineTooLong, IncompleteRead, RemoteDisconnected, InvalidURL...
        return ApiError(f"bad HTTP from miner: {type(exc).__name__}: {_clean(exc)}", url=url)
    if isinstance(exc, OSError):
        what = "connection lost mid-response" if responded else "unreachable"
        return ApiError(f"{what}: {_clean(exc)}", url=url)
    if isinstance(exc, RecursionError):
        return ApiError("response nested too deeply", url=url)
    return ApiError(f"invalid response: {_clean(exc)}", url=url)  # ValueError, UnicodeDecodeError included


class MinerClient:
    """Calls miners on behalf of a validator wallet (its hotkey signs)."""

    def __init__(self, wallet: Any, *, timeout: float = 30.0):
        self.wallet = wallet  # may be None for the unsigned calls (status, metrics)
        self.timeout = float(timeout)

    @property
    def _auth(self) -> Any:
        # Deferred to the first signed call: bittensor is a heavy import, and
        # `dtrain status` probes miners' public /v1/status without it.
        from bittensor import http_auth

        return http_auth

    # -- plumbing -------------------------------------------------------------------

    def _call(
        self,
        api: str,
        miner_hotkey: Optional[str],
        method: str,
        target: str,
        body: bytes = b"",
        *,
        timeout: Optional[float],
        read: Any,
        content_type: Optional[str] = None,
    ) -> Any:
        """Send one request and hand the 2xx response to ``read(response, url, deadline)``.

        The whole exchange, ``read`` included, runs under one deadline and inside one
        error boundary, so whatever the miner does surfaces as ApiError."""
        url = base_url(api) + target
        deadline = time.monotonic() + (timeout or self.timeout)
        conn = None
        responded = False  # past the response headers: failures are mid-response, not "unreachable"
        try:
            parts = urllib.parse.urlsplit(base_url(api))
            if parts.scheme not in ("http", "https"):
                raise ApiError(f"unsupported scheme {parts.scheme!r}", url=url)
            path = parts.path + target
            headers = self._headers(miner_hotkey, method, target, body, content_type)
            conn = (_HTTPSConnection if parts.scheme == "https" else _HTTPConnection)(parts.netloc)
            conn.deadline = deadline
            conn.request(method, path, body=body if method != "GET" else None, headers=headers)
            response = conn.getresponse()
            responded = True
            if not 200 <= response.status < 300:
                raise ApiError(self._error_message(response, deadline), status=response.status, url=url)
            return read(response, url, deadline)
        except _PEER_ERRORS as exc:
            raise _peer_failure(exc, url, responded=responded, timeout=timeout or self.timeout) from None
        finally:
            if conn is not None:
                conn.close()
                if conn.real_sock is not None:
                    conn.real_sock.close()

    def _headers(self, miner_hotkey: Optional[str], method: str, target: str, body: bytes,
                 content_type: Optional[str]) -> dict[str, str]:
        headers = {"Accept": "application/json", "User-Agent": "dtrain-validator", "Connection": "close"}
        if content_type:
            headers["Content-Type"] = content_type
        if miner_hotkey is not None:
            # Fresh nonce per call: the server rejects replays.
            headers.update(
                self._auth.sign(
                    self.wallet, method=method, path=target, body=body, receiver_ss58=miner_hotkey
                )
            )
        return headers

    @staticmethod
    def _error_message(response: http.client.HTTPResponse, deadline: float) -> str:
        """The miner's ``{"error": "..."}`` if it sent one in time, else the reason phrase."""
        message = response.reason
        try:
            raw = _read_body(response, "", deadline, MAX_ERROR_BYTES)
            payload = _loads_strict(raw or b"{}")
            if isinstance(payload, dict) and isinstance(payload.get("error"), str):
                message = payload["error"]
        except (ApiError,) + _PEER_ERRORS:
            pass  # the status code is the answer; a garbled error body is not worth more
        return _clean(message) or f"HTTP {response.status}"

    def _json_call(self, api: str, miner_hotkey: Optional[str], method: str, target: str,
                   payload: Optional[dict] = None, timeout: Optional[float] = None) -> dict:
        body = b"" if payload is None else json.dumps(payload, separators=(",", ":")).encode()

        def read(response: http.client.HTTPResponse, url: str, deadline: float) -> dict:
            raw = _read_body(response, url, deadline, MAX_JSON_BYTES)
            try:
                result = _loads_strict(raw)
            except RecursionError:
                raise ApiError("invalid JSON response: nested too deeply", status=response.status, url=url) from None
            except ValueError as exc:
                raise ApiError(f"invalid JSON response: {_clean(exc)}", status=response.status, url=url) from None
            if not isinstance(result, dict):
                raise ApiError("response is not a JSON object", status=response.status, url=url)
            return result

        return self._call(api, miner_hotkey, method, target, body, timeout=timeout, read=read,
                          content_type="application/json" if payload is not None else None)

    def _typed(self, answer: dict, message: type[M], api: str, *, lenient: bool = False) -> M:
        try:
            return message.parse(answer, lenient=lenient)
        except PayloadError as exc:
            raise ApiError(f"malformed {message.__name__}: {_clean(exc)}", url=base_url(api)) from None

    # -- endpoints ----------------------------------------------------------------------

    def status(self, api: str, *, timeout: Optional[float] = None) -> StatusResponse:
        """GET /v1/status (public, unsigned); a field that breaks its rule reads as None."""
        return self._typed(self._json_call(api, None, "GET", "/v1/status", timeout=timeout), StatusResponse, api,
                           lenient=True)

    def train(self, api: str, miner_hotkey: str, request: TrainRequest, *,
              timeout: Optional[float] = None) -> TrainResponse:
        """POST /v1/train with a signed challenge; the miner's answer, parsed."""
        answer = self._json_call(api, miner_hotkey, "POST", "/v1/train", request.to_json(), timeout)
        return self._typed(answer, TrainResponse, api)

    def allreduce(self, api: str, miner_hotkey: str, request: AllReduceRequest, *,
                  timeout: Optional[float] = None) -> AllReduceResponse:
        """POST /v1/allreduce; the miner's answer when its round is over, parsed."""
        answer = self._json_call(api, miner_hotkey, "POST", "/v1/allreduce", request.to_json(), timeout)
        return self._typed(answer, AllReduceResponse, api)

    def round_audit(self, api: str, miner_hotkey: str, request: RoundAuditRequest, *,
                    timeout: Optional[float] = None) -> RoundAuditResponse:
        """POST /v1/round-audit: the miner's sketches of its last round's parts under our seed
        (or, with ``request.part``, that part's wire bytes), parsed."""
        answer = self._json_call(api, miner_hotkey, "POST", "/v1/round-audit", request.to_json(), timeout)
        return self._typed(answer, RoundAuditResponse, api)

    def metrics(self, api: str, *, timeout: Optional[float] = None) -> str:
        def read(response: http.client.HTTPResponse, url: str, deadline: float) -> str:
            return _read_body(response, url, deadline, MAX_METRICS_BYTES).decode("utf-8", "replace")

        return self._call(api, None, "GET", "/metrics", timeout=timeout, read=read)

    def state_slice(
        self,
        api: str,
        miner_hotkey: str,
        offset: int,
        length: int,
        *,
        timeout: Optional[float] = None,
        keep_data: bool = False,
        snapshot: Optional[tuple[int, int]] = None,
    ) -> SliceDownload:
        """Signed GET /v1/state-slice, timed from send to last byte. With ``snapshot`` =
        (epoch, step) the bytes are of that committed DiLoCo snapshot instead of the live parameters."""
        query = {"offset": int(offset), "length": int(length)}
        if snapshot is not None:
            query.update(epoch=int(snapshot[0]), snapshot=int(snapshot[1]))
        target = "/v1/state-slice?" + urllib.parse.urlencode(query)
        digest = hashlib.sha256()
        kept = bytearray() if keep_data else None
        started = time.perf_counter()
        first_byte = 0.0

        def read(response: http.client.HTTPResponse, url: str, deadline: float) -> int:
            nonlocal first_byte
            first_byte = time.perf_counter() - started

            def consume(chunk: bytes) -> None:
                digest.update(chunk)
                if kept is not None:
                    kept.extend(chunk)

            # The cap is exactly what was asked for: a slice is never longer.
            return _read_body(response, url, deadline, max(0, int(length)), consume=consume,
                              too_big=f"miner sent more than the {int(length)} bytes asked for")

        received = self._call(api, miner_hotkey, "GET", target, timeout=timeout, read=read)
        seconds = time.perf_counter() - started
        return SliceDownload(
            offset=int(offset),
            requested=int(length),
            bytes_received=received,
            seconds=seconds,
            first_byte_seconds=first_byte,
            sha256=digest.hexdigest(),
            data=bytes(kept) if kept is not None else None,
        )


def _read_body(response: http.client.HTTPResponse, url: str, deadline: float, limit: int, *,
               consume: Any = None, too_big: str = "") -> Any:
    """Read the body in chunks, never more than ``limit + 1`` bytes, checking the
    deadline between reads. Returns the bytes, or with ``consume`` the count
    (each chunk goes to ``consume`` instead of being kept)."""
    too_big = too_big or f"response larger than {limit} bytes"
    if response.length is not None and response.length > limit:
        # Content-Length already says it is too big: don't read any of it.
        raise ApiError(f"{too_big} (Content-Length {response.length})", status=response.status, url=url)
    parts: list[bytes] = []
    received = 0
    while True:
        _remaining(deadline)
        chunk = response.read(min(_CHUNK, limit + 1 - received))
        if not chunk:
            break
        received += len(chunk)
        if received > limit:
            raise ApiError(too_big, status=response.status, url=url)
        if consume is not None:
            consume(chunk)
        else:
            parts.append(chunk)
    if response.length:
        # http.client returns b"" at an early EOF instead of raising: the length it
        # still expects is what the miner promised in Content-Length but never sent.
        raise ApiError(f"body truncated: got {received} of {received + response.length} bytes",
                       status=response.status, url=url)
    return received if consume is not None else b"".join(parts)
