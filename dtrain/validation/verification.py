"""What each piece of evidence about a miner means, decided once, as pure functions: a Train
answer, the weight caps, which committed pages or DiLoCo steps are audited and the work verdict,
probation, stale evidence from another validator's round, and the scoring input.

``dtrain.validation.round_rules`` calls these; they call ``dtrain.validation.scoring`` and read
``dtrain.swarm.records`` (the outcome codes), never the other way round. docs/scoring.md and
docs/protocol.md explain the rules. Nothing here imports torch, the network or the clock
(tests/test_validation_verification.py).
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from dtrain.swarm.records import Outcome
from dtrain.validation.scoring import MicroBatchCheck, MinerRoundInput, TrainCheck

# ------------------------------------------------------------------ the Train challenge

def train_passed(checks: Sequence[MicroBatchCheck], *, shared_peer_id: bool = False) -> bool:
    """A Train answer verified: something was recomputed and every recomputed micro-batch passed,
    and the miner's peer id is its own (a peer id committed by several hotkeys cannot be told apart)."""
    return bool(checks) and all(c.passed for c in checks) and not shared_peer_id


def in_sync_problem(answer_epoch: int, our_epoch: int, replica_distance: float | None) -> str:
    """"" when a Train answer can be verified against our replica, else why not: another epoch,
    or a state slice beyond the replica tolerance (dtrain.training.replica)."""
    from dtrain.training.replica import REPLICA_RTOL, within_tolerance

    if answer_epoch != our_epoch:
        return f"out of sync (epoch {answer_epoch}, ours {our_epoch})"
    if replica_distance is not None and not within_tolerance(replica_distance):
        return f"out of sync (parameters {replica_distance:.2g} from ours, replica tolerance {REPLICA_RTOL:g})"
    return ""


def answer_problem(got: int, expected: int) -> tuple[str, list[MicroBatchCheck]]:
    """A Train answer with the wrong number of micro-batches is one failed check, not "unchecked"."""
    if got == expected:
        return "", []
    return f"expected {expected} micro-batches, got {got}", [MicroBatchCheck(False, 0.0, math.inf)]


def choose_recomputed(count: int, fraction: float, rng: random.Random) -> list[int]:
    """Which of ``count`` reported micro-batches to recompute: ``ceil(fraction x count)`` (at
    least one), drawn from the validator's secret. Were the choice derivable from the nonce, a
    cheater could compute exactly those micro-batches honestly and fabricate the rest."""
    if count <= 0:
        return []
    return sorted(rng.sample(range(count), min(count, max(1, math.ceil(fraction * count)))))


def weight_caps(verified: dict[str, bool], cap: float) -> dict[str, float]:
    """peer id -> the weight the round may give it: ``cap`` if its Train answer verified, else 0."""
    return {peer: (float(cap) if ok else 0.0) for peer, ok in verified.items()}


# ------------------------------------------------------------------ work audits

@dataclass(frozen=True)
class PageAudit:
    """The recomputation of one committed page."""

    page: int
    counter: int
    passed: bool
    cosine: float
    norm_ratio: float
    loss_diff: float
    reasons: tuple[str, ...] = ()


@dataclass(frozen=True)
class WorkVerdict:
    """What the validator concluded about a miner's committed work this round.

    ``problem`` is "" when the work verified; ``credited_samples`` are then the committed
    samples (all of them: the audited pages stand for the rest, see docs/scoring.md), else 0.
    """

    committed_samples: int
    audits: tuple[PageAudit, ...] = field(default_factory=tuple)
    problem: str = ""

    @property
    def passed(self) -> bool:
        return not self.problem

    @property
    def credited_samples(self) -> int:
        return self.committed_samples if self.passed else 0


NOT_COMMITTED = WorkVerdict(committed_samples=0, problem="no work committed in the round")


def choose_audit_pages(num_pages: int, count: int, rng: random.Random) -> list[int]:
    """Indices of the committed pages to recompute: ``count`` distinct ones, uniformly.

    ``rng`` must be seeded from the validator's secret, drawn after the commitment; a miner
    that could predict the choice would compute exactly those pages honestly.
    """
    if num_pages <= 0 or count <= 0:
        return []
    return sorted(rng.sample(range(num_pages), min(count, num_pages)))


def batch_audit_chance(probability: float, committed_samples: int, reference_samples: int) -> float:
    """The chance of recomputing a miner's whole committed batch this round: ``probability`` for
    a batch of up to ``reference_samples`` (a local batch), less in proportion beyond it. A
    miner that trains continuously commits as much as its hardware trains in a round; the
    validator's expected cost per miner stays ``probability x reference_samples`` samples, a
    falling share of that miner's work (docs/scoring.md, "What a validator recomputes")."""
    if committed_samples <= reference_samples or committed_samples <= 0:
        return probability
    return probability * reference_samples / committed_samples


