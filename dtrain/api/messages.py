"""The miner API's wire messages, each defined once, and a miner's own query limits.

Each message is a :class:`~dtrain.api.message_base.Message` whose fields carry
:mod:`dtrain.api.rules`; the served OpenAPI document (``dtrain.api.openapi``) and the field
tables of docs/protocol.md (``scripts/gen_protocol_docs.py``) are built from these types.
Only the standard library is used (the validator's client and ``dtrain status`` import this).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from dtrain.api.message_base import Message, wire
from dtrain.api.rules import (
    MAX_JSON_INT, AnyObject, Boolean, Integer, ListOf, MapOf, Nested, Number, PayloadError, Text,
)

API_VERSION = "1"

MAX_PAGES = 4096
MAX_MICRO_BATCH = 4096
MAX_SKETCH = 4096
MAX_MICROBATCHES = 65536
MAX_PEERS = 4096
MAX_WEIGHT = 1e12

# Shared spellings of recurring fields.
HEX_NONCE = Text(r"(0x)?[0-9a-fA-F]{1,128}", "a hex string of 1-128 digits", 130)
DIGEST = Text(r"[0-9a-f]{1,64}", "lower-case hex of 1-64 digits", 64)
PEER_ID = Text(r".{1,128}", "a peer id of 1-128 chars", 128)
ROUND_ID = Text(r"[A-Za-z0-9._:-]{1,128}", "1-128 chars of [A-Za-z0-9._:-]", 128)
EPOCH = Integer(0, MAX_JSON_INT)
# The secret-seed round audit (dtrain.swarm.averaging.audit; its MAX_AUDIT_PARTS, repeated here
# because this module imports only the standard library)
MAX_AUDIT_PARTS = 32768
MAX_AUDIT_BYTES = 8 << 20  # decoded bytes in one answer: within the client's 16 MiB JSON limit as base64


def base64_of(max_bytes: int) -> Text:
    """Standard base64 (with padding) of at most ``max_bytes`` bytes."""
    return Text(r"[A-Za-z0-9+/]*={0,2}", f"base64 of at most {max_bytes} bytes", 4 * ((max_bytes + 2) // 3))


@dataclass(frozen=True)
class TrainRequest(Message):
    """A Train challenge: train on the pages the nonce selects and report per micro-batch."""

    nonce: str = wire(HEX_NONCE, "Fresh per query. The challenge pages follow from it "
                      "(`assign_pages(..., nonce=nonce)`), and it seeds the gradient sketch.")
    epoch: int = wire(EPOCH, "Must equal the miner's epoch, else 409 (a miner behind it catches up).")
    pages: int = wire(Integer(1, MAX_PAGES), "Number of data pages to train on (a miner may accept fewer: 422).")
    micro_batch_size: int = wire(Integer(1, MAX_MICRO_BATCH),
                                 "Sequences per micro-batch; the miner splits the pages into micro-batches of this size.")
    params_digest: str | None = wire(DIGEST, "The validator's own parameter digest (see `/v1/status`).",
                                     optional=True)
    params_sketch: tuple | None = wire(
        ListOf(Number(), MAX_SKETCH), "The validator's parameter sketch (256 values; docs/scoring.md, \"Replica "
        "tolerance\"). A miner at the same epoch whose own sketch is farther than the replica tolerance "
        "resynchronises from its peers (within the query, at most once per epoch), then answers.", optional=True)


@dataclass(frozen=True)
class MicroBatchReport(Message):
    """One micro-batch of a Train answer, in order."""

    page: int = wire(Integer(0, MAX_JSON_INT), "The page this micro-batch's first sequence came from.")
    loss: float = wire(Number(), "Mean next-token loss of the micro-batch.")
    sketch: tuple = wire(ListOf(Number(), MAX_SKETCH),
                         "Gradient sketch: k random projections seeded by the nonce (docs/training.md).")
    samples: int = wire(Integer(1, MAX_MICRO_BATCH), "Sequences in the micro-batch.")
    nonce: str | None = wire(Text(r"(0x)?[0-9a-fA-F]{0,128}", "a hex string of at most 128 digits", 130),
                             "The query's nonce, echoed.", optional=True)


@dataclass(frozen=True)
class TrainResponse(Message):
    """A miner's answer to a Train challenge."""

    uid: int = wire(Integer(0, 65535), "The miner's uid.")
    epoch: int = wire(EPOCH, "The miner's epoch (it answered for this one).")
    samples_total: int = wire(Integer(0, MAX_JSON_INT), "Samples in the miner's local accumulation after this query.")
    params_digest: str = wire(DIGEST, "As in `/v1/status` (informational: replicas are compared with a tolerance, "
                              "docs/scoring.md).")
    microbatches: tuple = wire(ListOf(Nested(MicroBatchReport), MAX_MICROBATCHES), "One report per micro-batch, in order.")


