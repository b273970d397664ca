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


def _miner_status(api: str, timeout: float):
    """A miner's public status (``StatusResponse``), or None. The miner is untrusted: the
    client bounds the call's total time and size, rejects NaN/Infinity and garbage as
    ApiError, and reads a field that breaks its rule as unknown; anything else it might
    raise is caught too, so one miner never sinks the report."""
    from dtrain.api.client import MinerClient

    try:
        return MinerClient(None, timeout=timeout).status(api)
    except Exception:
        return None


def _finite(value: Any) -> float | None:
    if type(value) not in (int, float):
        return None
    try:
        value = float(value)
    except OverflowError:  # an int too big for a float
        return None
    return value if math.isfinite(value) else None


def _local_dirs(cfg: Config) -> list[Path]:
    """Directories that may hold neurons' state: the data dir, and a sandbox's neurons."""
    dirs = [expand(cfg.node.data_dir)]
    if cfg.chain.network == "sandbox" and cfg.chain.sandbox_dir:
        dirs += sorted(expand(cfg.chain.sandbox_dir).glob("neurons/*/data"))
    return [d for d in dirs if d.is_dir()]


def _averaging_mode(cfg: Config) -> dict[str, Any]:
    """How the swarm averages: this config's allreduce.mode, or a sandbox's own (its manifest)."""
    mode, inner_steps = cfg.allreduce.mode, cfg.allreduce.diloco_inner_steps
    if cfg.chain.network == "sandbox" and cfg.chain.sandbox_dir:
        from dtrain.sandbox import layout

        manifest = layout.read_manifest(expand(cfg.chain.sandbox_dir)) or {}
        if manifest.get("mode") in ("gradient", "diloco"):
            mode = manifest["mode"]
            if isinstance(manifest.get("diloco_inner_steps"), int):
                inner_steps = manifest["diloco_inner_steps"]
    return {"mode": mode, "diloco_inner_steps": inner_steps if mode == "diloco" else None}


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
    """A validator's round summary in the round-record shape the dashboards draw.

    Only recorded values: a figure the summary does not hold (e.g. byte counts of a
    summary written by an older version) stays None and is shown as unknown, never 0.
    """
    return {
        "round": summary.get("round"), "round_id": summary.get("round_id"), "epoch": summary.get("epoch"),
        "status": summary.get("status"), "duration_s": summary.get("duration_s"),
        "allreduce_s": summary.get("allreduce_s"),
        "group": summary.get("participants", []), "participants": summary.get("participants", []),
        "peers": [{"peer_id": f"uid {m.get('uid')}", "outcome": m.get("outcome")}
                  for m in _dicts(summary.get("miners"))],
        "bytes_sent": summary.get("bytes_sent"), "bytes_received": summary.get("bytes_received"),
        "fraction_averaged": summary.get("fraction_averaged"), "loss_after": summary.get("loss_after"),
        "error": summary.get("error", ""), "time": summary.get("time"),
    }


def _validator_state(local_dirs: list[Path], doc: dict):
    """The newest validator state on this machine (``validation.state.load_state``), or None.

    An unreadable file is reported in ``doc["validator_state_error"]`` instead of sinking
    the rest of the report.
    """
    from dtrain.validation.state import StateError, load_state

    paths = [p for d in local_dirs for p in d.glob("validator-*/state.json")]
    for path in sorted(paths, key=lambda p: p.stat().st_mtime, reverse=True):
        try:
            return load_state(path)
        except StateError as exc:
            doc["validator_state_error"] = str(exc)
    return None


def _local_validator_states(local_dirs: list[Path]) -> dict[str, Any]:
    """Hotkey prefix (as in the ``validator-<hotkey[:12]>`` directory) -> its state, for every
    readable validator state on this machine (a sandbox may run several)."""
    from dtrain.validation.state import StateError, load_state

    out: dict[str, Any] = {}
    for d in local_dirs:
        for path in sorted(d.glob("validator-*/state.json")):
            try:
                out.setdefault(path.parent.name[len("validator-"):], load_state(path))
            except StateError:
                continue  # reported once by _validator_state
    return out


def collect_status(cfg: Config, *, probe_timeout: float = 2.0) -> dict[str, Any]:
    """The report; never carries NaN/inf (they become None), whatever miners sent."""
    return finite_or_none(_collect(cfg, probe_timeout))


def _collect(cfg: Config, probe_timeout: float) -> dict[str, Any]:
    doc: dict[str, Any] = {"network": cfg.chain.network, "netuid": cfg.chain.netuid, "block": None,
                           "time": time.time(), "miners": [], "validators": [], "rounds": [],
                           "global": {"epoch": None, "samples": None, "target_batch": cfg.allreduce.target_batch_size},
                           "local": None, "chain_error": None}
    doc.update(_averaging_mode(cfg))
    local_dirs = _local_dirs(cfg)
    scores = _add_validator_state(doc, local_dirs)
    snapshots = _add_local_nodes(doc, local_dirs)
    chain_view = _read_chain(cfg, doc)
    if chain_view is None:
        return doc
    neurons, commitments, weights = chain_view
    validators = [n for n in neurons if n.validator_permit]
    miners = [n for n in neurons if not n.validator_permit]
    statuses = _probe_miners(miners, commitments, probe_timeout)
    doc["miners"] = _miner_rows(miners, commitments, statuses, snapshots, _consensus(validators, weights), scores)
    doc["validators"] = _validator_rows(validators, weights, _local_validator_states(local_dirs))
    _add_global_progress(doc)
    return doc


