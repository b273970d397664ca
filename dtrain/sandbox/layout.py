"""Where a sandbox keeps its state, so ``dtrain sandbox`` and ``dtrain status`` agree.

    D/chain.sqlite              the embedded chain (``dtrain.chain.sandbox``)
    D/wallets/<name>/...        real sr25519 keys made with bittensor's wallet code
    D/store/                    the local model store (same tag scheme as the Hub)
    D/neurons/<name>/config.toml, log.txt, and the neuron's data dir
    D/sandbox.json              who is who: name, role, kind, uid, hotkey
    D/summary.json              the final summary (also what ``--json`` prints)
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass
class Member:
    name: str
    role: str  # "miner" or "validator"
    kind: str  # "honest", an adversary kind, or "validator"
    uid: int
    hotkey: str


def wallets_dir(root: Path) -> Path:
    return root / "wallets"


def store_dir(root: Path) -> Path:
    return root / "store"


def neuron_dir(root: Path, name: str) -> Path:
    return root / "neurons" / name


def manifest_path(root: Path) -> Path:
    return root / "sandbox.json"


def summary_path(root: Path) -> Path:
    return root / "summary.json"


def write_manifest(root: Path, members: list[Member], meta: dict) -> None:
    from dtrain.atomic import write_text

    doc = {**meta, "members": [asdict(m) for m in members]}
    write_text(manifest_path(root), json.dumps(doc, indent=2))


def read_manifest(root: Path) -> dict | None:
    try:
        return json.loads(manifest_path(root).read_text())
    except (OSError, ValueError):
        return None


def status_files(root: Path) -> dict[str, Path]:
    """name -> the newest status.json a neuron of this sandbox wrote."""
    found: dict[str, Path] = {}
    for path in sorted((root / "neurons").glob("*/data/*/status.json")):
        found[path.parents[2].name] = path
    return found


def validator_state_files(root: Path) -> list[Path]:
    return sorted((root / "neurons").glob("*/data/validator-*/state.json"))
