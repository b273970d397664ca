"""``dtrain status``'s data: the subnet as seen from here, as one JSON-able dict.

Sources, each optional so a partial outage still shows what is known:
- the chain: neurons, commitments, weights, block;
- each committed miner's public ``GET /v1/status`` (epoch, loss, samples);
- local files: a validator's persisted state (scores, recent rounds) and the status
  snapshots the neurons on this machine write (this node's health).
"""

from __future__ import annotations

import json
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from dtrain.config import Config, expand
from dtrain.jsonutil import finite_or_none

log = logging.getLogger("dtrain.status")


def _miner_status(api: str, timeout: float) -> dict | None:
    """A miner's public status, or None. The miner is untrusted: the client bounds
    the call's total time and size and rejects NaN/Infinity and garbage as ApiError;
    anything else it might raise is caught too, so one miner never sinks the report."""
    from dtrain.api.client import MinerClient

    try:
        return MinerClient(None, timeout=timeout).status(api)
    except Exception:
        return None


def _epoch(value: Any) -> int | None:
    """A non-negative int (bool is an int to Python, but not an epoch)."""
    return value if type(value) is int and value >= 0 else None


def _count(value: Any) -> int | None:
    return value if type(value) is int and value >= 0 else None


def _finite(value: Any) -> float | None:
    if type(value) not in (int, float):
        return None
    try:
        value = float(value)
    except OverflowError:  # an int too big for a float
        return None
    return value if math.isfinite(value) else None


def _miner_fields(st: Any) -> dict[str, Any]:
    """The fields ``dtrain status`` uses from a miner's (untrusted) status, coerced."""
    st = st if isinstance(st, dict) else {}
    return {"epoch": _epoch(st.get("epoch")), "loss": _finite(st.get("loss")),
            "samples": _count(st.get("samples")),
            "samples_accumulated": _count(st.get("samples_accumulated")) or 0}


def _local_dirs(cfg: Config) -> list[Path]:
    """Directories that may hold neurons' state: the data dir, and a sandbox's neurons."""
    dirs = [expand(cfg.node.data_dir)]
    if cfg.chain.network == "sandbox" and cfg.chain.sandbox_dir:
        dirs += sorted(expand(cfg.chain.sandbox_dir).glob("neurons/*/data"))
    return [d for d in dirs if d.is_dir()]


def _read_json(path: Path) -> dict | None:
    try:
        doc = json.loads(path.read_text())
        return doc if isinstance(doc, dict) else None
    except (OSError, ValueError):
        return None


def _dicts(value: Any) -> list[dict]:
    """The dict items of ``value`` if it is a list (a hand-edited or half-written
    state file must not crash the report)."""
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


def _round_view(summary: dict) -> dict:
    """A validator's round summary in the round-record shape the dashboards draw."""
    return {
        "round": summary.get("round"), "round_id": summary.get("round_id"), "epoch": summary.get("epoch"),
        "status": summary.get("status"), "duration_s": summary.get("duration_s"),
        "group": summary.get("participants", []), "participants": summary.get("participants", []),
        "peers": [{"peer_id": f"uid {m.get('uid')}", "outcome": m.get("outcome")}
                  for m in _dicts(summary.get("miners"))],
        "bytes_sent": summary.get("bytes", 0), "bytes_received": 0,
        "fraction_averaged": summary.get("fraction_averaged"), "loss_after": summary.get("loss_after"),
        "error": summary.get("error", ""), "time": summary.get("time"),
    }


def collect_status(cfg: Config, *, probe_timeout: float = 2.0) -> dict[str, Any]:
    """The report; never carries NaN/inf (they become None), whatever miners sent."""
    return finite_or_none(_collect(cfg, probe_timeout))