@dataclass(frozen=True)
class AllReduceRequest(Message):
    """Ask a miner to join an averaging round."""

    round_id: str = wire(ROUND_ID, "The validator's name for the round (for logs).")
    epoch: int = wire(EPOCH, "The round is for this epoch; a miner at another epoch declines.")
    weight_cap: float = wire(Number(0.0, MAX_WEIGHT), "The largest averaging weight any peer's contribution is given.")
    deadline_s: float = wire(Number(0.0, 86400.0, open_lo=True),
                             "How long to look for a group, in seconds (a miner may accept less: 422).")
    weight_caps: dict | None = wire(
        MapOf(PEER_ID, Number(0.0, MAX_WEIGHT), MAX_PEERS, "peer ids to numbers in [0, 1e12]"),
        "Per-peer weight limit (what the validator verified). With it, an unlisted peer gets 0; "
        "without it every peer gets `weight_cap`.", optional=True)
    params_digest: str | None = wire(DIGEST, "The validator's parameter digest (informational; a lagging miner "
                                     "catches up to a peer's state at `epoch`).", optional=True)
    refused: tuple | None = wire(ListOf(PEER_ID, 64), "Peers that failed this validator's secret-seed round audit "
                                 "lately: the miner names them as refused reducers in its gather (they are "
                                 "benched when most of the group does).", optional=True)
    announcer: str | None = wire(PEER_ID, "The peer id of the validator that announces the round and signs its "
                                 "membership (allreduce.protocol = dtrain: the miner declares there); absent: "
                                 "hivemind's matchmaking forms the group.", optional=True)


@dataclass(frozen=True)
class AllReduceResponse(Message):
    """The miner's answer, sent when the round is over."""

    joined: bool = wire(Boolean(), "Whether the miner took part.")
    epoch: int = wire(EPOCH, "The miner's epoch after the round.")
    round: dict | None = wire(AnyObject("the miner's RoundRecord (docs/swarm.md), or null"),
                              "The miner's own record of the round.", nullable=True)
    reason: str | None = wire(Text(max_len=300), "Why the miner declined (when `joined` is false).", optional=True)


@dataclass(frozen=True)
class StateSliceRequest(Message):
    """A slice of the miner's float32 parameters, for the bandwidth check."""

    offset: int = wire(Integer(0, 2**62), "Byte offset into the parameters, taken modulo their size (into the "
                       "snapshot, not wrapped, when `snapshot` is given).")
    length: int = wire(Integer(1, 2**62), "Bytes to send (at most the miner's limit, default 64 MiB: 422).")
    epoch: int | None = wire(Integer(0, 2**62), "DiLoCo: the epoch of the snapshot asked for (with `snapshot`).",
                             optional=True)
    snapshot: int | None = wire(Integer(0, 2**62), "DiLoCo: the inner step after which the snapshot was taken; "
                                "the bytes are then of that committed snapshot (docs/protocol.md, \"DiLoCo\"), "
                                "404 when the miner does not hold it.", optional=True)

    def snapshot_key(self) -> tuple[int, int] | None:
        """(epoch, step) of the snapshot asked for, or None for the live parameters."""
        if self.snapshot is None:
            return None
        return (int(self.epoch or 0), int(self.snapshot))

    @classmethod
    def from_query(cls, query: Mapping[str, str]) -> "StateSliceRequest":
        """The GET form: the same fields as decimal query parameters."""
        data: dict[str, Any] = {}
        for spec in cls.specs():
            raw = query.get(spec.name)
            if raw is None:
                continue
            if not (raw.isascii() and raw.isdigit() and len(raw) <= 18):
                raise PayloadError(f"field {spec.name!r} must be a non-negative integer")
            data[spec.name] = int(raw)
        return cls.parse(data)


