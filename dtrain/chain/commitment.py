"""The miner's on-chain commitment: a small JSON document parsed strictly as data.

A commitment is bytes that must decode to one JSON object with exactly the known
fields, each checked for type, length and character set. Nothing in it is ever
executed, imported or used as a format string. Readers log and skip anything malformed.
"""

from __future__ import annotations

import ipaddress
import json
import re
from dataclasses import dataclass
from typing import Any, Union

VERSION = 1
# Upper bound on what we are willing to parse; a chain field is far smaller,
# so anything bigger is hostile or broken.
MAX_COMMITMENT_BYTES = 1024
# What subtensor can hold, and so the most a writer may publish: the Commitments pallet
# stores ``CommitmentInfo { fields: BoundedVec<Data, MaxFields> }`` with
# ``Data::Raw0..Raw128`` (at most 128 bytes per field) and the runtime's
# ``MaxCommitFieldsInner = 3`` (pallet constant ``Commitments.MaxFields``); more fields
# fail on chain with ``TooManyFieldsInCommitmentInfo``. A typical record is ~130 bytes.
RAW_FIELD_BYTES = 128
MAX_FIELDS = 3
MAX_ONCHAIN_BYTES = RAW_FIELD_BYTES * MAX_FIELDS
# libp2p peer ids are base58btc (no 0, O, I, l); "12D3KooW..." is 52 chars,
# "Qm..." 46. Bound loosely but keep the alphabet strict.
_PEER_ID_RE = re.compile(r"[1-9A-HJ-NP-Za-km-z]{20,128}")
_HOSTNAME_RE = re.compile(
    r"(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*"
)
# A model repo: "owner/name", "hf://owner/name" or a local store path/URI.
# No whitespace or control characters, nothing shell- or template-like.
_REPO_RE = re.compile(r"[A-Za-z0-9._~:/@+=-]{1,200}")
_FIELDS = ("v", "peer_id", "api", "repo")


class CommitmentError(ValueError):
    """The commitment is not a valid v1 record; the message names the problem."""