def check_page_ids(pages: Sequence, expected_page: Callable[[int], int]) -> str:
    """"" when every committed page is the miner's own page for its counter, else the problem.

    ``pages`` are PageWork entries (``page``, ``counter``); ``expected_page(counter)`` is the
    assignment (``assign_pages(run, uid, epoch, counter)``). Counters must increase: a page
    cannot be committed twice.
    """
    last = -1
    for p in pages:
        if p.counter <= last:
            return f"page counter {p.counter} repeats or goes back"
        last = p.counter
        want = expected_page(p.counter)
        if p.page != want:
            return f"page {p.page} committed for counter {p.counter} is not this miner's (expected {want})"
    return ""


def judge_work(report, id_problem: str, audits: Sequence[PageAudit], *, expected_epoch: int) -> WorkVerdict:
    """The work verdict: committed for this epoch, the pages the miner's own, every audit passed."""
    committed = int(report.samples)
    if report.epoch != expected_epoch:
        return WorkVerdict(committed, tuple(audits), f"work committed for epoch {report.epoch}, not {expected_epoch}")
    if id_problem:
        return WorkVerdict(committed, tuple(audits), id_problem)
    for a in audits:
        if not a.passed:
            why = "; ".join(a.reasons) or "recomputation differs"
            return WorkVerdict(committed, tuple(audits), f"committed page {a.page} failed its audit ({why})")
    return WorkVerdict(committed, tuple(audits))


def page_audit(entry, comparison) -> PageAudit:
    """Adapt a ``dtrain.training.fingerprint.Comparison`` of one committed page (duck-typed)."""
    return PageAudit(page=entry.page, counter=entry.counter, passed=bool(comparison.passed),
                     cosine=float(comparison.cosine), norm_ratio=float(comparison.norm_ratio),
                     loss_diff=float(comparison.loss_diff), reasons=tuple(comparison.reasons))


# ------------------------------------------------------------------ DiLoCo trajectories

# A snapshot's sketches describe the very float32 values it serves: only float64 summation
# order separates the miner's from ours.
SNAPSHOT_RTOL = 1e-9
# The moments a replay ends with against the next snapshot's commitment: honest replicas
# differ by rounding (another AdamW kernel: ~1e-7 relative); made-up moments by order one.
MOMENTS_RTOL = 1e-3


def choose_replay_segment(num_steps: int, every: int, rng: random.Random) -> tuple[int, int] | None:
    """The stretch of a DiLoCo trajectory a validator replays: ``(first, last)``, the steps
    ``first + 1 ... last`` between two consecutive snapshots (the last stretch may be shorter),
    chosen uniformly among the stretches.

    A whole stretch is replayed so that its end can be compared with the next snapshot's
    committed moments: that is what makes a snapshot's optimizer state evidence rather than
    a claim. A trajectory with k made-up steps is caught with probability at least k / steps.
    ``rng`` is seeded from the validator's secret after the gather, as for page audits.
    """
    if num_steps <= 0 or every <= 0:
        return None
    first = rng.randrange(0, num_steps, every)
    return first, min(first + every, num_steps)


def trajectory_shape_problem(report, *, inner_steps: int, page_sequences: int) -> str:
    """"" when a trajectory is the right size for the swarm's settings, else the problem."""
    if len(report.steps) > inner_steps:
        return f"commits {len(report.steps)} inner steps, more than allreduce.diloco_inner_steps = {inner_steps}"
    for i, s in enumerate(report.steps, start=1):
        if s.samples > len(s.pages) * page_sequences:
            return f"inner step {i} claims {s.samples} samples from {len(s.pages)} pages"
    return ""