@dataclass(frozen=True)
class StatusResponse(Message):
    """A miner's public status (no secrets). Readers take it field by field: a bad field reads as unknown."""

    api_version: str | None = wire(Text(max_len=16), "API version, `\"1\"`.", optional=True)
    hotkey: str | None = wire(Text(max_len=64), "The miner's hotkey ss58.", optional=True)
    version: str | None = wire(Text(max_len=64), "dtrain's version.", optional=True)
    kind: str | None = wire(Text(max_len=32), "`miner`.", optional=True)
    uid: int | None = wire(Integer(0, 65535), "The miner's uid.", optional=True)
    epoch: int | None = wire(EPOCH, "Global epoch: rounds applied.", optional=True)
    inner_step: int | None = wire(Integer(0, MAX_JSON_INT), "Optimizer steps taken.", optional=True)
    samples: int | None = wire(Integer(0, MAX_JSON_INT), "Samples trained since start.", optional=True)
    samples_accumulated: int | None = wire(Integer(0, MAX_JSON_INT), "Samples waiting for the next round.",
                                           optional=True)
    model_fingerprint: str | None = wire(Text(max_len=128), "Hash of the architecture and parameter shapes.",
                                         optional=True)
    swarm_fingerprint: str | None = wire(
        Text(max_len=128), "Hash of the model fingerprint and every swarm-wide setting "
        "(docs/configuration.md); peers that differ are reported WRONG_MODEL.", optional=True)
    params_digest: str | None = wire(DIGEST, "First 16 hex digits of SHA-256 over the float32 parameters. "
                                     "Informational: honest replicas on other hardware differ in the last bits, so "
                                     "peers compare replicas with a tolerance (docs/scoring.md).", optional=True)
    peer_id: str | None = wire(PEER_ID, "The hivemind peer id.", optional=True)
    maddrs: tuple | None = wire(ListOf(Text(max_len=512), 64), "Multiaddrs the miner's DHT node listens on.",
                                optional=True)
    loss: float | None = wire(Number(), "Latest training loss (absent when nothing was trained yet).",
                              optional=True)
    state: str | None = wire(Text(max_len=256), "What the miner is doing, in words.", optional=True)


@dataclass(frozen=True)
class RoundAuditRequest(Message):
    """After a round: the sketches of what the miner sent in it, under a seed drawn after the round."""

    group: str = wire(ROUND_ID, "The round's id (the `round_id` of both records): hivemind's group id in hex, "
                      "or the announced round's id (allreduce.protocol = dtrain).")
    seed: str = wire(Text(r"[0-9a-f]{64}", "64 lower-case hex digits", 64),
                     "The validator's audit seed: 32 bytes drawn after the round ended.")
    part: int | None = wire(Integer(0, MAX_AUDIT_PARTS - 1), "With it: the wire bytes of this one part instead "
                            "of the sketches (a dispute).", optional=True)


@dataclass(frozen=True)
class RoundAuditResponse(Message):
    """What the miner sent in the round, under the audit's seed (or one part's bytes)."""

    parts: int = wire(Integer(1, MAX_AUDIT_PARTS), "How many parts the miner's contribution has.")
    sketches: str | None = wire(base64_of(MAX_AUDIT_BYTES), "Little-endian float32 [parts, 64]: each part's "
                                "sketch under the seed, as a receiver decodes it.", optional=True)
    wire: str | None = wire(base64_of(MAX_AUDIT_BYTES), "The part's wire bytes (with `part`).", optional=True)


@dataclass(frozen=True)
class ErrorResponse(Message):
    """Every error response."""

    error: str = wire(Text(max_len=4096), "What was wrong, naming the field or header.")
    status: int = wire(Integer(400, 599), "The HTTP status, repeated.")


MESSAGES: tuple[type[Message], ...] = (
    TrainRequest, MicroBatchReport, TrainResponse, AllReduceRequest, AllReduceResponse, StateSliceRequest,
    RoundAuditRequest, RoundAuditResponse, StatusResponse, ErrorResponse,
)


@dataclass(frozen=True)
class QueryLimits:
    """What one miner accepts beyond the protocol's own bounds (its policy, not the schema).

    A permitted validator is trusted to query, not to freeze the training thread for a day
    or exhaust memory; a request over a limit gets 422 naming the field and the limit.
    """

    max_pages: int = MAX_PAGES
    max_deadline_s: float = 86400.0
    max_slice_bytes: int = 64 << 20

    def check(self, request: Message) -> None:
        if isinstance(request, TrainRequest) and request.pages > self.max_pages:
            raise PayloadError(f"field 'pages' must be at most {self.max_pages} on this miner")
        if isinstance(request, AllReduceRequest) and request.deadline_s > self.max_deadline_s:
            raise PayloadError(f"field 'deadline_s' must be at most {self.max_deadline_s:g} on this miner")
        if isinstance(request, StateSliceRequest) and request.length > self.max_slice_bytes:
            raise PayloadError(f"field 'length' must be <= {self.max_slice_bytes}")


def message_types() -> dict[str, type[Message]]:
    return {m.__name__: m for m in MESSAGES}
