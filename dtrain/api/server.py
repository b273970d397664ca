"""The miner's HTTP API: aiohttp, btauth/1 signed requests, Prometheus metrics.

A signed request passes size cap (413), signature (401), permit (403), Content-Type and JSON
(415/400), its message type and this miner's limits (422), then the handler: in that order,
so unauthenticated input is never parsed beyond the size check (docs/protocol.md, section 3).
Handlers run in thread pools so a slow training call never blocks the event loop; status has
its own small pool so dashboards stay responsive while training occupies the other.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Optional

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from dtrain.api.message_base import Message
from dtrain.api.messages import (
    API_VERSION, AllReduceRequest, AllReduceResponse, QueryLimits, RoundAuditRequest, RoundAuditResponse,
    StateSliceRequest, StatusResponse, TrainRequest, TrainResponse,
)
from dtrain.api.openapi import openapi_document
from dtrain.api.rules import PayloadError
from dtrain.pools import full_thread_pool

log = logging.getLogger("dtrain.api")

DEFAULT_MAX_BODY = 1 << 20  # 1 MiB: challenges are tiny; anything larger is abuse
# Endpoint label values; unknown paths collapse to one label so a fuzzer or
# scanner cannot blow up metric cardinality.
_ENDPOINTS = {
    "/v1/status": "status",
    "/v1/train": "train",
    "/v1/allreduce": "allreduce",
    "/v1/state-slice": "state_slice",
    "/v1/round-audit": "round_audit",
    "/metrics": "metrics",
    "/v1/openapi.json": "openapi",
}


class HandlerError(Exception):
    """Raised by a handler to answer with a specific status, e.g. 409 or 503."""

    def __init__(self, status: int, message: str):
        if not 400 <= int(status) <= 599:
            raise ValueError("HandlerError status must be 4xx or 5xx")
        super().__init__(message)
        self.status = int(status)
        self.message = message


@dataclass
class Handlers:
    """Callables the neuron provides. All run in worker threads and get parsed, checked requests
    (and the caller's hotkey); ``status``' ``api_version`` and ``hotkey`` are filled in here."""

    status: Callable[[], StatusResponse]
    train: Callable[[TrainRequest, str], TrainResponse]
    allreduce: Callable[[AllReduceRequest, str], AllReduceResponse]
    state_slice: Callable[..., bytes]  # (offset, length, (epoch, snapshot step) or None for the live parameters)
    # the secret-seed audit of the miner's last round (None: 404, a neuron that keeps nothing)
    round_audit: Optional[Callable[[RoundAuditRequest, str], RoundAuditResponse]] = None


class _Reject(Exception):
    """Internal: stop the pipeline with an error response."""

    def __init__(self, status: int, message: str, auth_reason: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.auth_reason = auth_reason


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message, "status": status}, status=status)


class MinerApiServer:
    """One API server. Run it on its own thread (``start``/``stop``) or on an
    existing loop (``await start_async()`` / ``await stop_async()``).

    ``self_hotkey`` is the miner's hotkey ss58: requests must be signed *for*
    it (btauth/1 receiver binding). ``is_allowed(hotkey)`` decides who may call
    signed endpoints (validator permit); it runs in a worker thread and may
    query the chain; if it raises, the request gets 503. ``limits`` are this
    miner's own bounds beyond the protocol's (pages, deadline, slice size).
    """

    def __init__(
        self,
        handlers: Handlers,
        *,
        self_hotkey: str,
        is_allowed: Callable[[str], bool],
        host: str = "127.0.0.1",
        port: int = 0,
        max_body_bytes: int = DEFAULT_MAX_BODY,
        limits: QueryLimits = QueryLimits(),
        max_age: float = 10.0,
        allowed_skew: float = 2.0,
        handler_workers: int = 2,
        nonce_store: Any = None,
        registry: Optional[CollectorRegistry] = None,
    ):
        from bittensor import http_auth  # deferred: keeps `dtrain --help` light

        self._auth = http_auth
        self.handlers = handlers
        self.self_hotkey = self_hotkey
        self.is_allowed = is_allowed
        self.host = host
        self.port = int(port)
        self.max_body_bytes = int(max_body_bytes)
        self.limits = limits
        self.max_age = float(max_age)
        self.allowed_skew = float(allowed_skew)
        # Per-server replay cache, retained past the whole freshness window.
        self.nonce_store = nonce_store or http_auth.InMemoryNonceStore(
            retention=self.max_age + self.allowed_skew + 5.0
        )
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self._requests = Counter(
            "dtrain_api_requests", "API requests by endpoint and status",
            ["endpoint", "status"], registry=self.registry,
        )
        self._auth_failures = Counter(
            "dtrain_api_auth_failures", "Rejected signed requests by reason",
            ["reason"], registry=self.registry,
        )
        self._latency = Histogram(
            "dtrain_api_request_seconds", "Request handling time", ["endpoint"],
            registry=self.registry,
        )
        self._slice_bytes = Counter(
            "dtrain_api_state_slice_bytes", "Bytes served by /v1/state-slice",
            registry=self.registry,
        )
        self.handler_workers = max(1, int(handler_workers))
        self._heavy: Optional[concurrent.futures.ThreadPoolExecutor] = None  # started with the server
        self._light: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._openapi = json.dumps(
            openapi_document(max_body_bytes=self.max_body_bytes, max_slice_bytes=limits.max_slice_bytes)
        )
        self.app = self._build_app()
        self._runner: Optional[web.AppRunner] = None
        self._thread: Optional[threading.Thread] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None

    # -- app ----------------------------------------------------------------------

    def _build_app(self) -> web.Application:
        # client_max_size is a second line of defence; the pipeline checks too.
        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[self._middleware])
        app.router.add_get("/v1/status", self._status)
        app.router.add_post("/v1/train", self._signed_json("train", TrainRequest, TrainResponse))
        app.router.add_post("/v1/allreduce", self._signed_json("allreduce", AllReduceRequest, AllReduceResponse))
        app.router.add_post("/v1/round-audit", self._signed_json("round_audit", RoundAuditRequest,
                                                                 RoundAuditResponse))
        app.router.add_get("/v1/state-slice", self._state_slice)
        app.router.add_post("/v1/state-slice", self._state_slice)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/openapi.json", self._openapi_handler)
        return app

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        endpoint = _ENDPOINTS.get(request.path, "other")
        started = time.perf_counter()
        try:
            response = await handler(request)
        except _Reject as exc:
            if exc.auth_reason:
                self._auth_failures.labels(exc.auth_reason).inc()
            response = _error(exc.status, exc.message)
        except web.HTTPException as exc:
            # aiohttp's own 404/405/413: give them the same JSON shape.
            if exc.status >= 400:
                response = _error(exc.status, exc.reason or "error")
            else:
                raise
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("unhandled error serving %s %s", request.method, endpoint)
            response = _error(500, "internal error")
        self._requests.labels(endpoint, str(response.status)).inc()
        self._latency.labels(endpoint).observe(time.perf_counter() - started)
        return response

    # -- pipeline steps -------------------------------------------------------------

    async def _read_body(self, request: web.Request) -> bytes:
        declared = request.content_length
        if declared is not None and declared > self.max_body_bytes:
            raise _Reject(413, f"body larger than {self.max_body_bytes} bytes")
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise _Reject(413, f"body larger than {self.max_body_bytes} bytes") from None

    async def _authenticate(self, request: web.Request, body: bytes) -> str:
        try:
            caller = self._auth.verify(
                request.headers,
                body,
                method=request.method,
                # raw_path is the request target exactly as sent (path + query),
                # which is what btauth/1 signs.
                path=request.raw_path,
                self_hotkey_ss58=self.self_hotkey,
                max_age=self.max_age,
                allowed_skew=self.allowed_skew,
                nonce_store=self.nonce_store,
            )
        except self._auth.AuthError as exc:
            # AuthError messages never echo signatures/payloads: safe to return.
            raise _Reject(401, f"authentication failed: {exc}", type(exc).__name__) from None
        loop = asyncio.get_running_loop()
        try:
            allowed = await loop.run_in_executor(self._light, self.is_allowed, caller.hotkey_ss58)
        except Exception as exc:
            log.warning("permit check failed for %s: %s", caller.hotkey_ss58, exc)
            raise _Reject(503, "cannot check the caller's permit right now") from None
        if not allowed:
            raise _Reject(403, "hotkey is not allowed to call this miner", "forbidden")
        return caller.hotkey_ss58

    @staticmethod
    def _parse_json(request: web.Request, body: bytes) -> Any:
        if request.content_type != "application/json":
            raise _Reject(415, "Content-Type must be application/json")
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError:
            raise _Reject(400, "malformed JSON: body is not UTF-8") from None
        try:
            return json.loads(text, parse_constant=_reject_constant)
        except json.JSONDecodeError as exc:
            raise _Reject(400, f"malformed JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
        except (ValueError, RecursionError) as exc:
            raise _Reject(400, f"malformed JSON: {str(exc)[:200]}") from None

    async def _run(self, pool: concurrent.futures.Executor, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)
        except HandlerError as exc:
            raise _Reject(exc.status, exc.message) from None

    # -- endpoints ------------------------------------------------------------------

    async def _status(self, request: web.Request) -> web.Response:
        result = await self._run(self._light, self.handlers.status)
        if not isinstance(result, StatusResponse):
            raise TypeError("status handler must return a StatusResponse")
        result = dataclasses.replace(result, api_version=API_VERSION, hotkey=self.self_hotkey)
        return web.json_response(result.to_json())

    def _checked(self, parse: Callable[[], Message]) -> Any:
        """The request as its message type, within this miner's limits; else 422 naming the field."""
        try:
            message = parse()
            self.limits.check(message)
        except PayloadError as exc:
            raise _Reject(422, str(exc)) from None
        return message

    def _signed_json(self, name: str, request_type: type[Message], response_type: type[Message]):
        async def endpoint(request: web.Request) -> web.Response:
            raw = await self._read_body(request)
            caller = await self._authenticate(request, raw)
            payload = self._parse_json(request, raw)
            message = self._checked(lambda: request_type.parse(payload))
            handler = getattr(self.handlers, name)
            if handler is None:
                raise _Reject(404, f"this neuron does not serve {request.path}")
            result = await self._run(self._heavy, handler, message, caller)
            if not isinstance(result, response_type):
                raise TypeError(f"{name} handler must return a {response_type.__name__}")
            return web.json_response(result.to_json())

        return endpoint

    async def _state_slice(self, request: web.Request) -> web.Response:
        raw = await self._read_body(request)
        await self._authenticate(request, raw)
        if request.method == "POST":
            payload = self._parse_json(request, raw)
            wanted = self._checked(lambda: StateSliceRequest.parse(payload))
        else:
            wanted = self._checked(lambda: StateSliceRequest.from_query(request.query))
        data = await self._run(self._heavy, self.handlers.state_slice, wanted.offset, wanted.length,
                               wanted.snapshot_key())
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError("state_slice handler must return bytes")
        data = bytes(data)[:wanted.length]
        self._slice_bytes.inc(len(data))
        return web.Response(
            body=data,
            content_type="application/octet-stream",
            headers={"X-Dtrain-Offset": str(wanted.offset)},
        )

    async def _metrics(self, request: web.Request) -> web.Response:
        payload = generate_latest(self.registry)
        response = web.Response(body=payload)
        # CONTENT_TYPE_LATEST carries a charset parameter; set the raw header.
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response

    async def _openapi_handler(self, request: web.Request) -> web.Response:
        return web.Response(text=self._openapi, content_type="application/json")

    # -- lifecycle ------------------------------------------------------------------

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def start_async(self) -> None:
        """Start serving on the running loop; ``self.port`` is the bound port after."""
        # Full from the start, so the thread count stays flat over weeks (dtrain/pools.py).
        self._heavy = full_thread_pool(self.handler_workers, "dtrain-api-handler")
        self._light = full_thread_pool(2, "dtrain-api-light")
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False)
        try:
            await self._runner.setup()
            site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True)
            await site.start()
        except BaseException:  # e.g. the port is taken: leave no pool threads behind
            await self.stop_async()
            raise
        sockets = site._server.sockets if site._server else []  # type: ignore[union-attr]
        if sockets:
            self.port = int(sockets[0].getsockname()[1])
        log.info("miner API listening on %s", self.url)

    async def stop_async(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        for pool in (self._heavy, self._light):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        self._heavy = self._light = None

    def start(self, timeout: float = 30.0) -> "MinerApiServer":
        """Serve on a private thread; returns once listening (raises if bind fails)."""
        if self._thread is not None:
            raise RuntimeError("server already started")
        ready = threading.Event()
        failure: list[BaseException] = []
        loop = asyncio.new_event_loop()
        self._loop = loop

        def run() -> None:
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self.start_async())
            except BaseException as exc:  # surfaced to start()'s caller
                failure.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(self.stop_async())
                loop.close()

        self._thread = threading.Thread(target=run, name=f"dtrain-api-{self.port}", daemon=True)
        self._thread.start()
        if not ready.wait(timeout):
            raise TimeoutError("miner API did not start in time")
        if failure:
            self._thread.join()
            self._thread = None
            raise failure[0]
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop a server started with :meth:`start`; idempotent."""
        thread, loop = self._thread, self._loop
        if thread is None or loop is None:
            return
        if not loop.is_closed():
            loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout)
        self._thread = None

    def __enter__(self) -> "MinerApiServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")

