"""The decisions that steer one validation round (whom to check, when to follow the swarm or
resynchronise, probation, each miner's verdict), as pure functions of what was measured.

The validator neuron (dtrain/neurons/validation_round.py) does the round's I/O and asks here,
in the order the round runs; what a single piece of evidence means is decided in
``dtrain.validation.verification``, which these functions call (docs/scoring.md). Nothing here
imports torch, the network or the clock (tests/test_validation_round_rules.py).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from dtrain.swarm.records import Outcome, PeerResult
from dtrain.training.replica import within_tolerance
from dtrain.validation.scoring import MicroBatchCheck, MinerRoundInput
from dtrain.validation.verification import (
    MAX_OVERTAKEN_IN_A_ROW,
    PROBATION_ROUNDS,
    WorkVerdict,
    excuse_moved_on,
    on_probation,
    overtaken_by,
    round_input,
    train_passed,
    update_probation,
)

SHARED_PEER_ID_NOTE = "peer id committed by several hotkeys"


# ------------------------------------------------------------------ who is checked

@dataclass(frozen=True)
class Target:
    """A miner chosen for this round, and where to reach it."""

    uid: int
    hotkey: str
    api: str
    peer_id: str
    # Hotkeys that commit the same hivemind peer id cannot be told apart in a round: the copy
    # would inherit the original's outcome, so none of them is trusted.
    shared_peer_id: bool = False


def select_targets(neurons: Sequence, commitments: Mapping, own_hotkey: str, count: int,
                   rng: random.Random, last_checked: Mapping[str, int] | None = None) -> list[Target]:
    """Up to ``count`` miners to check: registered neurons without a validator permit that
    committed an API address and peer id (``neurons``: uid, hotkey, validator_permit;
    ``commitments``: hotkey -> api, peer_id). [] when no miner has committed.

    The miners this validator checked longest ago come first (``last_checked``: hotkey -> round
    it was last checked), ties drawn with ``rng``: every miner is checked once every
    miners/count rounds, so none waits long for its first verified score. Knowing it is next
    gains a miner nothing: the Train query tells it anyway, before the round, and the audits
    of unchecked work are drawn after the round (``later_audits``)."""
    miners = [n for n in neurons if n.hotkey in commitments and not n.validator_permit and n.hotkey != own_hotkey]
    if not miners:
        return []
    peer_ids = Counter(c.peer_id for c in commitments.values())
    last = last_checked or {}
    order = sorted(miners, key=lambda n: (last.get(n.hotkey, -1), rng.random()))
    chosen = order[:min(len(miners), count)]
    return [Target(uid=n.uid, hotkey=n.hotkey, api=commitments[n.hotkey].api, peer_id=commitments[n.hotkey].peer_id,
                   shared_peer_id=peer_ids[commitments[n.hotkey].peer_id] > 1) for n in chosen]


class CheckRotation:
    """Which miners this validator checks next: those checked longest ago (``select_targets``).

    A round counts as a check only once it is scored (``scored``). A round overtaken by another
    validator's, or abandoned, leaves its miners at the front: otherwise a rerun skips them and
    they wait a whole rotation for a verified score, honest or not."""

    def __init__(self) -> None:
        self.last_checked: dict[str, int] = {}  # hotkey -> the round it was last checked in

    def choose(self, neurons: Sequence, commitments: Mapping, own_hotkey: str, count: int,
               rng: random.Random) -> list[Target]:
        return select_targets(neurons, commitments, own_hotkey, count, rng, self.last_checked)

    def scored(self, targets: Sequence[Target], round_no: int) -> None:
        self.last_checked.update({t.hotkey: round_no for t in targets})


def miner_targets(neurons: Sequence, commitments: Mapping) -> dict[str, Target]:
    """Peer id -> Target of every registered miner (no validator permit) that committed."""
    uids = {n.hotkey: n.uid for n in neurons if not n.validator_permit}
    return {c.peer_id: Target(uid=uids[hotkey], hotkey=hotkey, api=c.api, peer_id=c.peer_id)
            for hotkey, c in commitments.items() if hotkey in uids}


def fellow_validators(record, miner_peer_ids: set[str], own_peer_id: str) -> set[str]:
    """The other validators of a round's group: weight-0 members that no miner committed.

    A group forms as soon as every peer its validators named has joined, so a validator that
    names only miners can see the group form before a fellow validator arrives; naming the
    ones met last round keeps them in. One that does not come costs a round the matchmaking
    window once, and is then no longer named (it is not in that round's group).
    """
    return {p.peer_id for p in record.peers
            if p.weight_claimed == 0 and p.peer_id not in miner_peer_ids and p.peer_id != own_peer_id}


# ------------------------------------------------------------------ staying in step with the swarm

def majority_epoch_ahead(status_epochs: Sequence[int | None], our_epoch: int) -> int | None:
    """The later epoch most of the asked miners report, to catch up to; else None.

    ``status_epochs`` has one entry per miner asked (None: no answer, or no epoch in it), so
    silent miners count against following. Without this a validator that fell behind (a
    restart from an older checkpoint, another validator's round) could never verify anyone
    again. Epochs, not digests, are compared: honest replicas on other hardware differ in
    the last bits (docs/scoring.md).
    """
    epochs = Counter(e for e in status_epochs if e is not None)
    if not epochs:
        return None
    epoch, votes = epochs.most_common(1)[0]
    return epoch if epoch > our_epoch and votes * 2 > len(status_epochs) else None


class Drift(NamedTuple):
    far: int  # miners beyond the replica tolerance from us
    measured: int  # miners whose distance counts


def drifted_alone(replica_distances: Sequence[float | None], moved_on: Sequence[bool], *,
                  in_step: bool = False) -> Drift | None:
    """Most miners (at least two measured) are beyond the replica tolerance from us: at the same
    epoch, that makes this replica the one that drifted, to be resynchronised from a peer.

    One entry per miner. A miner that stepped while we read its slice (``moved_on``) did not
    drift, and neither did we: it does not count. ``in_step``: our replica holds the result of
    our last round, applied whole; every SUCCESS member of that round holds the same bits, so
    the few checked miners that differ are the stale ones, never us. None when we did not
    drift alone.
    """
    if in_step:
        return None
    measured = [d for d, moved in zip(replica_distances, moved_on, strict=True) if d is not None and not moved]
    far = sum(1 for d in measured if not within_tolerance(d))
    return Drift(far, len(measured)) if len(measured) >= 2 and far * 2 > len(measured) else None


def live_miners(progress: Sequence, miner_peer_ids: set[str], epoch: int) -> set[str]:
    """The committed miners whose progress on the DHT shows ``epoch``: those that join the round
    now, checked or not. A validator names them all, so the group waits for each of them (a
    dead one costs one matchmaking window until its record expires; docs/protocol.md)."""
    return {p.peer_id for p in progress if p.peer_id in miner_peer_ids and p.epoch == epoch}


def later_audits(members: Sequence[str], checked: set[str], count: int, rng: random.Random) -> list[str]:
    """Up to ``count`` members of the round's group that this validator did not check, drawn
    after the round with ``rng``: their committed work is audited all the same, so a miner
    cannot cheat whenever it was not asked (docs/scoring.md, "Sampled checks"). ``members``:
    those that trained on our replica (our last round averaged them and us, whole): a miner on
    another replica (a catch-up, a split group) would fail the recomputation through no fault
    of its own."""
    unchecked = sorted(set(members) - checked)
    return rng.sample(unchecked, min(count, len(unchecked)))


# ------------------------------------------------------------------ what a miner's answers mean

def swarm_settings_problem(theirs: str | None, ours: str) -> str:
    """Why a miner's work cannot be verified here: its swarm fingerprint (pages, model or optimizer
    step) differs from ours, and the all-reduce will refuse it as WRONG_MODEL. "" when it matches
    or the miner did not say."""
    if theirs is None or theirs == ours:
        return ""
    return (f"swarm-wide settings differ from this validator's (swarm fingerprint {theirs[:12]}, "
            f"ours {ours[:12]}; docs/configuration.md)")


def answers_look_stale(our_epoch: int, *, status_epoch: int | None, shared_peer_id: bool, train_epoch: int | None,
                       train_failed: bool, replica_distance: float | None) -> bool:
    """Whether to ask a miner again where it is: it was at our epoch at the round's start, yet its
    Train query failed or came from another epoch, or its state slice is beyond the replica
    tolerance. One that has stepped since was averaged by another validator's round in the
    middle of our checks, which makes those answers stale rather than wrong
    (``verification.moved_on_during_checks``).

    ``train_epoch`` is the epoch of its Train answer (None: no answer); ``train_failed`` that
    the query was sent and failed.
    """
    if status_epoch != our_epoch or shared_peer_id:
        return False
    train_off = (train_epoch is None and train_failed) or (train_epoch is not None and train_epoch != our_epoch)
    slice_off = replica_distance is not None and not within_tolerance(replica_distance)
    return train_off or slice_off


def may_contribute(checks: Sequence[MicroBatchCheck], *, shared_peer_id: bool, probation: Mapping[str, int],
                   hotkey: str, round_no: int) -> bool:
    """The weight cap is what we verified: a miner whose Train answer failed, or whose committed
    work failed an audit recently, gets no weight in the all-reduce at all."""
    return train_passed(checks, shared_peer_id=shared_peer_id) and not on_probation(probation, hotkey, round_no)


# ------------------------------------------------------------------ after the all-reduce

def skip_overtaken(*, round_averaged: bool, our_epoch: int, answer_epochs: Sequence[int], asked: int,
                   committed_epochs: Sequence[int], in_a_row: int) -> tuple[int | None, int]:
    """(the epoch to catch up to, leaving this round unscored; None to score it) and the new count
    of rounds overtaken in a row (``in_a_row`` is the count before this round).

    Another validator's round that ran without us is no evidence against the miners
    (``verification.overtaken_by``), but after ``MAX_OVERTAKEN_IN_A_ROW`` such rounds in a row
    this one is scored anyway, so neither misfortune nor made-up epochs can stall scoring.
    """
    overtaken = overtaken_by(round_averaged, our_epoch, answer_epochs, asked=asked, committed_epochs=committed_epochs)
    in_a_row = in_a_row + 1 if overtaken is not None else 0
    return (overtaken if overtaken is not None and in_a_row <= MAX_OVERTAKEN_IN_A_ROW else None), in_a_row


def probation_update(probation: Mapping[str, int], work: Mapping[str, WorkVerdict | None],
                     round_no: int, rounds: int = PROBATION_ROUNDS,
                     refused: frozenset[str] | set[str] = frozenset()) -> tuple[dict[str, int], dict[str, str]]:
    """The probation map after this round's audits (``work``: hotkey -> its verdict, None when
    nothing was audited; ``refused``: hotkeys the round refused for what they published, which
    is as proven as a failed audit), and a note for each audited hotkey still on probation from
    an earlier round (one caught now already has its problem as its note)."""
    failed = {hotkey: (verdict is not None and not verdict.passed) or hotkey in refused
              for hotkey, verdict in work.items()}
    after = update_probation(dict(probation), failed, round_no, rounds)
    notes = {hotkey: f"on probation until round {after[hotkey]} (an audit or a round proved it cheated)"
             for hotkey, caught in failed.items() if hotkey in after and not caught}
    return after, notes


def moved_on_streak(previous: int, moved_on: bool) -> int:
    """Rounds in a row a miner has moved on during our checks, this one included (0: it did not)."""
    return previous + 1 if moved_on else 0


def round_outcome(result: PeerResult | None, reachable: bool) -> Outcome:
    """A miner's outcome: the swarm's, if the round's record has one for its peer id; else
    NOT_ALIVE when it did not answer the status query, NON_PARTICIPATING when it did."""
    if result is not None:
        return result.outcome
    return Outcome.NON_PARTICIPATING if reachable else Outcome.NOT_ALIVE


def miner_note(note: str, outcome: Outcome, swarm_reason: str, *, excused: bool) -> str:
    """The round record's note for a miner: the first problem found; for a miner the round did
    not count, the swarm's reason (e.g. a lost part) if nothing was found before."""
    if outcome != Outcome.SUCCESS and not note:
        note = swarm_reason or "did not join the all-reduce"
    return note + "; not scored this round" if excused else note


