"""Request payload checks and the OpenAPI document for the miner API.

Validation is deliberately shallow and explicit: it guarantees the handler
gets the documented field types and sane ranges, and names the first bad field
in a 422. Unknown extra fields are allowed so a newer validator can talk to an
older miner; handlers simply ignore what they don't know.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable

API_VERSION = "1"
_HEX_RE = re.compile(r"(0x)?[0-9a-fA-F]{1,128}")
_ROUND_ID_RE = re.compile(r"[A-Za-z0-9._:-]{1,128}")

MAX_PAGES = 4096
MAX_MICRO_BATCH = 4096


class PayloadError(ValueError):
    """The JSON body is well-formed but does not match the schema (HTTP 422)."""


def _int(body: dict, key: str, lo: int, hi: int) -> None:
    value = body.get(key)
    if type(value) is not int:  # bool is an int subclass; reject it explicitly
        raise PayloadError(f"field {key!r} must be an integer")
    if not lo <= value <= hi:
        raise PayloadError(f"field {key!r} must be in {lo}..{hi}")


def _num(body: dict, key: str, lo: float, hi: float, *, open_lo: bool = False) -> None:
    value = body.get(key)
    if type(value) not in (int, float) or not math.isfinite(value):
        raise PayloadError(f"field {key!r} must be a finite number")
    if value < lo or value > hi or (open_lo and value == lo):
        raise PayloadError(f"field {key!r} must be in {'(' if open_lo else '['}{lo:g}, {hi:g}]")


def _str(body: dict, key: str, pattern: re.Pattern, what: str) -> None:
    value = body.get(key)
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise PayloadError(f"field {key!r} must be {what}")


def validate_train(body: Any) -> None:
    if not isinstance(body, dict):
        raise PayloadError("body must be a JSON object")
    _str(body, "nonce", _HEX_RE, "a hex string of 1-128 digits")
    _int(body, "epoch", 0, 2**53)
    _int(body, "pages", 1, MAX_PAGES)
    _int(body, "micro_batch_size", 1, MAX_MICRO_BATCH)


def validate_allreduce(body: Any) -> None:
    if not isinstance(body, dict):
        raise PayloadError("body must be a JSON object")
    _str(body, "round_id", _ROUND_ID_RE, "1-128 chars of [A-Za-z0-9._:-]")
    _int(body, "epoch", 0, 2**53)
    _num(body, "weight_cap", 0.0, 1e12)
    _num(body, "deadline_s", 0.0, 86400.0, open_lo=True)


VALIDATORS: dict[str, Callable[[Any], None]] = {
    "train": validate_train,
    "allreduce": validate_allreduce,
}

_ERROR = {
    "type": "object",
    "required": ["error", "status"],
    "properties": {"error": {"type": "string"}, "status": {"type": "integer"}},
}
_AUTH_PARAMS = [
    {"name": name, "in": "header", "required": required, "schema": {"type": "string"}}
    for name, required in (
        ("X-Bittensor-Version", True),
        ("X-Bittensor-Hotkey", True),
        ("X-Bittensor-Receiver", True),
        ("X-Bittensor-Nonce", True),
        ("X-Bittensor-Signature", True),
        ("X-Bittensor-Crypto", False),
    )
]
_SIGNED_ERRORS = {
    "400": {"description": "malformed JSON", "content": {"application/json": {"schema": _ERROR}}},
    "401": {"description": "unsigned, stale, forged, wrong receiver or replayed", "content": {"application/json": {"schema": _ERROR}}},
    "403": {"description": "valid signature, hotkey not allowed (no validator permit)", "content": {"application/json": {"schema": _ERROR}}},
    "413": {"description": "body larger than the server limit", "content": {"application/json": {"schema": _ERROR}}},
    "415": {"description": "Content-Type is not application/json", "content": {"application/json": {"schema": _ERROR}}},
    "422": {"description": "JSON does not match the schema", "content": {"application/json": {"schema": _ERROR}}},
    "503": {"description": "permit check unavailable (chain outage) or handler busy", "content": {"application/json": {"schema": _ERROR}}},
}

TRAIN_REQUEST = {
    "type": "object",
    "required": ["nonce", "epoch", "pages", "micro_batch_size"],
    "properties": {
        "nonce": {"type": "string", "pattern": "^(0x)?[0-9a-fA-F]{1,128}$"},
        "epoch": {"type": "integer", "minimum": 0},
        "pages": {"type": "integer", "minimum": 1, "maximum": MAX_PAGES},
        "micro_batch_size": {"type": "integer", "minimum": 1, "maximum": MAX_MICRO_BATCH},
    },
}
TRAIN_RESPONSE = {
    "type": "object",
    "properties": {
        "uid": {"type": "integer"},
        "epoch": {"type": "integer"},
        "samples_total": {"type": "integer"},
        "microbatches": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "page": {"type": "integer"},
                    "loss": {"type": "number"},
                    "fingerprint": {"type": "array", "items": {"type": "number"}},
                },
            },
        },
    },
}
ALLREDUCE_REQUEST = {
    "type": "object",
    "required": ["round_id", "epoch", "weight_cap", "deadline_s"],
    "properties": {
        "round_id": {"type": "string", "pattern": "^[A-Za-z0-9._:-]{1,128}$"},
        "epoch": {"type": "integer", "minimum": 0},
        "weight_cap": {"type": "number", "minimum": 0},
        "deadline_s": {"type": "number", "exclusiveMinimum": 0, "maximum": 86400},
    },
}
ALLREDUCE_RESPONSE = {
    "type": "object",
    "properties": {
        "joined": {"type": "boolean"},
        "round": {"type": ["object", "null"], "description": "RoundRecord dict, or null"},
    },
}


def openapi_document(*, max_body_bytes: int, max_slice_bytes: int) -> dict:
    """OpenAPI 3.1 description of this server (served at /v1/openapi.json)."""

    def signed_json(summary: str, request: dict, response: dict) -> dict:
        return {
            "post": {
                "summary": summary,
                "security": [{"btauth": []}],
                "parameters": _AUTH_PARAMS,
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": request}},
                    "description": f"at most {max_body_bytes} bytes",
                },
                "responses": {
                    "200": {"description": "ok", "content": {"application/json": {"schema": response}}},
                    **_SIGNED_ERRORS,
                },
            }
        }

    slice_params = [
        {"name": "offset", "in": "query", "required": True, "schema": {"type": "integer", "minimum": 0}},
        {"name": "length", "in": "query", "required": True,
         "schema": {"type": "integer", "minimum": 1, "maximum": max_slice_bytes}},
    ]
    slice_ok = {
        "200": {
            "description": "raw bytes of the flattened model state from offset (may be shorter at the end)",
            "headers": {"X-Dtrain-Offset": {"schema": {"type": "integer"}}},
            "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
        },
        **_SIGNED_ERRORS,
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "dtrain miner API", "version": API_VERSION,
                 "description": "Validator-to-miner API of dtrain (subnet 38). Signed endpoints use btauth/1; see docs/protocol.md."},
        "components": {
            "securitySchemes": {
                "btauth": {"type": "apiKey", "in": "header", "name": "X-Bittensor-Signature",
                           "description": "bittensor.http_auth btauth/1: sr25519 hotkey signature over the request"}
            }
        },
        "paths": {
            "/v1/status": {"get": {"summary": "public miner status (no secrets)",
                                    "responses": {"200": {"description": "status object",
                                                          "content": {"application/json": {"schema": {"type": "object"}}}}}}},
            "/v1/train": signed_json("Train challenge", TRAIN_REQUEST, TRAIN_RESPONSE),
            "/v1/allreduce": signed_json("Join an all-reduce round", ALLREDUCE_REQUEST, ALLREDUCE_RESPONSE),
            "/v1/state-slice": {
                "get": {"summary": "download a slice of model state (bandwidth check)",
                        "security": [{"btauth": []}], "parameters": _AUTH_PARAMS + slice_params,
                        "responses": slice_ok},
                "post": {"summary": "same as GET, parameters in a JSON body {offset, length}",
                         "security": [{"btauth": []}], "parameters": _AUTH_PARAMS,
                         "requestBody": {"required": True, "content": {"application/json": {"schema": {
                             "type": "object", "required": ["offset", "length"],
                             "properties": {"offset": {"type": "integer", "minimum": 0},
                                            "length": {"type": "integer", "minimum": 1, "maximum": max_slice_bytes}}}}}},
                        "responses": slice_ok},
            },
            "/metrics": {"get": {"summary": "Prometheus metrics",
                                  "responses": {"200": {"description": "text exposition format",
                                                        "content": {"text/plain": {}}}}}},
            "/v1/openapi.json": {"get": {"summary": "this document",
                                          "responses": {"200": {"description": "OpenAPI 3.1"}}}},
        },
    }
