"""Accountable reducers: what a reducer states about each part it returns, and the receivers' check.

With each averaged part a reducer sends its *account* (:class:`Account`): the coefficients of
the combination and CenteredClip's radius. A receiver checks the part against the senders'
forwarded claims (sketches are linear), the coefficients against the reducer's own rule, and
that its own part is in (:func:`account_problem`, :func:`own_part_problem`). What is left, a
change in the public sketch's null space, is the result check's (result_check.py).
docs/protocol.md, "Accountable reducers".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from dtrain.swarm.averaging.contribution import ABS_FLOOR, PART_RTOL
from dtrain.sketch import range_sketch


class AccountError(ValueError):
    """A reducer's account for a part is malformed."""


@dataclass(frozen=True)
class Account:
    """How a reducer combined one part: ``result = sum_i coefficients[i] x_i`` over the senders
    (in sender order; 0 for a sender left out), and CenteredClip's radius ``tau`` (0 for a
    mean). It travels with the averaged part, so every receiver can check the part against the
    senders' claims (runner.py, "accountable reducers"; docs/protocol.md)."""

    coefficients: np.ndarray  # float64 [num_senders], >= 0, summing to 1
    tau: float = 0.0

    def to_bytes(self) -> bytes:
        return np.concatenate([[self.tau], self.coefficients]).astype("<f8").tobytes()

    @classmethod
    def from_bytes(cls, data: bytes, num_senders: int) -> "Account":
        if len(data) != 8 * (num_senders + 1):
            raise AccountError(f"an account of {len(data)} bytes, expected {8 * (num_senders + 1)}")
        values = np.frombuffer(data, dtype="<f8")
        tau, coefficients = float(values[0]), values[1:].copy()
        if not (np.isfinite(values).all() and tau >= 0 and (coefficients >= 0).all()):
            raise AccountError("an account with negative or non-finite values")
        if abs(float(coefficients.sum()) - 1.0) > ACCOUNT_SUM_TOL:
            raise AccountError(f"coefficients that sum to {float(coefficients.sum()):.9g}, not 1")
        return cls(coefficients, tau)


# An account's coefficients are float64 ratios of the weights: they sum to 1 far closer than this.
ACCOUNT_SUM_TOL = 1e-9

# A stated clip radius must be at least TAU_FLOOR x min_i D_i, D_i the q-th smallest sketched
# distance from sender i to the senders (q = floor((n + 1) / 2)): what the senders' sketches
# prove of CenteredClip's radius, with room for the sketch's error (docs/protocol.md,
# "Accountable reducers"; tests/test_swarm_accounts.py measures honest radii at 2.3-3.3x it).
TAU_FLOOR = 0.25
# Float slack of the ratio and bound checks (the coefficients are float64 ratios of weights).
RULE_RTOL = 1e-6


def account_problem(part: torch.Tensor, account: Account, claims: Sequence[Optional[np.ndarray]],
                    committed: Sequence[bool], weights: Sequence[float], *, robust: bool,
                    param_index: int, start: int, nonce: str, rtol: float) -> str:
    """"" when an averaged part is what its reducer's account says and the account follows the
    reducer's rule, else why not.

    ``claims``: per sender, its claim for this part (None: not shown); ``committed``: per
    sender, whether it committed (its claims are owed); ``weights``: the weight the reducer
    gives each sender; ``robust``: it runs CenteredClip; ``rtol``: the wire codec's binding
    tolerance (the result crosses the codec once more; 1e-4 without compression). Every
    receiver, a validator too, runs these checks on the same bytes, so all reach the same
    verdict; a failure refuses the reducer. What only a sender can see is
    :func:`own_part_problem`.
    """
    c = account.coefficients
    if len(c) != len(weights):
        return f"sent an account for {len(c)} senders, expected {len(weights)}"
    used = [i for i in range(len(c)) if c[i] > 0]
    if used and not any(committed[i] for i in used):
        # the weight-0 plain mean (nobody with weight sent this part): equal coefficients
        if any(weights[i] > 0 for i in used) or max(c[used]) - min(c[used]) > RULE_RTOL:
            return "gave weight to senders the rule gives none"
        return ""
    missing = [i for i in used if claims[i] is None]
    if missing:
        return f"gave weight to sender(s) {missing} whose claims it did not show"
    k = claims[used[0]].shape[0]
    got = range_sketch(part, param_index, start, nonce, k=k).numpy()
    want, spread = np.zeros(k), 0.0
    for i in used:
        claim = claims[i].astype(np.float64)
        want += c[i] * claim
        spread += c[i] * float(np.linalg.norm(claim))
    err = float(np.linalg.norm(got - want))
    if err > rtol * float(np.linalg.norm(got)) + PART_RTOL * spread + ABS_FLOOR:
        return f"returned a part its account does not explain (sketch error {err / max(spread, ABS_FLOOR):.2g})"
    weighted = [claims[i].astype(np.float64) for i in range(len(c)) if weights[i] > 0 and claims[i] is not None]
    return rule_problem(account, weights, robust=robust, sketches=[claims[i].astype(np.float64) for i in used],
                        weighted_sketches=weighted)


