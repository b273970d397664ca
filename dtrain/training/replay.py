"""Replaying a stretch of a miner's DiLoCo inner steps (the validator's audit).

The validator loads the miner's snapshot into its own inner trainer and takes the committed
steps again, page by page exactly as the miner's trainer did, with the learning rate of the
step's place in the schedule. What it measures per step (loss, update sketch) is compared by
``dtrain.validation.verification.judge_trajectory``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch


@dataclass(frozen=True)
class ReplayedStep:
    step: int  # 1-based index of the inner step within the epoch
    loss: float
    samples: int
    sketch: tuple[float, ...]  # the replayed update's sketch, c_{t-1} - c_t
    grad_sketch: tuple[float, ...]  # the replayed step's sample-summed gradient's sketch


def schedule_position(epoch: int, inner_steps: int, step_index: int) -> int:
    """Where inner step ``step_index`` (0-based) of ``epoch`` sits in the learning-rate schedule.

    A pure function of the epoch, so a validator knows every step's rate without trusting a
    miner's counter, and a miner that did fewer steps last epoch loses none of the schedule.
    """
    return int(epoch) * int(inner_steps) + int(step_index)


def inner_lr_factor(optimizer_step: int, warmup: int) -> float:
    """The inner learning rate's ramp over the first ``warmup`` steps of the inner optimizer's
    life (``optimizer_step``: 0-based, counted since its moments were last fresh): (t + 1) /
    warmup, then 1. Fresh AdamW moments make the first steps sign-sized; the ramp keeps them
    from throwing the parameters off the anchor. Moments carried over from the previous epoch
    need no ramp, so an epoch that starts from them starts at the full rate."""
    if warmup <= 0 or optimizer_step >= warmup:
        return 1.0
    return (int(optimizer_step) + 1) / int(warmup)


def position_inner_lr(trainer, *, epoch: int, inner_steps: int, step_index: int, warmup: int,
                      steps_before: int = 0) -> None:
    """Set ``trainer``'s learning rate for inner step ``step_index`` of ``epoch``: the schedule's
    value at its position, times the ramp. ``steps_before``: the AdamW steps the epoch's start
    moments stand for (the trajectory's ``t0``). The miner and the validator's replay both call this.

    No ramp while the schedule itself still warms up (the run's first ``warmup_steps``): it
    already rises from zero there, and the two ramps multiplied would square the rate
    (docs/training.md, "What each mode costs")."""
    position = schedule_position(epoch, inner_steps, step_index)
    trainer.set_schedule_position(position)
    if position < trainer.config.warmup_steps:
        return
    factor = inner_lr_factor(int(steps_before) + int(step_index), warmup)
    if factor != 1.0:
        for group in trainer.optimizer.param_groups:
            group["lr"] *= factor


def replay_steps(trainer, steps: Sequence, *, first_step: int, epoch: int, inner_steps: int,
                 read_page: Callable[[int], torch.Tensor], nonce: str, k: int, warmup: int = 0,
                 steps_before: int = 0) -> list[ReplayedStep]:
    """Take ``steps`` (InnerStepWork entries, inner steps ``first_step + 1 ...``) on ``trainer``,
    which holds the snapshot taken after ``first_step`` steps of an epoch whose moments started
    at ``steps_before`` AdamW steps. Returns what each step gave."""
    from dtrain.sketch import gradient_sketch

    out = []
    before = gradient_sketch(list(trainer.params), nonce, k=k)
    for i, entry in enumerate(steps):
        index = first_step + i
        trainer.zero_grad()
        for page in entry.pages:
            trainer.accumulate(read_page(page))
        samples = trainer.accumulated_samples
        grad = gradient_sketch(trainer.gradients(), nonce, k=k)
        position_inner_lr(trainer, epoch=epoch, inner_steps=inner_steps, step_index=index, warmup=warmup,
                          steps_before=steps_before)
        metrics = trainer.step()
        after = gradient_sketch(list(trainer.params), nonce, k=k)
        out.append(ReplayedStep(step=index + 1, loss=float(metrics.loss), samples=int(samples),
                                sketch=tuple((before - after).tolist()), grad_sketch=tuple(grad.tolist())))
        before = after
    return out
