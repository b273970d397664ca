"""Validator state that must survive a restart (EMA and hotkey per uid, last scores, recent
rounds, the weight-setting memory), saved atomically as JSON with the previous good file kept
as ``.bak``. A bad file is an error that names it, never a quiet reset (docs/scoring.md,
"Persistence").
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtrain.atomic import fsync_dir
from dtrain.validation.scoring import EmaState
from dtrain.validation.weights import WeightSetState

STATE_VERSION = 1
MAX_RECENT_ROUNDS = 50


class StateError(Exception):
    """The state file cannot be read or has an unexpected shape. The message names the file."""

    def __init__(self, path: Path, reason: str) -> None:
        self.path = Path(path)
        self.reason = reason
        backup = _backup_path(self.path)
        hint = ""
        if backup.exists():
            hint = f"; the previous good state is in {backup} (copy it over {self.path} to restore)"
        super().__init__(f"validator state file {self.path} is unusable: {reason}{hint}")


@dataclass
class ValidatorState:
    ema: EmaState = field(default_factory=EmaState)
    last_scores: dict[int, dict[str, Any]] = field(default_factory=dict)
    recent_rounds: list[dict[str, Any]] = field(default_factory=list)
    weight_set: WeightSetState = field(default_factory=WeightSetState)
    round_counter: int = 0
    # hotkey -> last round (by round_counter) of its probation (dtrain.validation.verification)
    probation: dict[str, int] = field(default_factory=dict)

    def add_round(self, summary: dict[str, Any], keep: int = MAX_RECENT_ROUNDS) -> None:
        """Append a round summary (JSON-serialisable), keeping the last ``keep``."""
        self.recent_rounds.append(summary)
        if len(self.recent_rounds) > keep:
            del self.recent_rounds[: len(self.recent_rounds) - keep]
        self.round_counter += 1

    def to_json(self) -> dict[str, Any]:
        # JSON object keys are strings; uids go through str() and back through int().
        return {
            "version": STATE_VERSION,
            "round_counter": self.round_counter,
            "ema": {str(u): s for u, s in sorted(self.ema.scores.items())},
            "hotkeys": {str(u): h for u, h in sorted(self.ema.hotkeys.items())},
            "ema_mass": {str(u): m for u, m in sorted(self.ema.mass.items())},
            "last_scores": {str(u): s for u, s in sorted(self.last_scores.items())},
            "recent_rounds": self.recent_rounds,
            "weight_set": self.weight_set.as_dict(),
            "probation": dict(sorted(self.probation.items())),
        }

    @classmethod
    def from_json(cls, data: Any, path: Path) -> "ValidatorState":
        if not isinstance(data, dict):
            raise StateError(path, f"expected a JSON object at top level, found {type(data).__name__}")
        version = data.get("version")
        if version != STATE_VERSION:
            raise StateError(path, f"key 'version': expected {STATE_VERSION}, found {version!r}")
        try:
            ema = {int(u): float(s) for u, s in data.get("ema", {}).items()}
            hotkeys = {int(u): str(h) for u, h in data.get("hotkeys", {}).items()}
            # absent in states written before it was kept: those uids count as warmed up
            mass = {int(u): float(m) for u, m in (data.get("ema_mass") or {}).items()}
            last = {int(u): dict(s) for u, s in data.get("last_scores", {}).items()}
            rounds = list(data.get("recent_rounds", []))
            ws = WeightSetState.from_dict(data.get("weight_set", {}) or {})
            counter = int(data.get("round_counter", 0))
            probation = {str(h): int(r) for h, r in (data.get("probation") or {}).items()}
        except (TypeError, ValueError, AttributeError) as e:
            raise StateError(path, f"malformed field: {e}") from None
        bad = [u for u, s in [*ema.items(), *mass.items()] if not math.isfinite(s) or s < 0]
        if bad:
            raise StateError(path, f"key 'ema': non-finite or negative score for uid(s) {bad}")
        return cls(
            ema=EmaState(scores=ema, hotkeys=hotkeys, mass=mass),
            last_scores=last,
            recent_rounds=rounds,
            weight_set=ws,
            round_counter=counter,
            probation=probation,
        )


def _backup_path(path: Path) -> Path:
    return path.with_name(path.name + ".bak")


def load_state(path: str | os.PathLike) -> ValidatorState:
    """Load the state; a missing file gives a fresh state, a corrupt one raises StateError."""
    p = Path(path)
    try:
        raw = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        return ValidatorState()
    except OSError as e:
        raise StateError(p, f"cannot read: {e.strerror or e}") from None
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as e:
        raise StateError(p, f"invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    return ValidatorState.from_json(data, p)


def save_state(path: str | os.PathLike, state: ValidatorState) -> None:
    """Write the state atomically, keeping the previous good file as ``<name>.bak``."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    # allow_nan=False: NaN would write fine and then fail our own loader on restart.
    payload = json.dumps(state.to_json(), indent=1, sort_keys=True, allow_nan=False)
    tmp = p.with_name(p.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    if p.exists():
        # Only a file that still loads is worth keeping as the fallback; never overwrite a
        # good .bak with a corrupt current file.
        try:
            load_state(p)
        except StateError:
            pass
        else:
            bak = _backup_path(p)
            bak_tmp = bak.with_name(bak.name + ".tmp")
            shutil.copy2(p, bak_tmp)
            os.replace(bak_tmp, bak)
    os.replace(tmp, p)
    fsync_dir(p.parent)
