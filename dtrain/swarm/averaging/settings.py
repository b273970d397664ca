"""The knobs of one averaging swarm, with one set of defaults: the config schema's.

Every default that has a setting in ``[allreduce]`` (dtrain.config.AllReduceConfig) is read
from that schema, so the library and ``dtrain mine``/``validate`` cannot disagree: a swarm
built with ``AveragingConfig()`` averages as production does (CenteredClip, work commitments
required, groups of up to 32). Knobs the schema does not expose keep the library's constants.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from dtrain.config import AllReduceConfig, ModelConfig
from dtrain.swarm.codecs import canonical_compression
from dtrain.swarm.deadlines import matchmaking_timeout_for

if TYPE_CHECKING:
    from pathlib import Path

    from dtrain.config import Config

AGGREGATIONS = ("mean", "centered_clip")


def prefix_for(run_id: str) -> str:
    """The swarm namespace of a training run: peers of one run must share it."""
    return f"dtrain-{run_id}"


def sender_timeout_for(allreduce_timeout_s: float) -> float:
    """A sender silent this long between parts is banned: a quarter of the all-reduce timeout,
    at least 5 s (and never more than the timeout itself)."""
    return min(allreduce_timeout_s, max(5.0, allreduce_timeout_s / 4))


_SCHEMA = AllReduceConfig()

# Wire bytes per part: hivemind's 512 KiB for every vector of 16 MiB or more (a part has a fixed
# cost, docs/swarm.md "CPU per byte"), less for smaller ones so that a full group of the schema's
# size still gives every reducer a part, never under 128 KiB. The rule reads only the vector's
# size, so every peer of a run (one model) splits the vector alike.
MIN_PART_BYTES = 2**17
MAX_PART_BYTES = 2**19
PARTS_PER_VECTOR = 32  # the group size the rule was measured at (docs/swarm.md "CPU per byte")


def part_size_for(vector_bytes: int) -> int:
    """The part size (wire bytes) of a swarm averaging ``vector_bytes`` of float32 values: the
    largest power of two at most vector_bytes / 32, within [MIN_PART_BYTES, MAX_PART_BYTES]."""
    share = max(1, int(vector_bytes) // PARTS_PER_VECTOR)
    return max(MIN_PART_BYTES, min(MAX_PART_BYTES, 1 << (share.bit_length() - 1)))


# Marks a setting derived from the others when the config is built (so that a config with a
# shorter all-reduce timeout also gets a shorter sender timeout, not the schema's).
DERIVED = -1.0


@dataclass(frozen=True)
class AveragingConfig:
    """Knobs of one averaging swarm; ``settings_from`` maps the TOML ``[allreduce]`` table onto it."""

    prefix: str = prefix_for(ModelConfig().run_id)  # run namespace; peers of one run must share it
    min_group_size: int = _SCHEMA.min_group_size
    target_group_size: Optional[int] = _SCHEMA.target_group_size
    min_matchmaking_time_s: float = _SCHEMA.matchmaking_time
    request_timeout_s: float = _SCHEMA.request_timeout
    allreduce_timeout_s: float = _SCHEMA.allreduce_timeout
    # None: no limit; DERIVED: sender_timeout_for(allreduce_timeout_s)
    sender_timeout_s: Optional[float] = DERIVED
    reducer_timeout_s: Optional[float] = None  # default 2 x sender timeout
    # give up looking for a group after this long; DERIVED: matchmaking attempts x matchmaking time
    matchmaking_timeout_s: float = DERIVED
    compression: str = _SCHEMA.compression  # none | fp16 | 8bit (+ experiments: 8bit-uniform, 8bit-quantile)
    # None: part_size_for(the averaged vector's bytes), set by the swarm that averages it
    part_size_bytes: Optional[int] = None
    bandwidth: Optional[float] = None  # MB/s hint for load balancing; None = "same as others"
    client_mode: Optional[bool] = None  # None: follow the DHT
    allow_state_sharing: bool = True
    declare_state_period_s: float = 30.0
    log_path: Optional[str] = None  # JSON lines of RoundRecords
    # Where the averager keeps what it sent for the round's questions (an unlinked file, read
    # back part by part); None: in memory. Neurons keep it on disk (docs/operators.md, "Memory").
    kept_dir: Optional[str] = None
    # A contribution whose announced L2 norm exceeds this many times the median norm of the
    # weighted peers is refused (a scaled/noisy "poisoned" gradient); 0 disables the check.
    max_norm_ratio: float = 10.0
    # Work commitments (dtrain.swarm.averaging.contribution): a peer that brings weight without a
    # commitment binding its contribution to its work report is excluded. Only checked by a
    # peer that commits itself (run_round with work_nonce); False also admits uncommitted peers then.
    require_commitments: bool = True
    # How a reducer combines the senders' parts: "centered_clip" (dtrain.swarm.averaging.centered_clip:
    # bounds what one undetected bad sender can do) or "mean" (hivemind's weighted mean).
    aggregation: str = _SCHEMA.aggregation

    def __post_init__(self):
        # frozen: derived values are filled in once, here (dataclasses.replace re-derives them
        # only if the caller passes DERIVED again)
        for name, value in self._derived().items():
            if getattr(self, name) == DERIVED:
                object.__setattr__(self, name, value)
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be 'mean' or 'centered_clip', got {self.aggregation!r}")
        canonical_compression(self.compression)  # ValueError naming the known ones

    def replace(self, **changes) -> "AveragingConfig":
        """A copy with ``changes`` applied (and checked). A derived setting that still has its
        derived value follows the settings it derives from."""
        for name, value in self._derived().items():
            if name not in changes and getattr(self, name) == value:
                changes[name] = DERIVED
        return dataclasses.replace(self, **changes)

    def _derived(self) -> dict:
        """What each derived setting is, from the settings it derives from."""
        return dict(sender_timeout_s=sender_timeout_for(self.allreduce_timeout_s),
                    matchmaking_timeout_s=matchmaking_timeout_for(self.min_matchmaking_time_s))


def settings_from(cfg: "Config", log_path: "Optional[Path | str]" = None) -> AveragingConfig:
    """The averaging settings of a neuron with config ``cfg``; rounds are logged to ``log_path``."""
    a = cfg.allreduce
    return AveragingConfig(
        prefix=prefix_for(cfg.model.run_id),
        min_group_size=a.min_group_size,
        target_group_size=a.target_group_size,
        min_matchmaking_time_s=a.matchmaking_time,
        request_timeout_s=a.request_timeout,
        allreduce_timeout_s=a.allreduce_timeout,
        compression=a.compression,
        log_path=str(log_path) if log_path else None,
        kept_dir=os.path.join(os.path.dirname(str(log_path)), "kept") if log_path else None,
        # neurons always bind contributions to work (docs/protocol.md, "Work commitments")
        require_commitments=True,
        aggregation=a.aggregation,
    )