def start_moments_problem(report, remembered, *, epoch: int) -> tuple[str, bool]:
    """Whether a trajectory's start moments are ones it may start from: ``(problem, checked)``.

    The inner AdamW moments are carried from one epoch to the next (fresh moments every epoch
    cost convergence, docs/training.md). A miner may start an epoch from

    * fresh moments (``t0`` = 0): its step-0 snapshot then commits zero sketches; or
    * the moments it committed at the end of the previous epoch, in that round's gather (the
      report's ``carry``, sketched under this epoch's nonce, with the optimizer's step count):
      the step-0 snapshot must commit exactly those sketches and ``t0`` that count.

    Nothing else: made-up start moments could make any replayed update independent of the
    data. ``remembered``: ``(epoch, carry)`` of the last report of this miner this validator
    saw, or None. A validator that has no carry of this miner for the previous epoch (it was
    not in that round, or restarted) cannot check a carried start: ``("", False)``; every
    validator that was there checks it. ``checked`` is True when the start was verified.
    """
    snap0 = report.snapshot_at(0)
    if snap0 is None:  # a trajectory without steps: nothing is replayed from it
        return "", True
    if report.t0 == 0:
        if any(snap0.exp_avg) or any(snap0.exp_avg_sq):
            return "starts from fresh moments (t0 = 0) but commits non-zero moments at step 0", True
        return "", True
    if remembered is None or remembered[0] != epoch - 1:
        return "", False
    carry = remembered[1]
    if carry is None:  # its report of the epoch before had no steps, so nothing to carry
        return f"starts from carried moments, but committed none at the end of epoch {epoch - 1}", True
    if carry.step != report.t0:
        return (f"starts from moments of {report.t0} optimizer steps, but committed {carry.step} at the end of "
                f"epoch {epoch - 1}"), True
    if (sketch_mismatch(carry.exp_avg, snap0.exp_avg, SNAPSHOT_RTOL)
            or sketch_mismatch(carry.exp_avg_sq, snap0.exp_avg_sq, SNAPSHOT_RTOL)):
        return f"start moments are not the ones it committed at the end of epoch {epoch - 1}", True
    return "", True


def sketch_mismatch(claimed: Sequence[float], measured: Sequence[float], rtol: float) -> bool:
    """Whether two sketches of the same values differ beyond ``rtol`` of the larger norm."""
    if len(claimed) != len(measured):
        return True
    num = math.sqrt(sum((a - b) ** 2 for a, b in zip(claimed, measured)))
    den = max(math.sqrt(sum(a * a for a in claimed)), math.sqrt(sum(b * b for b in measured)))
    return num > rtol * den + 1e-30


def step_audit(entry, gradient, update) -> PageAudit:
    """A replayed inner step as a PageAudit (named by its first page): both its gradient's and
    its update's comparisons (``dtrain.training.fingerprint.Comparison``, duck-typed) must pass.
    The figures are the gradient's, the sharper test of the pages."""
    reasons = tuple(f"gradient {r}" for r in gradient.reasons) + tuple(f"update {r}" for r in update.reasons
                                                                       if not r.startswith("loss"))
    return PageAudit(page=entry.pages[0], counter=entry.counters[0], passed=bool(gradient.passed and update.passed),
                     cosine=float(gradient.cosine), norm_ratio=float(gradient.norm_ratio),
                     loss_diff=float(gradient.loss_diff), reasons=reasons)


def judge_trajectory(report, *, expected_epoch: int, problem: str, audits: Sequence[PageAudit],
                     first_step: int = 0) -> WorkVerdict:
    """The work verdict of a DiLoCo trajectory: its shape, pages, snapshot and replayed steps."""
    committed = int(report.samples)
    if report.epoch != expected_epoch:
        return WorkVerdict(committed, tuple(audits), f"work committed for epoch {report.epoch}, not {expected_epoch}")
    if problem:
        return WorkVerdict(committed, tuple(audits), problem)
    for i, a in enumerate(audits, start=first_step + 1):
        if not a.passed:
            why = "; ".join(a.reasons) or "replay differs"
            return WorkVerdict(committed, tuple(audits), f"inner step {i} failed its replay ({why})")
    return WorkVerdict(committed, tuple(audits))


# ------------------------------------------------------------------ probation

# Rounds a miner whose committed work failed its audit is given no weight and no score.
# One uniform audit catches a miner that made up a fraction f of its pages with probability
# f; probation makes being caught cost more than the rounds it got away with.
PROBATION_ROUNDS = 10


def probation_rounds(miners: int, checked: int) -> int:
    """Probation lasts PROBATION_ROUNDS of the miner's own checks: a validator that checks
    ``checked`` of ``miners`` per round sees a miner once every miners/checked rounds, so a
    shorter probation would mostly pass while nobody looks (docs/scoring.md, "Sampled checks")."""
    return PROBATION_ROUNDS * max(1, math.ceil(max(miners, 1) / max(checked, 1)))


# Rounds in a row a validator may leave unscored as overtaken; after that it scores anyway, so
# neither misfortune nor miners answering with made-up epochs can stall its scoring.
MAX_OVERTAKEN_IN_A_ROW = 3


