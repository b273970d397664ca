"""The OpenAPI 3.1 document the miner serves at ``/v1/openapi.json``, built from the message types.

Every request and response body refers to ``components.schemas``, which holds exactly
``Message.json_schema()`` of each type in :mod:`dtrain.api.messages`: the document cannot
describe a field the code does not parse, or miss one it does.
"""

from __future__ import annotations

from dtrain.api.message_base import Message
from dtrain.api.messages import (
    API_VERSION, MESSAGES, AllReduceRequest, AllReduceResponse, ErrorResponse, RoundAuditRequest, RoundAuditResponse,
    StateSliceRequest, StatusResponse, TrainRequest, TrainResponse,
)

# The signed endpoints' error statuses, in pipeline order (docs/protocol.md, section 3).
SIGNED_ERRORS = {
    "400": "malformed JSON",
    "401": "unsigned, stale, forged, wrong receiver or replayed",
    "403": "valid signature, hotkey not allowed (no validator permit)",
    "409": "the query is for another epoch (Train)",
    "413": "body larger than the server limit",
    "415": "Content-Type is not application/json",
    "422": "JSON does not match the message, or exceeds this miner's limits",
    "503": "permit check unavailable (chain outage), handler busy, or shutting down",
}
AUTH_HEADERS = (
    ("X-Bittensor-Version", True),
    ("X-Bittensor-Hotkey", True),
    ("X-Bittensor-Receiver", True),
    ("X-Bittensor-Nonce", True),
    ("X-Bittensor-Signature", True),
    ("X-Bittensor-Crypto", False),
)


def ref(message: type[Message]) -> dict:
    return {"$ref": f"#/components/schemas/{message.__name__}"}


def _json(message: type[Message]) -> dict:
    return {"application/json": {"schema": ref(message)}}


def _errors() -> dict:
    return {code: {"description": text, "content": _json(ErrorResponse)} for code, text in SIGNED_ERRORS.items()}


def _auth_parameters() -> list[dict]:
    return [{"name": name, "in": "header", "required": required, "schema": {"type": "string"}}
            for name, required in AUTH_HEADERS]


def _signed_json(summary: str, request: type[Message], response: type[Message], max_body_bytes: int) -> dict:
    """A signed POST endpoint with a JSON body and a JSON answer."""
    return {"post": {
        "summary": summary, "security": [{"btauth": []}], "parameters": _auth_parameters(),
        "requestBody": {"required": True, "content": _json(request),
                        "description": f"at most {max_body_bytes} bytes"},
        "responses": {"200": {"description": "ok", "content": _json(response)}, **_errors()},
    }}


def _state_slice(max_slice_bytes: int) -> dict:
    """``/v1/state-slice``: the fields as query parameters (GET) or a JSON body (POST), raw bytes back."""
    auth = _auth_parameters()
    query = [
        {"name": spec.name, "in": "query", "required": True, "description": spec.doc,
         "schema": {"type": "integer", "minimum": spec.rule.lo,  # type: ignore[attr-defined]
                    "maximum": max_slice_bytes if spec.name == "length" else spec.rule.hi}}  # type: ignore[attr-defined]
        for spec in StateSliceRequest.specs()
    ]
    ok = {
        "200": {
            "description": "exactly `length` bytes of the float32 parameters from `offset`, wrapping around",
            "headers": {"X-Dtrain-Offset": {"schema": {"type": "integer"}}},
            "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
        },
        **_errors(),
    }
    return {
        "get": {"summary": "download a slice of model state (bandwidth check)",
                "security": [{"btauth": []}], "parameters": auth + query, "responses": ok},
        "post": {"summary": "same as GET, the fields in a JSON body",
                 "security": [{"btauth": []}], "parameters": auth,
                 "requestBody": {"required": True, "content": _json(StateSliceRequest)},
                 "responses": ok},
    }


def openapi_document(*, max_body_bytes: int, max_slice_bytes: int) -> dict:
    """OpenAPI 3.1 description of a miner API server with these limits."""
    return {
        "openapi": "3.1.0",
        "info": {"title": "dtrain miner API", "version": API_VERSION,
                 "description": "Validator-to-miner API of dtrain (subnet 38). Signed endpoints use btauth/1; "
                                "see docs/protocol.md."},
        "components": {
            "schemas": {m.__name__: m.json_schema() for m in MESSAGES},
            "securitySchemes": {
                "btauth": {"type": "apiKey", "in": "header", "name": "X-Bittensor-Signature",
                           "description": "bittensor.http_auth btauth/1: sr25519 hotkey signature over the request"},
            },
        },
        "paths": {
            "/v1/status": {"get": {"summary": "public miner status (no secrets)",
                                   "responses": {"200": {"description": "status object",
                                                         "content": _json(StatusResponse)}}}},
            "/v1/train": _signed_json("Train challenge", TrainRequest, TrainResponse, max_body_bytes),
            "/v1/allreduce": _signed_json("Join an all-reduce round", AllReduceRequest, AllReduceResponse,
                                          max_body_bytes),
            "/v1/round-audit": _signed_json("The secret-seed audit of the last round", RoundAuditRequest,
                                            RoundAuditResponse, max_body_bytes),
            "/v1/state-slice": _state_slice(max_slice_bytes),
            "/metrics": {"get": {"summary": "Prometheus metrics",
                                 "responses": {"200": {"description": "text exposition format",
                                                       "content": {"text/plain": {}}}}}},
            "/v1/openapi.json": {"get": {"summary": "this document",
                                         "responses": {"200": {"description": "OpenAPI 3.1"}}}},
        },
    }
