"""The sandbox's outcome as one JSON-able dict, read from the validators' persisted state and
the chain: what ``dtrain sandbox`` prints and saves as summary.json (README.md, "What the
sandbox shows")."""

from __future__ import annotations

import json
from pathlib import Path

from dtrain.sandbox import layout
from dtrain.sandbox.layout import Member
from dtrain.sandbox.settings import NETUID


def build_summary(root: Path, wall_s: float | None = None) -> dict:
    """The sandbox's outcome, from the validators' persisted state and the chain.

    The rounds and scores shown are the first validator's; every validator is listed under
    ``validators`` with the weights it set, and each miner's ``weight`` is the stake-weighted
    mean over validators (what the chain's consensus sees), with ``weights_by_validator``
    beside it and ``validator_spread`` (the largest per-miner difference) at the top.
    """
    manifest = layout.read_manifest(root) or {"members": []}
    members = [Member(**m) for m in manifest["members"]]
    validators = [m for m in members if m.role == "validator"]
    states = _validator_states(root)
    state = states.get(validators[0].name, {}) if validators else {}
    by_uid = {m.uid: m for m in members}
    all_weights = _chain_weights(root)
    weights_by_validator = {v.name: {int(k): float(w) for k, w in all_weights.get(v.uid, {}).items()}
                            for v in validators}
    rounds = [_round_row(r) for r in state.get("recent_rounds", [])]
    miners, spread = _miner_rows(members, state, weights_by_validator)
    curve = _loss_curve(rounds)
    return {
        "dir": str(root), "wall_s": round(wall_s, 1) if wall_s is not None else None,
        "rounds": rounds, "miners": miners,
        "loss": {"start": curve[0] if curve else None, "end": curve[-1] if curve else None, "curve": curve},
        "verification": _verification_times(rounds),
        "uids": {str(uid): m.name for uid, m in by_uid.items()},
        "validators": [_validator_view(v, states.get(v.name, {}), weights_by_validator.get(v.name, {}))
                       for v in validators],
        "validator_spread": round(spread, 6) if len(validators) > 1 else None,
    }


def _validator_states(root: Path) -> dict[str, dict]:
    """validator name -> its persisted state (files that cannot be read are left out)."""
    states: dict[str, dict] = {}
    for path in layout.validator_state_files(root):
        try:
            states.setdefault(path.parents[2].name, json.loads(path.read_text()))
        except (OSError, ValueError):
            pass
    return states


def _chain_weights(root: Path) -> dict[int, dict[int, float]]:
    """validator uid -> the weights it set on the sandbox chain; {} when the chain cannot be read."""
    from dtrain.chain.sandbox import SandboxChain

    try:
        chain = SandboxChain(root, netuid=NETUID)
        try:
            return chain.weights()
        finally:
            chain.close()
    except Exception:
        return {}


def _round_row(r: dict) -> dict:
    """One round of a validator's ``recent_rounds``, as the summary shows it."""
    sent, received = r.get("bytes_sent"), r.get("bytes_received")
    return {"round": r.get("round"), "status": r.get("status"), "participants": r.get("participants", []),
            "averaged": r.get("averaged"),
            "duration_s": r.get("duration_s"), "allreduce_s": r.get("allreduce_s"),
            "bytes": sent + received if sent is not None and received is not None else None,
            "epoch": r.get("epoch"),
            "fraction_averaged": r.get("fraction_averaged"), "error": r.get("error", ""),
            "loss_before": r.get("loss_before"), "loss_after": r.get("loss_after"),
            "verify_s": r.get("verify_s"), "audit_s": r.get("audit_s"),
            "train_query_s": r.get("train_query_s"),
            "outcomes": {str(m["uid"]): m["outcome"] for m in r.get("miners", [])},
            # verified samples per checked miner: what its steps score (and pay) follows
            "credited": {str(m["uid"]): m.get("credited") for m in r.get("miners", [])},
            # the checked miners' notes, and why the round caught an unchecked one
            "notes": {**{uid: f"not checked this round: {why}" for uid, why in r.get("caught", {}).items()},
                      **{str(m["uid"]): m.get("note", "") for m in r.get("miners", []) if m.get("note")}}}