def own_part_problem(part: torch.Tensor, account: Account, weights: Sequence[float], *, robust: bool, me: int,
                     my_part: Callable[[], Optional[torch.Tensor]], rtol: float) -> str:
    """"" unless the account leaves out or down-weights *our* part, which only we can tell.

    A reply for part p comes only after the reducer took our part p, so a sender with weight
    whose coefficient is 0 was dropped; under CenteredClip our coefficient is at least
    ``w_me / sum(w) x min(1, tau / |x_me - r|)`` (the normaliser is at most ``sum(w)``). Only the
    sender itself can run this check, so a failure is recorded (the reducer FAIL in our record)
    but the part is still applied: refusing it would leave us with other values than every
    other receiver, the validators included. ``my_part`` returns our part as the reducer decoded
    it (None: unknown); it is called only when our coefficient is below our fair share
    ``w_me / sum(w)``, the one case where the bound can exceed the coefficient.
    """
    c, tau = account.coefficients, account.tau
    if weights[me] <= 0:
        return ""
    used = [i for i in range(len(c)) if c[i] > 0]
    if c[me] <= 0:
        if robust and tau <= 0 and used and all(weights[i] > 0 for i in used):
            return ""  # a majority sent the very same part (checked by everyone): ours is clipped out
        return "left our part out of the combination"
    if robust and len(used) >= 3 and tau > 0:
        fair = weights[me] / sum(weights)
        if c[me] >= fair * (1 - RULE_RTOL):
            return ""  # at least our fair share: no clip radius can ask for more (a pass less per part)
        # our part only now: with a lossy codec it costs a round trip
        least = fair * min(1.0, tau / max(_my_distance(part, my_part(), rtol), 1e-30))
        if c[me] < least * (1 - RULE_RTOL):
            return f"down-weighted our part ({c[me]:.3g}, the rule gives at least {least:.3g})"
    return ""


def _my_distance(part: torch.Tensor, my_part: Optional[torch.Tensor], rtol: float) -> float:
    """An upper bound on |our part - the reducer's result| from the result as decoded."""
    if my_part is None:
        return math.inf
    r = part.detach().double().reshape(-1)
    return float((my_part.detach().double().reshape(-1) - r).norm()) + rtol * float(r.norm())


def tau_floor(sketches: Sequence[np.ndarray]) -> float:
    """``TAU_FLOOR x min_i D_i``, D_i the q-th smallest sketched distance from sender i to the
    senders (itself included), q = floor((n + 1) / 2): see TAU_FLOOR."""
    n = len(sketches)
    if n == 0:
        return 0.0
    x = np.stack(sketches)
    dist = np.sqrt(np.maximum(((x[:, None, :] - x[None, :, :]) ** 2).sum(-1), 0.0))
    q = (n + 1) // 2
    return TAU_FLOOR * float(np.sort(dist, axis=1)[:, q - 1].min())


def rule_problem(account: Account, weights: Sequence[float], *, robust: bool, sketches: Sequence[np.ndarray],
                 weighted_sketches: Sequence[np.ndarray] = ()) -> str:
    """"" when weighted coefficients follow the rule, else why not: what every receiver (a
    validator too) can check from the claims and the reducer's gather (see the module's docstring).
    ``sketches``: the claims of the senders with a coefficient; ``weighted_sketches``: those of
    every sender with weight whose claims were shown."""
    c, tau = account.coefficients, account.tau
    used = [i for i in range(len(c)) if c[i] > 0]
    if any(weights[i] <= 0 for i in used):
        return "gave weight to senders the rule gives none"
    if robust and tau <= 0 and len(sketches) and len(weighted_sketches) >= 3:
        # clip radius 0: a majority of the weighted senders sent the very same part, the result
        first = sketches[0]
        same = sum(1 for s in weighted_sketches
                   if np.linalg.norm(s - first) <= PART_RTOL * max(np.linalg.norm(first), ABS_FLOOR))
        if same < (len(weighted_sketches) + 1) // 2:
            return "stated no clip radius without a majority of identical parts"
        return ""
    if not robust or len(used) < 3:  # CenteredClip is the weighted mean below three senders
        ratios = [c[i] / weights[i] for i in used]
        if max(ratios) - min(ratios) > RULE_RTOL * max(ratios):
            return "weighted the senders against the rule (a weighted mean)"
        return ""
    if tau <= 0:
        return "stated no clip radius for a clipped combination"
    floor = tau_floor(sketches)
    if tau < floor:
        return f"stated a clip radius {tau:.3g} below what the senders' spread allows ({floor:.3g})"
    return ""
