"""The base of every API wire message: a frozen dataclass of :func:`wire` fields.

One definition per message parses untrusted JSON (``Message.parse``), writes JSON
(``Message.to_json``) and describes the message for the OpenAPI document and docs/protocol.md
(``Message.json_schema``, ``Message.specs``), so the three cannot drift apart. Unknown fields
are ignored, so a newer validator can talk to an older miner.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from dtrain.api.rules import PayloadError, Rule


def wire(rule: Rule, doc: str, *, optional: bool = False, nullable: bool = False) -> Any:
    """A message field: its rule, its documentation, and whether it may be absent (None) or null."""
    meta = {"rule": rule, "doc": doc, "optional": optional, "nullable": nullable}
    if optional or nullable:
        return dataclasses.field(default=None, metadata=meta)
    return dataclasses.field(metadata=meta)


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