@dataclass(frozen=True)
class MinerCommitment:
    """What a miner publishes so peers and validators can find it."""

    peer_id: str
    api: str  # "host:port" of the miner HTTP API; IPv6 as "[addr]:port"
    repo: str
    v: int = VERSION

    def __post_init__(self) -> None:
        # Validate on construction too, so a node never publishes a record
        # that its own readers would reject.
        _check_peer_id(self.peer_id)
        _check_api(self.api)
        _check_repo(self.repo)
        if type(self.v) is not int or self.v != VERSION:
            raise CommitmentError(f"unsupported commitment version {self.v!r}")
        size = len(self._encode().encode())
        if size > MAX_ONCHAIN_BYTES:
            # Refused when the record is made (a miner's startup), not by the chain after
            # a signed extrinsic: the fields are each valid, but together too long.
            raise CommitmentError(
                f"commitment is {size} bytes; the chain stores at most {MAX_FIELDS} fields of "
                f"{RAW_FIELD_BYTES} bytes ({MAX_ONCHAIN_BYTES} bytes): shorten the repo "
                f"({len(self.repo)} chars) or the API host ({len(self.api)} chars)"
            )

    @property
    def host(self) -> str:
        return split_api(self.api)[0]

    @property
    def port(self) -> int:
        return split_api(self.api)[1]

    def to_dict(self) -> dict:
        return {"v": self.v, "peer_id": self.peer_id, "api": self.api, "repo": self.repo}

    def to_json(self) -> str:
        """Compact, key-ordered JSON: the exact string committed on chain."""
        return self._encode()  # at most MAX_ONCHAIN_BYTES: checked on construction

    def _encode(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"), sort_keys=True)


def split_api(api: str) -> tuple[str, int]:
    """``"host:port"`` → (host, port); IPv6 hosts come bracketed: ``"[::1]:8091"``."""
    if not isinstance(api, str) or not api:
        raise CommitmentError("api must be a non-empty 'host:port' string")
    if api.startswith("["):
        end = api.find("]")
        if end < 0 or api[end + 1 : end + 2] != ":":
            raise CommitmentError("api: IPv6 host must look like '[addr]:port'")
        host, port_text = api[1:end], api[end + 2 :]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise CommitmentError("api: bracketed host is not an IPv6 address") from None
    else:
        host, sep, port_text = api.rpartition(":")
        if not sep or not host:
            raise CommitmentError("api must be 'host:port'")
        if not _HOSTNAME_RE.fullmatch(host):
            raise CommitmentError("api: host is not a valid hostname or IPv4 address")
    if not port_text.isdigit() or len(port_text) > 5 or not 1 <= int(port_text) <= 65535:
        raise CommitmentError("api: port must be an integer in 1..65535")
    return host, int(port_text)


def _check_peer_id(value: Any) -> None:
    if not isinstance(value, str) or not _PEER_ID_RE.fullmatch(value):
        raise CommitmentError("peer_id must be a base58 libp2p peer id (20-128 chars)")


def _check_api(value: Any) -> None:
    if not isinstance(value, str) or len(value) > 300:
        raise CommitmentError("api must be a 'host:port' string")
    split_api(value)


def _check_repo(value: Any) -> None:
    if not isinstance(value, str) or not _REPO_RE.fullmatch(value):
        raise CommitmentError(
            "repo must be 1-200 chars of [A-Za-z0-9._~:/@+=-] (e.g. 'owner/model' or 'hf://owner/model')"
        )


def _reject_constant(name: str) -> Any:
    # json accepts NaN/Infinity by default; they are not JSON and have no place here.
    raise CommitmentError(f"non-standard JSON constant {name}")


def parse_commitment(raw: Union[str, bytes, bytearray]) -> MinerCommitment:
    """Parse one committed string strictly; raises :class:`CommitmentError`.

    Accepts exactly ``{"v":1,"peer_id":str,"api":"host:port","repo":str}``;
    unknown or missing keys, wrong types (``true`` is not ``1``), duplicated
    keys and anything over :data:`MAX_COMMITMENT_BYTES` are rejected.
    """
    if isinstance(raw, (bytes, bytearray)):
        if len(raw) > MAX_COMMITMENT_BYTES:
            raise CommitmentError(f"commitment is larger than {MAX_COMMITMENT_BYTES} bytes")
        try:
            text = bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            raise CommitmentError("commitment is not UTF-8") from None
    elif isinstance(raw, str):
        text = raw
        if len(text.encode("utf-8", "surrogatepass")) > MAX_COMMITMENT_BYTES:
            raise CommitmentError(f"commitment is larger than {MAX_COMMITMENT_BYTES} bytes")
    else:
        raise CommitmentError(f"commitment must be text, got {type(raw).__name__}")

    def no_duplicates(pairs: list) -> dict:
        out: dict = {}
        for key, value in pairs:
            if key in out:
                raise CommitmentError(f"duplicate key {key!r}")
            out[key] = value
        return out

    try:
        obj = json.loads(text, object_pairs_hook=no_duplicates, parse_constant=_reject_constant)
    except CommitmentError:
        raise
    except (ValueError, RecursionError) as exc:
        raise CommitmentError(f"commitment is not JSON: {exc.__class__.__name__}") from None
    if not isinstance(obj, dict):
        raise CommitmentError("commitment must be a JSON object")
    missing = [key for key in _FIELDS if key not in obj]
    if missing:
        raise CommitmentError(f"commitment is missing {', '.join(missing)}")
    extra = sorted(str(key)[:32] for key in obj if key not in _FIELDS)
    if extra:
        raise CommitmentError(f"commitment has unknown keys: {', '.join(extra)}")
    version = obj["v"]
    if type(version) is not int or version != VERSION:
        raise CommitmentError(f"unsupported commitment version (expected {VERSION})")
    return MinerCommitment(peer_id=obj["peer_id"], api=obj["api"], repo=obj["repo"], v=version)


def parse_commitments(raw: dict[str, Any], logger=None) -> dict[str, MinerCommitment]:
    """Parse many hotkey → raw commitments; bad ones are logged and skipped."""
    import logging

    log = logger or logging.getLogger("dtrain.chain")
    out: dict[str, MinerCommitment] = {}
    for hotkey, value in raw.items():
        if value is None or value == "":
            continue
        try:
            out[hotkey] = parse_commitment(value)
        except CommitmentError as exc:
            # %r of a short prefix only: the value is attacker-controlled.
            log.warning("skipping malformed commitment from %s: %s", str(hotkey)[:64], exc)
    return out