def _add_validator_state(doc: dict, local_dirs: list[Path]) -> dict:
    """The recent rounds of this machine's validator into ``doc``; returns its scores by uid."""
    validator_state = _validator_state(local_dirs, doc)
    if validator_state is None:
        return {}
    doc["rounds"] = [_round_view(r) for r in _dicts(validator_state.recent_rounds)[-10:]]
    return validator_state.ema.paid()


def _add_local_nodes(doc: dict, local_dirs: list[Path]) -> list[dict]:
    """The status snapshots the neurons on this machine wrote, into ``doc``; returns them."""
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
    return snapshots


def _read_chain(cfg: Config, doc: dict) -> tuple | None:
    """(neurons, commitments, weights), with the block in ``doc``; None with ``doc["chain_error"]``
    set when the chain cannot be opened or read."""
    from dtrain.chain.base import ChainError

    try:
        from dtrain.neurons.runtime import open_chain_for

        chain = open_chain_for(cfg)
    except Exception as exc:  # unknown network, missing sandbox dir, unreachable chain
        doc["chain_error"] = str(exc)
        return None
    try:
        doc["block"] = chain.block()
        return chain.neurons(), chain.commitments(), chain.weights()
    except ChainError as exc:
        doc["chain_error"] = str(exc)
        return None
    finally:
        chain.close()


def _consensus(validators: list, weights: dict) -> dict[int, float]:
    """The weight a miner holds: the stake-weighted mean of what the permitted validators set."""
    stake_total = sum(v.stake for v in validators) or 1.0
    consensus: dict[int, float] = {}
    for v in validators:
        for uid, w in weights.get(v.uid, {}).items():
            consensus[uid] = consensus.get(uid, 0.0) + w * (v.stake or 0.0) / stake_total
    return consensus


def _probe_miners(miners: list, commitments: dict, probe_timeout: float) -> dict:
    """uid -> the miner's ``/v1/status`` (None when it did not answer), probed in parallel."""
    apis = {n.uid: commitments[n.hotkey].api for n in miners if n.hotkey in commitments}
    with ThreadPoolExecutor(max_workers=max(1, min(16, len(apis)))) as pool:
        return dict(zip(apis, pool.map(lambda api: _miner_status(api, probe_timeout), apis.values())))


def _miner_rows(miners: list, commitments: dict, statuses: dict, snapshots: list[dict],
                consensus: dict[int, float], scores: dict) -> list[dict]:
    # Untrusted: a StatusResponse holds only fields that passed their rules, so a miner
    # answering {"epoch": "x", "loss": 1e999} shows as unknown, it does not crash the report.
    from dtrain.api.messages import StatusResponse
    from dtrain.api.rules import PayloadError

    # A miner that is down still left its last snapshot on this machine (e.g. a finished sandbox).
    offline = {snap.get("hotkey"): snap for snap in snapshots if snap.get("role") == "miner"}
    rows = []
    for n in miners:
        c = commitments.get(n.hotkey)
        st = statuses.get(n.uid)
        if st is None:
            try:
                st = StatusResponse.parse(offline.get(n.hotkey) or {}, lenient=True)
            except PayloadError:
                st = StatusResponse()
        rows.append({
            "uid": n.uid, "hotkey": n.hotkey, "api": c.api if c else None, "peer_id": c.peer_id if c else None,
            "repo": c.repo if c else None, "stake": n.stake, "epoch": st.epoch, "loss": st.loss,
            "samples": st.samples, "samples_accumulated": st.samples_accumulated,
            "alive": statuses.get(n.uid) is not None,
            "weight": consensus.get(n.uid, 0.0),
            "score": scores.get(n.uid), "validator_permit": False,
        })
    return rows


def _validator_rows(validators: list, weights: dict, local_states: dict[str, Any]) -> list[dict]:
    """Each validator's own weights, and its rounds when this machine runs it. There is no master
    validator: the chain's consensus (the miners' "weight" column) is their stake-weighted mean."""
    rows = []
    for v in validators:
        set_weights = {str(uid): w for uid, w in sorted(weights.get(v.uid, {}).items())}
        row = {"uid": v.uid, "hotkey": v.hotkey, "stake": v.stake, "weights": set_weights,
               "rounds": None, "last_round": None}
        mine = local_states.get(v.hotkey[:12]) if v.hotkey else None
        if mine is not None:  # this machine runs that validator: what its state file says
            last = _dicts(mine.recent_rounds)[-1:] or [{}]
            row["rounds"], row["last_round"] = mine.round_counter, last[0].get("status")
        rows.append(row)
    return rows


def _add_global_progress(doc: dict) -> None:
    """The global epoch (the highest a miner reports) and the samples toward the global batch:
    what the live miners at that epoch report, None (unknown) rather than a made-up 0 when none do."""
    epochs = [m["epoch"] for m in doc["miners"] if isinstance(m["epoch"], int)]
    if epochs:
        top = max(epochs)
        doc["global"]["epoch"] = top
        known = [m["samples_accumulated"] for m in doc["miners"]
                 if m["alive"] and m["epoch"] == top and m["samples_accumulated"] is not None]
        doc["global"]["samples"] = sum(known) if known else None
