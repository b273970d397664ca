"""The round report: each member's outcome and the round's figures, from this peer's view.

The averager process builds one :class:`RoundReport` per round, once, at its end (or a
sit-out report), and the caller's GradientSwarm turns it into the RoundRecord
(dtrain/swarm/records.py). Outcomes follow docs/swarm.md, "Failure semantics".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from dtrain.swarm.averaging.group_rules import GroupPlan
from dtrain.swarm.records import Outcome, PeerResult

# What a reducer answers a part for a group it is not in (hivemind's message code): the member
# was counted into this group but never started it.
NOT_IN_GROUP = "BAD_GROUP_ID"


@dataclass
class RoundReport:
    """What the averager process hands the caller about one round (read by name, never guessed)."""

    round_id: str
    group: list[str]  # peer ids, in hivemind's order
    peers: list[PeerResult]
    bytes_sent: int = 0
    bytes_received: int = 0
    fraction_averaged: float = 0.0  # share of the vector that holds a real average
    fraction_refused: float = 0.0  # zeros of a refused reducer (the same on every receiver of its bytes)
    fraction_recovered: float = 0.0  # re-reduced by this peer for a refused reducer (counted as averaged)
    refused: list[str] = field(default_factory=list)  # reducers refused for what they returned
    total_weight: float = 0.0
    allreduce_s: float = 0.0
    result_check_s: float = 0.0
    work_reports: dict = field(default_factory=dict)  # peer id -> its committed work report
    evidence: Any = None  # audit.RoundEvidence, for the validators' round audit; None without accounts
    out_of_step: str = ""  # why this peer sat the round out ("": it took part)


@dataclass
class Verdicts:
    """What the butterfly and the checks after it found, by peer id.

    ``rejected`` / ``too_large`` / ``contradicted``: senders our reducer refused (any reason / a
    part larger than announced / a part contradicting its commitment); ``unproven``: senders
    whose claims for our share did not prove out; ``banned``: senders banned for any reason;
    ``never_started``: senders that never opened a stream to us; ``failed_reducers``: reducer ->
    why its share stayed local; ``sending_failures``: reducer -> why *we* could not send it our
    parts (our fault); ``accused_reducers``: reducer -> how its account wronged our own part;
    ``unconfirmed_reducers``: reducer -> why the result check refused its parts.
    """

    rejected: set = field(default_factory=set)
    too_large: set = field(default_factory=set)
    contradicted: set = field(default_factory=set)
    unproven: set = field(default_factory=set)
    banned: set = field(default_factory=set)
    never_started: set = field(default_factory=set)
    failed_reducers: dict = field(default_factory=dict)
    sending_failures: dict = field(default_factory=dict)
    accused_reducers: dict = field(default_factory=dict)
    unconfirmed_reducers: dict = field(default_factory=dict)


@dataclass
class Figures:
    """The round's sizes (values of the vector), bytes and times."""

    total_size: int = 0
    failed_size: int = 0  # values without an average: local values, or a refused reducer's zeros
    refused_size: int = 0
    recovered_size: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    allreduce_s: float = 0.0
    result_check_s: float = 0.0


def member_outcome(plan: GroupPlan, i: int, v: Verdicts) -> tuple[Outcome, str]:
    """Member ``i``'s outcome and the reason, from this peer's view.

    A member that never sent us anything *and* whose reducer said it is not in this group
    (:data:`NOT_IN_GROUP`) was counted into the group after it had left matchmaking: it is
    NON_PARTICIPATING, not FAIL (both score 0 for the round, so faking it gains nothing).
    """
    peer = plan.peer_ids[i]
    if not plan.compatible[i]:
        return Outcome.WRONG_MODEL, plan.incompatible.get(i, "model fingerprint or tensor schema differs")
    if i in plan.out_of_scale:
        return Outcome.FAIL, f"out-of-scale contribution (norm {plan.norms[i]:.3g})"
    if i in plan.unbound:
        return Outcome.FAIL, plan.unbound[i]
    if i in plan.benched:
        return Outcome.FAIL, "benched: most of the group refused it as a reducer lately (it reduces no share)"
    if i == plan.me:
        if v.sending_failures:
            return Outcome.FAIL, "could not send its parts: " + next(iter(v.sending_failures.values()))
        return Outcome.SUCCESS, ""
    return _remote_outcome(peer, v)


