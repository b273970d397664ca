"""DiLoCo: H local (inner) steps, then one averaged pseudo-gradient and an outer Nesterov step.

Per-step gradient averaging sends the full gradient every optimizer step. DiLoCo sends one
vector of the same size every ``inner_steps`` steps, so bytes per token drop by ~H. Each
peer keeps ``anchor`` = parameters at the last sync. At sync:

    pseudo_grad = anchor - params_now            (what the inner steps moved, sign as a gradient)
    avg = butterfly mean of pseudo_grad          (same GradientSwarm, same cap/validation rules)
    params = anchor; params.grad = avg; outer SGD(lr=0.7, momentum=0.9, nesterov).step()
    anchor = params

Every peer applies the same outer update to the same anchor with the same averaged
pseudo-gradient, so the copies are identical after each sync (outer momentum too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from dtrain.swarm.records import RoundRecord


@dataclass
class DiLoCoConfig:
    inner_steps: int = 500  # H
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True


class DiLoCo:
    """Outer loop around any inner optimizer. Call :meth:`inner_step_done` after each inner step."""

    def __init__(self, params: Sequence[torch.nn.Parameter], swarm, config: Optional[DiLoCoConfig] = None):
        self.params = [p for p in params]
        self.swarm = swarm  # a GradientSwarm built with templates shaped like `params`
        self.config = config or DiLoCoConfig()
        if self.config.inner_steps < 1:
            raise ValueError("inner_steps must be >= 1")
        self.anchor = [p.detach().clone() for p in self.params]
        self.outer_opt = torch.optim.SGD(
            self.params,
            lr=self.config.outer_lr,
            momentum=self.config.outer_momentum,
            nesterov=self.config.nesterov,
        )
        self.inner_steps_since_sync = 0
        self.samples_since_sync = 0
        self.tokens_since_sync = 0
        self.outer_step = 0

    def inner_step_done(self, samples: int, tokens: int = 0, cap: Optional[float] = None) -> Optional[RoundRecord]:
        """Count one inner step; when H are done, run the outer sync and return its record."""
        self.inner_steps_since_sync += 1
        self.samples_since_sync += int(samples)
        self.tokens_since_sync += int(tokens)
        if self.inner_steps_since_sync < self.config.inner_steps:
            return None
        return self.sync(cap=cap)

    @torch.no_grad()
    def pseudo_gradients(self) -> list[torch.Tensor]:
        return [(a - p.detach()).float() for a, p in zip(self.anchor, self.params)]

    def sync(self, cap: Optional[float] = None, weight: Optional[float] = None, **round_kwargs) -> RoundRecord:
        """Average pseudo-gradients with the swarm and take the outer step (even if the round failed:
        a failed round leaves the local pseudo-gradient, i.e. a local outer step)."""
        pseudo = self.pseudo_gradients()
        w = float(self.samples_since_sync if weight is None else weight)
        record = self.swarm.run_round(
            pseudo, weight=w, cap=float(cap if cap is not None else max(w, 1.0)), tokens=self.tokens_since_sync,
            **round_kwargs,
        )
        with torch.no_grad():
            for p, a, g in zip(self.params, self.anchor, pseudo):
                p.copy_(a)
                p.grad = g.to(device=p.device, dtype=p.dtype)
        self.outer_opt.step()
        self.outer_opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for a, p in zip(self.anchor, self.params):
                a.copy_(p.detach())
        self.inner_steps_since_sync = 0
        self.samples_since_sync = 0
        self.tokens_since_sync = 0
        self.outer_step += 1
        return record


def bytes_per_token(records: Sequence[RoundRecord], tokens: Optional[int] = None) -> float:
    """(bytes sent + received) over the rounds / tokens trained (from records unless given)."""
    total_bytes = sum(r.bytes_sent + r.bytes_received for r in records)
    total_tokens = int(tokens if tokens is not None else sum(r.tokens for r in records))
    return float(total_bytes) / total_tokens if total_tokens > 0 else float("nan")
