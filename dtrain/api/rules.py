"""Field rules of the API's wire messages: what one JSON value may be.

Each rule checks an untrusted value (raising :class:`PayloadError` naming the field), writes
its JSON Schema for the OpenAPI document, and describes itself for docs/protocol.md's field
tables. Standard library only (the validator's client and ``dtrain status`` use it).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

MAX_JSON_INT = 2**53  # the largest integer every JSON implementation represents exactly


class PayloadError(ValueError):
    """The JSON is well formed but does not match the message (HTTP 422). Names the field."""


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