@dataclass(frozen=True)
class MinerVerdict:
    """What the round concluded about one miner."""

    outcome: Outcome
    note: str
    moved_on_streak: int
    scoring: MinerRoundInput  # for dtrain.validation.scoring.score_round


def miner_verdict(*, result: PeerResult | None, claimed_weight: float | None, reachable: bool,
                  status_epoch: int | None, our_epoch: int, checks: Sequence[MicroBatchCheck], note: str,
                  moved_on: bool, moved_on_before: int, shared_peer_id: bool, work: WorkVerdict | None,
                  slice_bps: float | None, probation: bool) -> MinerVerdict:
    """A miner's verdict for the round from everything measured about it.

    ``result`` is its entry in the round's record (None: not in it), ``claimed_weight`` the
    weight it announced there (checked against its verified samples); ``reachable`` that
    it answered the status query, from ``status_epoch``; ``our_epoch`` the epoch the round ran
    at; ``moved_on_before`` the rounds in a row it had moved on before this one; ``probation``
    that it is on probation this round. A miner that moved on and missed our group is left
    unscored (``verification.excuse_moved_on``). A reachable miner that did not answer the
    Train challenge, or answered it out of sync, gets an empty check: gated to 0, not "not
    measured"; one ahead of us is not measured; one behind us that missed our group is left
    unscored like one that moved on (it sat a round out). Bandwidth is the state slice this validator
    timed and checked itself: the all-reduce figures in a miner's reply are its own claims.
    """
    outcome = round_outcome(result, reachable)
    # A miner behind our epoch sat the last round out (a restart, a lost part) and is catching
    # up: it is scored on a round it is in, not this one, for a few rounds in a row at most.
    behind = reachable and status_epoch is not None and status_epoch < our_epoch
    streak = moved_on_streak(moved_on_before, moved_on or behind)
    excused = excuse_moved_on(moved_on or behind, outcome, streak, proven=result is not None and result.proven)
    ahead = reachable and (status_epoch or 0) > our_epoch
    measured = not excused and (bool(checks) or (reachable and not ahead))
    scoring = round_input(checks=list(checks) if measured else None, shared_peer_id=shared_peer_id, work=work,
                          claimed_weight=claimed_weight,
                          outcome=None if excused else outcome, slice_bps=slice_bps, probation=probation)
    note = miner_note(note, outcome, result.reason if result else "", excused=excused)
    return MinerVerdict(outcome=outcome, note=note, moved_on_streak=streak, scoring=scoring)
