"""Per-round scoring of miners: pure functions over plain dataclasses.

``score_round`` turns each miner's measurements into gated component scores, ``update_ema``
smooths them per uid, and dtrain.validation.weights turns the EMA into weights. Nothing here
touches the network, the chain, torch or the clock. The formulas and their reasons are in
docs/scoring.md; keep the two in step.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

# The round outcome codes are the swarm's (one enum for the protocol); records.py is plain
# Python, so scoring stays free of torch and hivemind.
from dtrain.config import ValidatorConfig
from dtrain.swarm.records import Outcome


@dataclass(frozen=True)
class MicroBatchCheck:
    """Validator recomputation of one micro-batch the miner reported.

    ``passed`` is the training package's verdict (fingerprint and loss within its
    tolerances); ``similarity`` is the fingerprint similarity in [-1, 1];
    ``loss_rel_err`` is |loss_miner - loss_validator| / |loss_validator|.
    """

    passed: bool
    similarity: float
    loss_rel_err: float


def check_from_comparison(cmp: object, reference_loss: float) -> MicroBatchCheck:
    """Adapt a ``dtrain.training.fingerprint.Comparison`` (duck-typed: ``passed``,
    ``cosine``, absolute ``loss_diff``) and the validator's own loss for that micro-batch.

    Duck typing keeps torch (which the training package imports) out of scoring.
    """
    loss_diff = abs(float(getattr(cmp, "loss_diff")))
    ref = abs(float(reference_loss))
    rel = loss_diff / ref if ref > 1e-12 else (0.0 if loss_diff == 0 else math.inf)
    return MicroBatchCheck(passed=bool(getattr(cmp, "passed")), similarity=float(getattr(cmp, "cosine")), loss_rel_err=rel)


@dataclass(frozen=True)
class TrainCheck:
    """Result of the Train query for one miner in one round.

    ``claimed_samples``: the averaging weight the miner asked for in the round.
    ``verified_samples``: samples the validator can back with verification: the samples of
    the miner's committed work, when its Train answer and its work audits passed
    (``dtrain.validation.verification``). ``work_problem`` is why the committed work did not
    verify ("" when it did, or when nothing was committed to audit).
    """

    checks: Sequence[MicroBatchCheck]
    claimed_samples: int
    verified_samples: int
    work_problem: str = ""


@dataclass(frozen=True)
class MinerRoundInput:
    """Everything measured about one miner in one validation round.

    ``outcome`` is the miner's outcome in the all-reduce round the validator started
    (from the validator's own record of it; an Outcome or its string). A field left as
    None means "not measured this round" (the miner was not selected for that query); it
    is left out of the weighted sum instead of counting as 0. A transfer that was
    attempted and failed must be given as 0.0, not None.
    """

    train: TrainCheck | None = None
    outcome: Outcome | str | None = None
    state_slice_bps: float | None = None
    probation: bool = False  # its work failed an audit in a recent round (dtrain.validation.verification)

    def __post_init__(self) -> None:
        if self.outcome is not None:
            object.__setattr__(self, "outcome", Outcome.parse(self.outcome))


# The ``[validator]`` settings' schema defaults (dtrain.config imports only the standard library).
_VALIDATOR_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ValidatorConfig)}


@dataclass(frozen=True)
class ScoringConfig:
    """Constants of the scoring formulas (see docs/scoring.md for each).

    The weights and the EMA factor an operator can set come from the one config schema
    (``[validator]`` in dtrain.config), so a library default never disagrees with what
    ``dtrain validate`` runs; the other constants are not operator settings.
    """

    w_gradient: float = _VALIDATOR_DEFAULTS["weight_gradient"]
    w_steps: float = _VALIDATOR_DEFAULTS["weight_steps"]
    w_bandwidth: float = _VALIDATOR_DEFAULTS["weight_bandwidth"]
    w_participation: float = _VALIDATOR_DEFAULTS["weight_allreduce"]
    # exp(-loss_rel_err / loss_rel_scale) discounts loss disagreement inside a passing check.
    loss_rel_scale: float = 0.10
    # claimed_samples may exceed verified_samples by at most this factor before the miner
    # is treated as inflating its weight (gated to 0).
    max_claim_ratio: float = 1.10
    # Steps are normalised by max(best credited samples this round, steps_reference).
    steps_reference: float = 0.0
    # Throughput at or below this (bytes/s) scores 0; the log scale starts here.
    bandwidth_floor_bps: float = 125_000.0  # 1 Mbit/s
    # EMA smoothing factor: ema <- (1 - alpha) * ema + alpha * combined.
    ema_alpha: float = _VALIDATOR_DEFAULTS["ema_alpha"]

    @classmethod
    def from_validator(cls, validator_cfg) -> "ScoringConfig":
        """The scoring constants of a ``[validator]`` config section (dtrain.config.ValidatorConfig)."""
        v = validator_cfg
        return cls(w_gradient=v.weight_gradient, w_steps=v.weight_steps, w_bandwidth=v.weight_bandwidth,
                   w_participation=v.weight_allreduce, ema_alpha=v.ema_alpha)

    def __post_init__(self) -> None:
        ws = (self.w_gradient, self.w_steps, self.w_bandwidth, self.w_participation)
        if any(w < 0 or not math.isfinite(w) for w in ws) or sum(ws) <= 0:
            raise ValueError(f"component weights must be finite, >= 0 and not all 0, got {ws}")
        if not 0.0 < self.ema_alpha <= 1.0:
            raise ValueError(f"ema_alpha must be in (0, 1], got {self.ema_alpha}")
        if self.loss_rel_scale <= 0 or self.bandwidth_floor_bps <= 0 or self.max_claim_ratio < 1:
            raise ValueError("loss_rel_scale and bandwidth_floor_bps must be > 0, max_claim_ratio >= 1")


# Reasons a round score was gated to 0; stable strings, shown by `dtrain status`.
GATE_NO_CHECKS = "no_verified_batches"
GATE_VERIFY_FAILED = "verification_failed"
GATE_INFLATED_CLAIM = "inflated_claim"
GATE_WRONG_MODEL = "wrong_model"
GATE_NO_PARTICIPATION = "no_participation"
GATE_WORK_AUDIT = "work_audit_failed"
GATE_PROBATION = "probation"


@dataclass(frozen=True)
class RoundScore:
    """Component scores in [0, 1] (None = not measured) and the gated combination.

    ``combined`` is None when the round says nothing either way about the miner (no Train
    check and no failure seen): its EMA is then left unchanged.
    """

    gradient: float | None
    steps: float | None
    bandwidth: float | None
    participation: float | None
    combined: float | None
    gated: tuple[str, ...] = field(default_factory=tuple)
    credited_samples: int = 0

    def as_dict(self) -> dict:
        return {
            "gradient": self.gradient,
            "steps": self.steps,
            "bandwidth": self.bandwidth,
            "participation": self.participation,
            "combined": self.combined,
            "gated": list(self.gated),
            "credited_samples": self.credited_samples,
        }


def _finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def gradient_score(train: TrainCheck, cfg: ScoringConfig = ScoringConfig()) -> float:
    """Agreement of the miner's reports with recomputation, in [0, 1].

    0 when nothing was recomputed or when any recomputed micro-batch failed: one forged
    micro-batch makes the whole report untrustworthy, so a cheater gets no partial credit.
    Otherwise the mean over checks of clamp(similarity, 0, 1) * exp(-loss_rel_err / scale).
    """
    if not train.checks:
        return 0.0
    total = 0.0
    for c in train.checks:
        if not c.passed or not _finite(c.similarity) or not _finite(c.loss_rel_err):
            return 0.0
        total += min(1.0, max(0.0, c.similarity)) * math.exp(-abs(c.loss_rel_err) / cfg.loss_rel_scale)
    return total / len(train.checks)


def credited_samples(train: TrainCheck | None, verified_ok: bool) -> int:
    """Samples that count for the steps score: verified ones, and only if verification passed."""
    if train is None or not verified_ok:
        return 0
    return max(0, int(train.verified_samples))


def claim_inflated(train: TrainCheck, cfg: ScoringConfig = ScoringConfig()) -> bool:
    """True when the miner claims more samples than verification backs (beyond tolerance)."""
    verified = max(0, int(train.verified_samples))
    claimed = max(0, int(train.claimed_samples))
    return claimed > cfg.max_claim_ratio * verified


def log_throughput_score(bps: float | None, best_bps: float, floor_bps: float) -> float:
    """log(bps / floor) / log(best / floor), clamped to [0, 1]; 0 at or below the floor.

    The log keeps a data-centre link from dwarfing a good home link: each doubling of
    throughput adds the same amount of score.
    """
    if bps is None or not _finite(bps) or bps <= floor_bps:
        return 0.0
    best = max(best_bps, bps)
    if best <= floor_bps:
        return 0.0
    return min(1.0, math.log(bps / floor_bps) / math.log(best / floor_bps))


def participation_score(outcome: Outcome | str) -> float:
    """1 for SUCCESS, 0 for FAIL / NON_PARTICIPATING / NOT_ALIVE / WRONG_MODEL."""
    return 1.0 if Outcome.parse(outcome) is Outcome.SUCCESS else 0.0


def score_round(
    inputs: Mapping[int, MinerRoundInput], cfg: ScoringConfig = ScoringConfig()
) -> dict[int, RoundScore]:
    """Score every miner of one validation round.

    Normalisations (steps, bandwidth) are relative to the best miner of this round, which
    is why this takes all miners at once.
    """
    judged = {uid: _judge(inp, cfg) for uid, inp in inputs.items()}
    credited = {uid: credited_samples(inputs[uid].train, ok) for uid, (_, _, ok) in judged.items()}
    best_steps = max([float(c) for c in credited.values()] + [cfg.steps_reference, 0.0])
    best_slice = max(
        [i.state_slice_bps for i in inputs.values() if i.state_slice_bps is not None and _finite(i.state_slice_bps)]
        + [0.0]
    )
    return {uid: _round_score(inp, judged[uid][0], judged[uid][1], credited[uid], best_steps, best_slice, cfg)
            for uid, inp in inputs.items()}


def _judge(inp: MinerRoundInput, cfg: ScoringConfig) -> tuple[float | None, list[str], bool]:
    """(gradient score, the gates it hit, whether its verified samples are credited) of one miner."""
    gates: list[str] = []
    g: float | None = None
    verified_ok = False
    if inp.train is not None:
        g = gradient_score(inp.train, cfg)
        if not inp.train.checks:
            gates.append(GATE_NO_CHECKS)
        elif g <= 0.0:
            gates.append(GATE_VERIFY_FAILED)
        elif inp.train.work_problem:
            gates.append(GATE_WORK_AUDIT)
        elif claim_inflated(inp.train, cfg):
            gates.append(GATE_INFLATED_CLAIM)
        else:
            verified_ok = True
    if inp.probation:
        gates.append(GATE_PROBATION)
    if inp.outcome is Outcome.WRONG_MODEL:
        # Recomputation was done against *our* model; a peer on another model cannot
        # have produced gradients we can trust, whatever the Train checks said.
        g = 0.0 if inp.train is not None else g
        verified_ok = False
        gates.append(GATE_WRONG_MODEL)
    elif inp.outcome is not None and inp.outcome is not Outcome.SUCCESS:
        gates.append(GATE_NO_PARTICIPATION)
    return g, gates, verified_ok and not inp.probation


def _round_score(inp: MinerRoundInput, gradient: float | None, gates: list[str], credited: int,
                 best_steps: float, best_slice: float, cfg: ScoringConfig) -> RoundScore:
    """One miner's components, normalised by this round's best, and their gated combination."""
    steps = None
    if inp.train is not None:
        steps = credited / best_steps if best_steps > 0 else 0.0
    # Bandwidth is what the validator timed itself: the state-slice download. A miner's
    # own figures for its all-reduce are claims, so they are not scored.
    bandwidth = None
    if inp.state_slice_bps is not None:
        bandwidth = log_throughput_score(inp.state_slice_bps, best_slice, cfg.bandwidth_floor_bps)
    participation = participation_score(inp.outcome) if inp.outcome is not None else None

    combined: float | None
    if gates:
        combined = 0.0
    elif inp.train is None:
        # Positive credit needs a passing Train verification in the same round; without
        # one a lazy miner would earn on bandwidth alone in rounds it was not checked.
        # Negative evidence (the gates above) still counts, so this is "no update".
        combined = None
    else:
        # Pay follows verified work: the components make a quality factor (steps at full
        # credit in it), which the steps fraction then scales. A miner that trained half
        # its batch earns half; one that trained nothing earns nothing, however well it
        # answers challenges or serves bandwidth.
        quality = combine(gradient, 1.0, bandwidth, participation, cfg)
        combined = quality * min(1.0, max(0.0, steps if steps is not None else 0.0))
    return RoundScore(
        gradient=gradient,
        steps=steps,
        bandwidth=bandwidth,
        participation=participation,
        combined=combined,
        gated=tuple(gates),
        credited_samples=credited,
    )


def combine(
    gradient: float | None,
    steps: float | None,
    bandwidth: float | None,
    participation: float | None,
    cfg: ScoringConfig = ScoringConfig(),
) -> float:
    """Weighted mean of the measured components (weights renormalised over those present).

    The gates are applied by ``score_round``; this is only the arithmetic. Returns 0 when
    nothing was measured.
    """
    pairs = [
        (cfg.w_gradient, gradient),
        (cfg.w_steps, steps),
        (cfg.w_bandwidth, bandwidth),
        (cfg.w_participation, participation),
    ]
    present = [(w, v) for w, v in pairs if v is not None]
    wsum = sum(w for w, _ in present)
    if wsum <= 0:
        return 0.0
    value = sum(w * min(1.0, max(0.0, v)) for w, v in present) / wsum
    return min(1.0, max(0.0, value))


@dataclass
class EmaState:
    """Smoothed score and owning hotkey per uid.

    ``mass`` is the EMA's weight on the scores it has seen, 1 - (1 - alpha)^n after n scored
    rounds; ``paid()`` divides it out, so a miner's pay is the weighted mean of its verified
    scores however often it was checked (docs/scoring.md, "Sampled checks"). A uid without a
    mass (a state written before it was kept) counts as fully warmed up.
    """

    scores: dict[int, float] = field(default_factory=dict)
    hotkeys: dict[int, str] = field(default_factory=dict)
    mass: dict[int, float] = field(default_factory=dict)

    def paid(self) -> dict[int, float]:
        """uid -> the bias-corrected EMA, what weights are computed from."""
        out = {}
        for uid, score in self.scores.items():
            m = self.mass.get(uid, 1.0)
            out[uid] = min(1.0, score / m) if m > 0 else 0.0
        return out


def update_ema(
    state: EmaState,
    round_scores: Mapping[int, float],
    hotkeys: Mapping[int, str],
    alpha: float = ScoringConfig.ema_alpha,
) -> EmaState:
    """One EMA step; returns a new state, the input is not modified.

    - ``hotkeys`` is the current registration (uid -> hotkey). uids missing from it were
      deregistered and are dropped, scored or not.
    - A uid whose hotkey changed is reset to 0 before the update: a new owner must not
      inherit the previous owner's reputation.
    - A new uid starts from 0, so re-registering gives no head start.
    - A registered uid without a score this round keeps its value (it was not queried;
      an unreachable miner is scored NOT_ALIVE -> 0 by the caller instead).
    - ``mass`` grows with each score the same way, for ``EmaState.paid``.
    """
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"alpha must be in (0, 1], got {alpha}")
    new_scores: dict[int, float] = {}
    new_hotkeys: dict[int, str] = {}
    new_mass: dict[int, float] = {}
    for uid, hk in hotkeys.items():
        prev = state.scores.get(uid, 0.0)
        mass = state.mass.get(uid, 1.0 if uid in state.scores else 0.0)
        if state.hotkeys.get(uid) != hk:
            prev, mass = 0.0, 0.0
        if uid in round_scores:
            x = round_scores[uid]
            x = min(1.0, max(0.0, x)) if _finite(x) else 0.0
            new_scores[uid] = (1.0 - alpha) * prev + alpha * x
            new_mass[uid] = (1.0 - alpha) * mass + alpha
        else:
            new_scores[uid], new_mass[uid] = prev, mass
        new_hotkeys[uid] = hk
    return EmaState(scores=new_scores, hotkeys=new_hotkeys, mass=new_mass)


def forfeit(state: EmaState, uids: Sequence[int]) -> EmaState:
    """The EMA with ``uids`` set to 0: a miner whose committed work failed an audit loses what it
    had earned, so being caught once in a while costs more than the rounds it cheated unseen
    (docs/scoring.md, "Sampled checks")."""
    caught = set(uids)
    return EmaState(scores={uid: (0.0 if uid in caught else v) for uid, v in state.scores.items()},
                    hotkeys=dict(state.hotkeys), mass=dict(state.mass))


def combined_scores(scores: Mapping[int, RoundScore]) -> dict[int, float]:
    """uid -> combined score for the uids the round scored, the input of ``update_ema``."""
    return {uid: s.combined for uid, s in scores.items() if s.combined is not None}
