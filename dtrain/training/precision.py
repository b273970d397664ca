"""Numeric precision of training: fp32, or bf16 autocast where the device supports it.

``"auto"`` is bf16 on CUDA when supported, else fp32 (docs/training.md, "Trainer").
"""

from __future__ import annotations

import contextlib

import torch

PRECISIONS = ("auto", "fp32", "bf16")


def resolve_precision(precision: str, device: torch.device | str) -> str:
    """'fp32' or 'bf16' for this device ('auto': bf16 on CUDA when supported)."""
    dev = torch.device(device)
    if precision == "auto":
        if dev.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            return "bf16"
        return "fp32"
    return precision


def autocast_context(precision: str, device: torch.device | str):
    """bf16 autocast when ``precision`` resolves to bf16 on ``device``, else a context that does nothing."""
    dev = torch.device(device)
    if resolve_precision(precision, dev) == "bf16":
        return torch.autocast(device_type=dev.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
