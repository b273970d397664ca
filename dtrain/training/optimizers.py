"""The optimizers and the learning-rate schedule a Trainer steps with.

AdamW (fused on CUDA by default), LAMB, or SGD with Nesterov momentum (DiLoCo's outer step);
linear warmup then cosine decay. docs/training.md ("Trainer") lists the options.
"""

from __future__ import annotations

import math

import torch

OPTIMIZERS = ("adamw", "lamb", "nesterov")


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Linear warmup to 1, then cosine decay to min_lr_ratio at total_steps (flat after)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(params, cfg) -> torch.optim.Optimizer:
    """The optimizer ``cfg`` (a trainer.TrainerConfig) names, over ``params``."""
    # Biases, LayerNorm gains and other 1-D tensors are not decayed (standard GPT-2 recipe).
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if cfg.optimizer == "nesterov":
        # DiLoCo's outer optimizer: every peer applies it to the same averaged pseudo-gradient.
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=True)
    if cfg.optimizer == "adamw":
        kw = {}
        fused = torch.device(cfg.device).type == "cuda" if cfg.fused is None else cfg.fused
        if fused:
            kw["fused"] = True
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, **kw)
    from dtrain.training.lamb import Lamb

    return Lamb(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