def _miner_rows(members: list[Member], state: dict,
                weights_by_validator: dict[str, dict[int, float]]) -> tuple[list[dict], float]:
    """(a row per miner: its score, weight and last round, the largest per-miner difference
    between validators' weights)."""
    last_scores = {int(k): v for k, v in state.get("last_scores", {}).items()}
    ema = {int(k): float(v) for k, v in state.get("ema", {}).items()}
    # what weights are computed from: the EMA divided by its mass (dtrain.validation.scoring.EmaState.paid)
    mass = {int(k): float(v) for k, v in (state.get("ema_mass") or {}).items()}
    ema = {uid: v / mass.get(uid, 1.0) if mass.get(uid, 1.0) > 0 else 0.0 for uid, v in ema.items()}
    miners = []
    spread = 0.0
    for member in members:
        if member.role != "miner":
            continue
        s = last_scores.get(member.uid, {})
        # Sandbox validators all hold the same stake, so the consensus weight is the plain mean.
        per_validator = {name: w.get(member.uid, 0.0) for name, w in weights_by_validator.items()}
        values = list(per_validator.values())
        if len(values) > 1:
            spread = max(spread, max(values) - min(values))
        miners.append({"uid": member.uid, "name": member.name, "hotkey": member.hotkey, "kind": member.kind,
                       "score": ema.get(member.uid, 0.0),
                       "weight": sum(values) / len(values) if values else 0.0,
                       "weights_by_validator": per_validator,
                       "last_round": s.get("combined"), "outcome": s.get("outcome"), "gated": s.get("gated", []),
                       "components": {k: s.get(k) for k in ("gradient", "steps", "bandwidth", "participation")}})
    return miners, spread


def _loss_curve(rounds: list[dict]) -> list:
    """The loss before the first round, then after each, numbers only."""
    curve = []
    if rounds:
        curve.append(rounds[0]["loss_before"])
        curve += [r["loss_after"] for r in rounds]
    return [c for c in curve if isinstance(c, (int, float))]


def _verification_times(rounds: list[dict]) -> dict:
    """Seconds spent verifying, auditing and querying Train over the rounds, and verify / Train."""
    verify = sum(r.get("verify_s") or 0 for r in rounds)
    audit = sum(r.get("audit_s") or 0 for r in rounds)
    train = sum(r.get("train_query_s") or 0 for r in rounds)
    return {"verify_s": round(verify, 3), "audit_s": round(audit, 3), "train_query_s": round(train, 3),
            "ratio": round(verify / train, 4) if train else None}


def _validator_view(member: Member, state: dict, chain_weights: dict[int, float]) -> dict:
    rounds = state.get("recent_rounds", []) if isinstance(state.get("recent_rounds"), list) else []
    return {"name": member.name, "uid": member.uid, "hotkey": member.hotkey,
            "round_counter": state.get("round_counter"),
            "statuses": [r.get("status") for r in rounds if isinstance(r, dict)],
            "weights": {str(uid): float(w) for uid, w in sorted(chain_weights.items())}}


def model_parameters(preset: str) -> int | None:
    """The preset's parameter count as the sandbox's neurons build it: the shipped tokenizer's
    vocabulary and positions for the sandbox's sequence length (None if it cannot load)."""
    from dtrain.sandbox.settings import sandbox_scale
    from dtrain.training.models import preset_parameter_count
    from dtrain.training.tokenizer import load_shipped_tokenizer

    try:
        return preset_parameter_count(preset, vocab_size=load_shipped_tokenizer()[1].vocab_size,
                                      n_positions=sandbox_scale(preset).seq_len)
    except Exception:
        return None


def memory_rows(peaks: dict[str, dict], names: list[str]) -> list[dict]:
    """A row per neuron: the peak Pss of its whole process tree and of each process in it
    (neuron, averager, dht, p2pd...), in bytes; each is its own peak, so they need not sum to
    the tree's."""
    rows = []
    for name in names:
        peak = peaks.get(name)
        if peak is not None:
            rows.append({"name": name, "peak_pss": peak["pss"], "processes": dict(sorted(peak["kinds"].items()))})
    return rows
