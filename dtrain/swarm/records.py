"""Round records: what one averaging round looked like from this peer (JSON-serialisable).

Scoring and dashboards read these; keep the field names stable (they are documented in docs/swarm.md).
:class:`Outcome` is the protocol's one set of status codes: the swarm writes them and
``dtrain.validation.scoring`` reads them. This module is plain Python (no torch, no
hivemind) so that both can import it cheaply.
"""

from __future__ import annotations

import enum
import json
import os
import threading
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Iterator, Optional


class Outcome(str, enum.Enum):
    """Exactly one per peer per round (the protocol's status codes)."""

    SUCCESS = "SUCCESS"  # in the group, sent its parts and returned its averaged part
    FAIL = "FAIL"  # in the group but failed: dropped/killed, too slow (banned), or sent non-finite values
    NON_PARTICIPATING = "NON_PARTICIPATING"  # expected and reachable, but did not join the group
    NOT_ALIVE = "NOT_ALIVE"  # expected but not reachable on the DHT/p2p layer
    WRONG_MODEL = "WRONG_MODEL"  # joined, but its model fingerprint, tensor schema or wire codec differs from ours

    @classmethod
    def parse(cls, value: "Outcome | str") -> "Outcome":
        """An Outcome, or its name in any case ("success"); ValueError names the allowed codes."""
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).upper())
        except ValueError:
            raise ValueError(f"unknown round outcome {value!r}; expected one of "
                             f"{', '.join(o.value for o in cls)}") from None


@dataclass
class PeerResult:
    peer_id: str
    outcome: Outcome
    weight_claimed: float = 0.0  # the weight the peer announced in matchmaking
    weight_used: float = 0.0  # after the cap (and 0 if its contribution was rejected)
    reason: str = ""
    # refused on what it published in the gather (its claimed weight, norm or work commitment),
    # or, on dtrain's round, as a reducer for the bytes it returned, which every member reads
    # alike: its own fault, provable to anyone in the group
    proven: bool = False

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["outcome"] = self.outcome.value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PeerResult":
        return cls(
            peer_id=str(d["peer_id"]),
            outcome=Outcome(d["outcome"]),
            weight_claimed=float(d.get("weight_claimed", 0.0)),
            weight_used=float(d.get("weight_used", 0.0)),
            reason=str(d.get("reason", "")),
            proven=bool(d.get("proven", False)),
        )


@dataclass
class RoundRecord:
    round_id: str  # hex group id assigned by hivemind matchmaking ("" if no group formed)
    local_peer_id: str
    started_at: float  # unix time
    duration_s: float  # matchmaking + all-reduce, as the caller waited
    group: list[str] = field(default_factory=list)  # peer ids in the matchmade group, in partition order
    peers: list[PeerResult] = field(default_factory=list)
    bytes_sent: int = 0  # protobuf payload bytes of all-reduce messages (excludes libp2p framing)
    bytes_received: int = 0
    allreduce_s: float = 0.0  # the butterfly itself, after the group formed
    result_check_s: float = 0.0  # the result check after it (dtrain.swarm.averaging.result_check)
    fraction_averaged: float = 0.0  # share of the local vector that received a real average
    # share that is zeros because its reducer was refused for what it returned (the same on every
    # receiver of those bytes); what is neither kept this peer's local values
    fraction_refused: float = 0.0
    # share of the averaged values this peer re-reduced itself, from the senders' bytes, for a
    # refused reducer (the same on every receiver of the same bytes; counted in fraction_averaged)
    fraction_recovered: float = 0.0
    total_weight: float = 0.0  # sum of capped weights of contributing peers, as reduced by this peer
    num_elements: int = 0
    model_fingerprint: str = ""
    compression: str = "none"
    mode: str = "gradient"  # "gradient" (per-step) or "diloco" (pseudo-gradient)
    tokens: int = 0  # tokens this peer trained on for this round (for bytes/token); 0 if unknown
    error: str = ""  # non-empty when the round did not run (e.g. no group found)
    # peer id -> the WorkReport it committed in the gather (parsed and checked); for
    # validators' audits, kept out of logs and to_dict (it is large and other peers' data)
    work_reports: dict = field(default_factory=dict, repr=False, compare=False)
    # what the secret-seed round audit reads (dtrain.swarm.averaging.audit.RoundEvidence): the
    # accounts of the parts this peer applied; in memory only, like work_reports
    evidence: Any = field(default=None, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        return not self.error and self.fraction_averaged > 0

    @property
    def in_step(self) -> bool:
        """Whether this replica holds what every peer that saw the same bytes holds: nothing of
        the vector kept local values (a refused reducer's zeros are common to all)."""
        return self.fraction_averaged + self.fraction_refused >= 1.0 - 1e-12

    def result_of(self, peer_id: str) -> Optional[PeerResult]:
        return next((p for p in self.peers if p.peer_id == peer_id), None)

    def proven_at_fault(self) -> set[str]:
        """The members refused for what they published (``PeerResult.proven``)."""
        return {p.peer_id for p in self.peers if p.proven}

    def outcome_of(self, peer_id: str) -> Optional[Outcome]:
        result = self.result_of(peer_id)
        return None if result is None else result.outcome

    def to_dict(self) -> dict[str, Any]:
        d = asdict(replace(self, work_reports={}, evidence=None))  # not deep-copied just to be dropped
        d.pop("work_reports")
        d.pop("evidence")
        d["peers"] = [p.to_dict() for p in self.peers]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RoundRecord":
        kwargs = {k: d[k] for k in cls.__dataclass_fields__ if k in d and k != "peers"}
        return cls(peers=[PeerResult.from_dict(p) for p in d.get("peers", [])], **kwargs)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


class RoundLog:
    """Append-only JSON-lines file of RoundRecords (one line per round, flushed each time)."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._lock = threading.Lock()
        parent = os.path.dirname(self.path)
        if parent:
            os.makedirs(parent, exist_ok=True)

    def append(self, record: RoundRecord) -> None:
        line = record.to_json() + "\n"
        with self._lock, open(self.path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()

    def __iter__(self) -> Iterator[RoundRecord]:
        return iter(read_records(self.path))


def read_records(path: str | os.PathLike) -> list[RoundRecord]:
    """Read a JSON-lines round log; a torn last line (crash mid-write) is skipped, not fatal."""
    out: list[RoundRecord] = []
    if not os.path.exists(path):
        return out
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                out.append(RoundRecord.from_dict(json.loads(line)))
            except (ValueError, KeyError, TypeError):
                continue
    return out
