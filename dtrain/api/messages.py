"""The miner API's wire messages, each defined once.

A message is a frozen dataclass whose fields carry a :class:`Rule`. The same rules

- parse untrusted JSON (``Message.parse``): the first bad field is named in a
  :class:`PayloadError`, which the server answers with 422 and the validator's client
  turns into "malformed answer";
- write JSON (``Message.to_json``);
- describe the message in the served OpenAPI document (``Message.json_schema``) and in
  the field tables of docs/protocol.md (``scripts/gen_protocol_docs.py``),

so the three can no longer drift apart. Unknown fields are ignored: a newer validator
can talk to an older miner. Only the standard library is used (the validator's client
and ``dtrain status`` import this module).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, TypeVar

API_VERSION = "1"

MAX_JSON_INT = 2**53  # the largest integer every JSON implementation represents exactly
MAX_PAGES = 4096
MAX_MICRO_BATCH = 4096
MAX_SKETCH = 4096
MAX_MICROBATCHES = 65536
MAX_PEERS = 4096
MAX_WEIGHT = 1e12


class PayloadError(ValueError):
    """The JSON is well formed but does not match the message (HTTP 422). Names the field."""


# --------------------------------------------------------------------------- rules


class Rule:
    """What one field accepts. ``check`` returns the (normalised) value or raises PayloadError."""

    def check(self, value: Any, name: str) -> Any:
        raise NotImplementedError

    def schema(self) -> dict:
        raise NotImplementedError

    def describe(self) -> str:
        """Short human text for docs/protocol.md ("integer, 1–4096")."""
        raise NotImplementedError

    def dump(self, value: Any) -> Any:
        return value


def _fmt(x: float) -> str:
    """A bound as docs write it: 4096, 1e+12, 2^53."""
    if isinstance(x, int) and x >= 2**20 and x & (x - 1) == 0:
        return f"2^{x.bit_length() - 1}"
    if float(x).is_integer() and abs(x) < 1e6:
        return str(int(x))
    return f"{x:g}"


@dataclass(frozen=True)
class Integer(Rule):
    lo: int = 0
    hi: int = MAX_JSON_INT

    def check(self, value: Any, name: str) -> int:
        if type(value) is not int:  # bool is an int subclass: refused explicitly
            raise PayloadError(f"field {name!r} must be an integer")
        if not self.lo <= value <= self.hi:
            raise PayloadError(f"field {name!r} must be in {self.lo}..{self.hi}")
        return value

    def schema(self) -> dict:
        return {"type": "integer", "minimum": self.lo, "maximum": self.hi}

    def describe(self) -> str:
        return f"integer, {self.lo}–{_fmt(self.hi)}"


@dataclass(frozen=True)
class Number(Rule):
    lo: float = -math.inf
    hi: float = math.inf
    open_lo: bool = False

    def check(self, value: Any, name: str) -> float:
        try:
            # An int too large for a float (JSON allows 400 digits) is not a usable number either.
            finite = type(value) in (int, float) and math.isfinite(float(value))
        except OverflowError:
            finite = False
        if not finite:
            raise PayloadError(f"field {name!r} must be a finite number")
        if value < self.lo or value > self.hi or (self.open_lo and value == self.lo):
            raise PayloadError(f"field {name!r} must be in {self._range()}")
        return float(value)

    def _range(self) -> str:
        lo = "(" if self.open_lo else "["
        return f"{lo}{_fmt(self.lo)}, {_fmt(self.hi)}]"

    def schema(self) -> dict:
        out: dict[str, Any] = {"type": "number"}
        if math.isfinite(self.lo):
            out["exclusiveMinimum" if self.open_lo else "minimum"] = self.lo
        if math.isfinite(self.hi):
            out["maximum"] = self.hi
        return out

    def describe(self) -> str:
        if not math.isfinite(self.lo) and not math.isfinite(self.hi):
            return "number, finite"
        return f"number in {self._range()}"


@dataclass(frozen=True)
class Text(Rule):
    pattern: str = ""  # a full-match regular expression; "" accepts any string
    what: str = "a string"  # how an error message describes an acceptable value
    max_len: int = 1024

    def check(self, value: Any, name: str) -> str:
        if not isinstance(value, str) or len(value) > self.max_len or (
                self.pattern and not re.fullmatch(self.pattern, value)):
            raise PayloadError(f"field {name!r} must be {self.what}")
        return value

    def schema(self) -> dict:
        out: dict[str, Any] = {"type": "string", "maxLength": self.max_len}
        if self.pattern:
            out["pattern"] = f"^{self.pattern}$"
        return out

    def describe(self) -> str:
        return f"string, {self.what}" if self.what != "a string" else f"string, at most {self.max_len} chars"


@dataclass(frozen=True)
class Boolean(Rule):
    def check(self, value: Any, name: str) -> bool:
        if not isinstance(value, bool):
            raise PayloadError(f"field {name!r} must be true or false")
        return value

    def schema(self) -> dict:
        return {"type": "boolean"}

    def describe(self) -> str:
        return "boolean"


@dataclass(frozen=True)
class ListOf(Rule):
    item: Rule
    max_items: int

    def check(self, value: Any, name: str) -> tuple:
        if not isinstance(value, list) or len(value) > self.max_items:
            raise PayloadError(f"field {name!r} must be a list of at most {self.max_items} items")
        return tuple(self.item.check(v, f"{name}[{i}]") for i, v in enumerate(value))

    def schema(self) -> dict:
        return {"type": "array", "maxItems": self.max_items, "items": self.item.schema()}

    def describe(self) -> str:
        return f"list of at most {self.max_items}: {self.item.describe()}"

    def dump(self, value: Any) -> Any:
        return [self.item.dump(v) for v in value]


@dataclass(frozen=True)
class MapOf(Rule):
    key: Text
    value: Rule
    max_entries: int
    what: str  # e.g. "peer ids to numbers in [0, 1e12]"

    def check(self, value: Any, name: str) -> dict:
        if not isinstance(value, dict) or len(value) > self.max_entries:
            raise PayloadError(f"field {name!r} must be an object of at most {self.max_entries} entries")
        out = {}
        for k, v in value.items():
            try:
                out[self.key.check(k, name)] = self.value.check(v, name)
            except PayloadError:
                raise PayloadError(f"field {name!r} must map {self.what}") from None
        return out

    def schema(self) -> dict:
        return {"type": "object", "maxProperties": self.max_entries,
                "propertyNames": self.key.schema(), "additionalProperties": self.value.schema()}

    def describe(self) -> str:
        return f"object mapping {self.what}, at most {self.max_entries} entries"

    def dump(self, value: Any) -> Any:
        return dict(value)


@dataclass(frozen=True)
class Nested(Rule):
    message: type  # a Message subclass

    def check(self, value: Any, name: str) -> Any:
        return self.message.parse(value, where=name)

    def schema(self) -> dict:
        return {"$ref": f"#/components/schemas/{self.message.__name__}"}

    def describe(self) -> str:
        return f"`{self.message.__name__}` object"

    def dump(self, value: Any) -> Any:
        return value.to_json()


@dataclass(frozen=True)
class AnyObject(Rule):
    """A JSON object passed through as is (e.g. a round record, documented elsewhere)."""

    what: str = "object"

    def check(self, value: Any, name: str) -> dict:
        if not isinstance(value, dict):
            raise PayloadError(f"field {name!r} must be an object")
        return value

    def schema(self) -> dict:
        return {"type": "object", "description": self.what}

    def describe(self) -> str:
        return self.what


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


def wire(rule: Rule, doc: str, *, optional: bool = False, nullable: bool = False) -> Any:
    """A message field: its rule, its documentation, and whether it may be absent (None) or null."""
    meta = {"rule": rule, "doc": doc, "optional": optional, "nullable": nullable}
    if optional or nullable:
        return dataclasses.field(default=None, metadata=meta)
    return dataclasses.field(metadata=meta)


# --------------------------------------------------------------------------- messages

M = TypeVar("M", bound="Message")


@dataclass(frozen=True)
class FieldSpec:
    name: str
    rule: Rule
    doc: str
    optional: bool
    nullable: bool


@dataclass(frozen=True)
class Message:
    """Base of every wire message (see the module docstring)."""

    summary: ClassVar[str] = ""

    @classmethod
    def specs(cls) -> list[FieldSpec]:
        return [FieldSpec(f.name, f.metadata["rule"], f.metadata["doc"], f.metadata["optional"],
                          f.metadata["nullable"]) for f in dataclasses.fields(cls)]

    @classmethod
    def parse(cls: type[M], data: Any, *, where: str = "", lenient: bool = False) -> M:
        """Check untrusted JSON ``data`` against every field rule; PayloadError names the first bad one.

        ``lenient`` (for public, best-effort documents such as ``/v1/status``) turns a bad
        optional field into None instead of refusing the whole message.
        """
        label = f"{where}: " if where else ""
        if not isinstance(data, dict):
            raise PayloadError(f"{label}body must be a JSON object" if not where else
                               f"field {where!r} must be an object")
        values = {}
        for spec in cls.specs():
            name = f"{where}.{spec.name}" if where else spec.name
            if spec.name not in data:
                if spec.optional:
                    values[spec.name] = None
                    continue
                raise PayloadError(f"field {name!r} is required")
            raw = data[spec.name]
            if raw is None and spec.nullable:
                values[spec.name] = None
                continue
            try:
                values[spec.name] = spec.rule.check(raw, name)
            except PayloadError:
                if lenient and spec.optional:
                    values[spec.name] = None
                    continue
                raise
        return cls(**values)

    def to_json(self) -> dict:
        """The message as JSON data; absent optional fields are left out."""
        out = {}
        for spec in self.specs():
            value = getattr(self, spec.name)
            if value is None:
                if spec.optional:
                    continue
                out[spec.name] = None
                continue
            out[spec.name] = spec.rule.dump(value)
        return out

    @classmethod
    def json_schema(cls) -> dict:
        """JSON Schema (2020-12, as OpenAPI 3.1 uses) of the message."""
        props = {}
        for spec in cls.specs():
            schema = dict(spec.rule.schema())
            if spec.nullable:
                schema = {"anyOf": [schema, {"type": "null"}]}
            schema["description"] = spec.doc
            props[spec.name] = schema
        out: dict[str, Any] = {"type": "object", "properties": props,
                               "required": [s.name for s in cls.specs() if not s.optional]}
        if cls.__doc__:
            out["description"] = " ".join(cls.__doc__.split())
        return out


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

    group: str = wire(Text(r"[0-9a-f]{1,128}", "lower-case hex of 1-128 digits", 128),
                      "The round's group id (the `round_id` of both records).")
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
