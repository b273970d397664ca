"""LAMB optimizer (You et al., 2019, "Large Batch Optimization for Deep Learning").

Adam moments, then a per-tensor trust ratio ||w|| / ||update|| scales the step, so
every layer moves by a similar relative amount. That keeps 32k-64k global batches
stable, which the subnet's roadmap asks for.
"""

from __future__ import annotations

import torch
from torch.optim import Optimizer


class Lamb(Optimizer):
    """LAMB with decoupled weight decay inside the trust-ratio update.

    update = m_hat / (sqrt(v_hat) + eps) + weight_decay * w
    w     -= lr * trust * update,  trust = ||w|| / ||update|| (1 when either norm is 0)
    ``max_trust`` caps the ratio (tiny updates on large weights would otherwise get a
    huge multiplier); ``bias_correction`` follows Adam.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        bias_correction: bool = True,
        max_trust: float = 10.0,
    ):
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError("lr, eps and weight_decay must be non-negative")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"betas must be in [0, 1): {betas}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, max_trust=max_trust)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                if g.is_sparse:
                    raise RuntimeError("Lamb does not support sparse gradients")
                state = self.state[p]
                if not state:
                    # step is a tensor like torch's own optimizers keep it, so state_dict round-trips
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                step = float(state["step"])
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                if group["bias_correction"]:
                    bc1, bc2 = 1 - beta1**step, 1 - beta2**step
                else:
                    bc1 = bc2 = 1.0
                update = (m / bc1) / ((v / bc2).sqrt_().add_(group["eps"]))
                if group["weight_decay"]:
                    update.add_(p, alpha=group["weight_decay"])
                w_norm = torch.linalg.vector_norm(p.float())
                u_norm = torch.linalg.vector_norm(update.float())
                trust = torch.where(
                    (w_norm > 0) & (u_norm > 0),
                    (w_norm / u_norm).clamp(max=group["max_trust"]),
                    torch.ones_like(w_norm),
                )
                p.add_(update * trust.to(update.dtype), alpha=-group["lr"])
        return loss