def _collect(cfg: Config, probe_timeout: float) -> dict[str, Any]:
    from dtrain.chain.base import ChainError

    doc: dict[str, Any] = {"network": cfg.chain.network, "netuid": cfg.chain.netuid, "block": None,
                           "time": time.time(), "miners": [], "validators": [], "rounds": [],
                           "global": {"epoch": None, "samples": None, "target_batch": cfg.allreduce.target_batch_size},
                           "local": None, "chain_error": None}
    local_dirs = _local_dirs(cfg)
    validator_state = None
    for d in local_dirs:
        for path in sorted(d.glob("validator-*/state.json")):
            validator_state = _read_json(path) or validator_state
    ema = (validator_state or {}).get("ema")
    scores: dict[int, float | None] = {}
    for key, value in (ema.items() if isinstance(ema, dict) else ()):
        try:
            scores[int(key)] = _finite(value)
        except (TypeError, ValueError):
            continue
    if validator_state:
        doc["rounds"] = [_round_view(r) for r in _dicts(validator_state.get("recent_rounds"))[-10:]]
    snapshots = []
    for d in local_dirs:
        for path in sorted(d.glob("*/status.json")):
            snap = _read_json(path)
            if snap:
                snapshots.append(snap)
    if snapshots:
        doc["local"] = max(snapshots, key=lambda s: _finite(s.get("started_at")) or 0.0)
        doc["local_nodes"] = [{k: s.get(k) for k in ("role", "uid", "hotkey", "state", "epoch", "loss", "peers_seen",
                                                      "api", "peer_id")} for s in snapshots]

    try:
        from dtrain.neurons.runtime import open_chain_for

        chain = open_chain_for(cfg)
    except Exception as exc:  # unknown network, missing sandbox dir, unreachable chain
        doc["chain_error"] = str(exc)
        return doc
    try:
        doc["block"] = chain.block()
        neurons = chain.neurons()
        commitments = chain.commitments()
        weights = chain.weights()
    except ChainError as exc:
        doc["chain_error"] = str(exc)
        return doc
    finally:
        chain.close()

    validators = [n for n in neurons if n.validator_permit]
    # The weight a miner holds: the stake-weighted mean of what the permitted validators set.
    stake_total = sum(v.stake for v in validators) or 1.0
    consensus: dict[int, float] = {}
    for v in validators:
        for uid, w in weights.get(v.uid, {}).items():
            consensus[uid] = consensus.get(uid, 0.0) + w * (v.stake or 0.0) / stake_total
    miners = [n for n in neurons if not n.validator_permit]
    apis = {n.uid: commitments[n.hotkey].api for n in miners if n.hotkey in commitments}
    with ThreadPoolExecutor(max_workers=max(1, min(16, len(apis)))) as pool:
        raw = dict(zip(apis, pool.map(lambda api: _miner_status(api, probe_timeout), apis.values())))
    # Untrusted from here on only through the coerced fields: a miner answering
    # {"epoch": "x", "loss": 1e999} shows as unknown, it does not crash the report.
    live = {uid: None if st is None else _miner_fields(st) for uid, st in raw.items()}
    # A miner that is down still left its last snapshot on this machine (e.g. a finished sandbox).
    offline = {snap.get("hotkey"): snap for snap in snapshots if snap.get("role") == "miner"}
    for n in miners:
        c = commitments.get(n.hotkey)
        st = live[n.uid] if raw.get(n.uid) else _miner_fields(offline.get(n.hotkey))
        doc["miners"].append({
            "uid": n.uid, "hotkey": n.hotkey, "api": c.api if c else None, "peer_id": c.peer_id if c else None,
            "repo": c.repo if c else None, "stake": n.stake, "epoch": st.get("epoch"), "loss": st.get("loss"),
            "samples": st.get("samples"), "alive": n.uid in live and live[n.uid] is not None,
            "weight": consensus.get(n.uid, 0.0),
            "score": scores.get(n.uid), "validator_permit": False,
        })
    doc["validators"] = [{"uid": v.uid, "hotkey": v.hotkey, "stake": v.stake} for v in validators]
    epochs = [m["epoch"] for m in doc["miners"] if isinstance(m["epoch"], int)]
    if epochs:
        doc["global"]["epoch"] = max(epochs)
        doc["global"]["samples"] = sum((live.get(m["uid"]) or {}).get("samples_accumulated", 0)
                                       for m in doc["miners"] if m["epoch"] == max(epochs))
    return doc