def overtaken_by(round_averaged: bool, our_epoch: int, answer_epochs: Sequence[int], asked: int,
                 committed_epochs: Sequence[int] = ()) -> int | None:
    """The epoch to catch up to when another validator's round overtook ours, else None.

    Validators run rounds independently. A validator that reached the miners after they had
    averaged this epoch in another validator's round either finds no group of its own (the
    miners then answer its AllReduce query from the next epoch), or lands in the group of a
    later epoch's round (the group's commitments name that epoch, and the swarm sits this
    peer out). Neither is evidence against the miners, so the round is neither scored nor
    counted. Only a round that averaged nothing qualifies, and only when most of the
    ``asked`` miners (not merely of those that answered) say so: one miner, or a few
    claiming some far epoch in their answers, cannot void a round.
    """
    if round_averaged or asked <= 0:
        return None
    later = [e for e in committed_epochs if e > our_epoch]
    if 2 * len(later) > asked:
        # the group was averaging that epoch; its peers are one past it now
        return Counter(later).most_common(1)[0][0] + 1
    nxt = our_epoch + 1
    if sum(1 for e in answer_epochs if e == nxt) * 2 <= asked:
        return None
    return nxt


def moved_on_during_checks(status_epoch: int | None, our_epoch: int, recheck_epoch: int | None) -> bool:
    """The miner was at our epoch when this round's checks began and is at a later one now.

    Validators run rounds on a shared clock but finish them at different times: a validator
    whose checks overlap another validator's all-reduce sees the miners step in the middle of
    them. A Train query answered from the next epoch, or a state slice read after the step, is
    then stale evidence, not evidence against the miner: its replica moved on, it did not drift.
    """
    return (status_epoch == our_epoch and recheck_epoch is not None and recheck_epoch > our_epoch)


def excuse_moved_on(moved_on: bool, outcome: Outcome | str, in_a_row: int, proven: bool = False) -> bool:
    """Whether a miner that moved on during our checks is left unscored this round.

    Only when it also missed our group (an honest miner at the next epoch cannot be in it; one
    that averaged our epoch with us cannot have moved on before we checked it), and at most
    ``MAX_OVERTAKEN_IN_A_ROW`` rounds in a row: a miner answering with made-up epochs after a
    failed check freezes its score for a few rounds at most, and never earns by it.

    A miner our own round refused for what it published at our epoch (``proven``: its
    ``PeerResult.proven``) was in our group at our epoch: if it moved on, it caught up after we
    refused it, and the refusal is evidence, not stale.
    """
    return (moved_on and not proven and Outcome.parse(outcome) is not Outcome.SUCCESS
            and in_a_row <= MAX_OVERTAKEN_IN_A_ROW)


def on_probation(probation: dict[str, int], hotkey: str, round_no: int) -> bool:
    """Whether ``hotkey`` is on probation in round ``round_no``."""
    until = probation.get(hotkey)
    return until is not None and round_no <= until


def update_probation(probation: dict[str, int], failed: dict[str, bool], round_no: int,
                     rounds: int = PROBATION_ROUNDS) -> dict[str, int]:
    """A new probation map: hotkeys whose work failed its audit in ``round_no`` are on
    probation through ``round_no + rounds``; expired entries are dropped."""
    out = {h: until for h, until in probation.items() if until >= round_no}
    for hotkey, caught in failed.items():
        if caught:
            out[hotkey] = max(out.get(hotkey, 0), round_no + rounds)
    return out


# ------------------------------------------------------------------ scoring input

def round_input(*, checks: Sequence[MicroBatchCheck] | None, shared_peer_id: bool, work: WorkVerdict | None,
                claimed_weight: float | None, outcome: Outcome | str | None, slice_bps: float | None,
                probation: bool = False) -> MinerRoundInput:
    """The scoring input for one miner.

    ``checks`` None means the Train query did not reach the point of recomputation for a reason
    that is no evidence either way (the miner was not reachable: scored by its outcome);
    an empty list is a failed Train query (gated). Verified samples are the credited samples
    of the work verdict; the weight claimed in the round is checked against them.
    """
    if checks is None:
        return MinerRoundInput(train=None, outcome=outcome, state_slice_bps=slice_bps, probation=probation)
    passed = train_passed(checks, shared_peer_id=shared_peer_id)
    verdict = work or NOT_COMMITTED
    claimed = claimed_weight if claimed_weight is not None and math.isfinite(claimed_weight) else 0.0
    train = TrainCheck(checks=list(checks) if not shared_peer_id else [],
                       claimed_samples=int(min(max(claimed, 0.0), 2**62)),
                       verified_samples=verdict.credited_samples if passed else 0,
                       work_problem="" if work is None else verdict.problem)
    return MinerRoundInput(train=train, outcome=outcome, state_slice_bps=slice_bps, probation=probation)