def _remote_outcome(peer: str, v: Verdicts) -> tuple[Outcome, str]:
    if peer in v.contradicted:
        return Outcome.FAIL, "sent a part that contradicts its commitment"
    if peer in v.unproven:
        return Outcome.FAIL, "sent claims that do not match its committed root"
    if peer in v.too_large:
        return Outcome.FAIL, "sent a part larger than its announced norm"
    if peer in v.rejected:
        return Outcome.FAIL, "sent non-finite values"
    if peer in v.never_started and NOT_IN_GROUP in v.failed_reducers.get(peer, ""):
        return Outcome.NON_PARTICIPATING, "counted into the group after it had left matchmaking: it never started this round"
    if peer in v.banned:
        return Outcome.FAIL, "banned as sender (timeout, disconnect or protocol error)"
    if peer in v.unconfirmed_reducers:
        return Outcome.FAIL, v.unconfirmed_reducers[peer]
    if peer in v.accused_reducers:
        return Outcome.FAIL, v.accused_reducers[peer]
    if peer in v.failed_reducers:
        return Outcome.FAIL, "did not deliver its averaged part: " + v.failed_reducers[peer]
    return Outcome.SUCCESS, ""


def refused_for_its_gather(plan: GroupPlan, i: int) -> bool:
    """Member ``i`` was refused on what it published in the gather (out of scale, a weight its
    commitment does not bind), the same on every member; not for a commitment of another epoch,
    which an honest peer that is late or early makes."""
    from dtrain.swarm.averaging.contribution import OTHER_EPOCH

    return plan.compatible[i] and (i in plan.out_of_scale or plan.unbound.get(i, OTHER_EPOCH) != OTHER_EPOCH)


def build_report(plan: GroupPlan, round_id: str, verdicts: Verdicts, figures: Figures, *,
                 refused: Optional[list] = None, evidence: Any = None) -> RoundReport:
    """The report of a round this peer took part in; ``refused``: reducers refused for what they
    returned (named in our next gathers), ``evidence``: what the round audit reads."""
    peers = []
    for i, peer in enumerate(plan.peer_ids):
        outcome, reason = member_outcome(plan, i, verdicts)
        peers.append(PeerResult(peer, outcome, plan.claimed[i], plan.used[i] if outcome == Outcome.SUCCESS else 0.0,
                                reason, proven=refused_for_its_gather(plan, i)))
    total = max(figures.total_size, 1)
    receives = plan.receives
    return RoundReport(
        round_id=round_id, group=list(plan.peer_ids), peers=peers,
        bytes_sent=int(figures.bytes_sent), bytes_received=int(figures.bytes_received),
        fraction_averaged=1.0 - figures.failed_size / total if receives else 0.0,
        fraction_refused=figures.refused_size / total if receives else 0.0,
        fraction_recovered=figures.recovered_size / total if receives else 0.0,
        refused=list(refused or []), total_weight=float(sum(p.weight_used for p in peers)),
        allreduce_s=figures.allreduce_s, result_check_s=figures.result_check_s,
        work_reports=plan.work_reports(), evidence=evidence if receives else None)


def sit_out_report(plan: GroupPlan, round_id: str, reason: str) -> RoundReport:
    """The report of a round this peer sat out: the others give it no share and expect nothing from it."""
    peers = [PeerResult(p, Outcome.FAIL, plan.claimed[i], 0.0, plan.unbound.get(i, ""))
             for i, p in enumerate(plan.peer_ids) if i != plan.me]
    return RoundReport(round_id=round_id, group=list(plan.peer_ids), peers=peers, out_of_step=reason,
                       work_reports=plan.work_reports())
