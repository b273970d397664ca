"""What a validation round leaves behind: weights on chain, the round's summary (state.json,
`dtrain status`, the sandbox's report) and the dashboard's miner table."""

from __future__ import annotations

import time

from dtrain.telemetry import MinerRow


def set_weights(chain, uid: int, state, neurons, tel) -> dict[int, float]:
    """Compute weights from the EMA and, when the rate limit allows, set them on chain."""
    from dtrain.chain.base import ChainError
    from dtrain.validation.weights import (
        WeightSetPolicy,
        compute_weights,
        record_failure,
        record_success,
        should_set,
    )

    miner_uids = [n.uid for n in neurons if not n.validator_permit]
    weights = compute_weights(state.ema.paid(), miner_uids)
    if not weights:
        return {}
    try:
        status = chain.weights_status(uid)
        block = status.block
        policy = WeightSetPolicy(rate_limit_blocks=status.rate_limit if status.rate_limit is not None else 100)
    except ChainError:
        return weights  # the chain's health shows the outage; weights are set next round
    if should_set(policy, state.weight_set, block):
        uids = sorted(weights)
        try:
            chain.set_weights(uids, [weights[u] for u in uids])
            state.weight_set = record_success(state.weight_set, block)
            tel.event(f"weights set at block {block} for {len(uids)} miners")
        except ChainError as exc:
            state.weight_set = record_failure(policy, state.weight_set, block, str(exc))
            tel.event(f"setting weights failed ({exc}); retrying later")
    return weights


def round_summary(round_no: int, epoch: int, probes, record, scores, weights, ema, *, loss: tuple[float, float],
                  verify_s: float, uids: dict[str, int], caught: dict[int, str] | None = None) -> dict:
    """One round as state.json keeps it. ``miners``: the checked ones, scored; ``averaged``: the uid
    of every miner whose contribution the round's group averaged (SUCCESS, weight > 0), checked or not (``uids``: peer id -> uid);
    ``caught``: uid -> why, for the unchecked miners the round's audits or record caught (not
    scored, put on probation)."""
    rows = []
    for probe in probes:
        s = scores[probe.uid]
        rows.append({"uid": probe.uid, "hotkey": probe.hotkey, "outcome": probe.outcome,
                     "score": s.combined, "credited": s.credited_samples, "ema": ema.paid().get(probe.uid, 0.0),
                     "weight": weights.get(probe.uid, 0.0), "gated": list(s.gated), "note": probe.note,
                     "train_s": round(probe.train_seconds, 3)})
    participants = [r["uid"] for r in rows if r["outcome"] == "SUCCESS"]
    # a member whose weight was capped to 0 (on probation, failed its check) only received
    averaged = sorted(uids[p.peer_id] for p in record.peers
                      if p.peer_id in uids and p.outcome.value == "SUCCESS" and p.weight_used > 0)
    return {
        "round": round_no, "epoch": epoch, "round_id": record.round_id,
        "status": "success" if record.ok else "failed", "participants": participants, "averaged": averaged,
        "duration_s": round(record.duration_s, 3), "allreduce_s": round(record.allreduce_s, 3),
        "bytes_sent": record.bytes_sent, "bytes_received": record.bytes_received,
        "fraction_averaged": record.fraction_averaged, "error": record.error,
        "loss_before": loss[0], "loss_after": loss[1], "verify_s": round(verify_s, 3),
        "train_query_s": round(sum(p.train_seconds for p in probes), 3), "miners": rows,
        "caught": {str(uid): note for uid, note in sorted((caught or {}).items())},
        "time": time.time(),
    }


def miner_rows(state, weights: dict[int, float]) -> list[MinerRow]:
    """The dashboard's miner table: every miner scored so far, with its EMA and weight."""
    rows = []
    for uid, s in sorted(state.last_scores.items()):
        rows.append(MinerRow(uid=uid, hotkey=str(s.get("hotkey", "")), gradient=s.get("gradient"),
                             steps=s.get("steps"), bandwidth=s.get("bandwidth"),
                             allreduce=s.get("participation"), score=s.get("combined"),
                             ema=state.ema.paid().get(uid, 0.0), weight=weights.get(uid, 0.0),
                             last_outcome=str(s.get("outcome", "")), note=", ".join(s.get("gated") or [])
                             or str(s.get("note", ""))))
    return rows
