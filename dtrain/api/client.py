"""Validator-side client for the miner API: btauth/1-signed, synchronous, with timeouts.

urllib (stdlib) keeps the client usable from any thread without an event
loop, and sends the request target byte-for-byte as signed.
"""

from __future__ import annotations

import hashlib
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any, Optional

_CHUNK = 1 << 16


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


class MinerClient:
    """Calls miners on behalf of a validator wallet (its hotkey signs)."""

    def __init__(self, wallet: Any, *, timeout: float = 30.0):
        from bittensor import http_auth  # deferred: heavy import

        self._auth = http_auth
        self.wallet = wallet
        self.timeout = float(timeout)

    # -- plumbing -------------------------------------------------------------------

    def _request(
        self,
        api: str,
        miner_hotkey: Optional[str],
        method: str,
        target: str,
        body: bytes = b"",
        *,
        timeout: Optional[float] = None,
        content_type: Optional[str] = None,
    ):
        url = base_url(api) + target
        headers = {"Accept": "application/json", "User-Agent": "dtrain-validator"}
        if content_type:
            headers["Content-Type"] = content_type
        if miner_hotkey is not None:
            # Fresh nonce per call (and per retry): the server rejects replays.
            headers.update(
                self._auth.sign(
                    self.wallet, method=method, path=target, body=body, receiver_ss58=miner_hotkey
                )
            )
        request = urllib.request.Request(url, data=body if method != "GET" else None, headers=headers, method=method)
        try:
            return urllib.request.urlopen(request, timeout=timeout or self.timeout), url
        except urllib.error.HTTPError as exc:
            message = exc.reason
            try:
                payload = json.loads(exc.read(64 << 10) or b"{}")
                if isinstance(payload, dict) and isinstance(payload.get("error"), str):
                    message = payload["error"]
            except (ValueError, OSError):
                pass
            finally:
                exc.close()
            raise ApiError(str(message), status=exc.code, url=url) from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ApiError(f"unreachable: {reason}", url=url) from None

    def _json_call(self, api: str, miner_hotkey: Optional[str], method: str, target: str,
                   payload: Optional[dict] = None, timeout: Optional[float] = None) -> dict:
        body = b"" if payload is None else json.dumps(payload, separators=(",", ":")).encode()
        response, url = self._request(
            api, miner_hotkey, method, target, body, timeout=timeout,
            content_type="application/json" if payload is not None else None,
        )
        with response:
            try:
                raw = response.read()
                result = json.loads(raw)
            except (ValueError, OSError) as exc:
                raise ApiError(f"invalid JSON response: {exc}", status=response.status, url=url) from None
        if not isinstance(result, dict):
            raise ApiError("response is not a JSON object", status=response.status, url=url)
        return result

    # -- endpoints ----------------------------------------------------------------------

    def status(self, api: str, *, timeout: Optional[float] = None) -> dict:
        """GET /v1/status (public, unsigned)."""
        return self._json_call(api, None, "GET", "/v1/status", timeout=timeout)

    def train(self, api: str, miner_hotkey: str, request: dict, *, timeout: Optional[float] = None) -> dict:
        """POST /v1/train with a signed challenge; returns the miner's JSON answer."""
        return self._json_call(api, miner_hotkey, "POST", "/v1/train", request, timeout)

    def allreduce(self, api: str, miner_hotkey: str, request: dict, *, timeout: Optional[float] = None) -> dict:
        """POST /v1/allreduce; returns ``{"joined": bool, "round": ...}``."""
        return self._json_call(api, miner_hotkey, "POST", "/v1/allreduce", request, timeout)

    def metrics(self, api: str, *, timeout: Optional[float] = None) -> str:
        response, _ = self._request(api, None, "GET", "/metrics", timeout=timeout)
        with response:
            return response.read().decode("utf-8", "replace")

    def state_slice(
        self,
        api: str,
        miner_hotkey: str,
        offset: int,
        length: int,
        *,
        timeout: Optional[float] = None,
        keep_data: bool = False,
    ) -> SliceDownload:
        """Signed GET /v1/state-slice, timed from send to last byte."""
        target = "/v1/state-slice?" + urllib.parse.urlencode({"offset": int(offset), "length": int(length)})
        digest = hashlib.sha256()
        kept = bytearray() if keep_data else None
        received = 0
        started = time.perf_counter()
        response, url = self._request(api, miner_hotkey, "GET", target, timeout=timeout)
        first_byte = time.perf_counter() - started
        with response:
            try:
                while True:
                    chunk = response.read(_CHUNK)
                    if not chunk:
                        break
                    received += len(chunk)
                    if received > length:
                        raise ApiError(f"miner sent more than the {length} bytes asked for", status=response.status, url=url)
                    digest.update(chunk)
                    if kept is not None:
                        kept += chunk
            except OSError as exc:
                raise ApiError(f"download interrupted after {received} bytes: {exc}", status=response.status, url=url) from None
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
