"""The validator's recomputation of a miner's committed pages (work audits).

Gradients come from ``torch.autograd.grad`` over the same micro-batch split as the miner's
trainer, so neither the model's parameters nor its ``.grad`` change (docs/training.md,
"Work reports").
"""

from __future__ import annotations

import torch

from dtrain.sketch import DEFAULT_K, gradient_sketch
from dtrain.training.fingerprint import Fingerprint
from dtrain.training.trainer import microbatch_gradients, trainable_parameters


def recompute_page_work(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    *,
    nonce: str,
    micro_batch_size: int,
    precision: str = "fp32",
    k: int = DEFAULT_K,
) -> Fingerprint:
    """The validator's audit of one committed page: (loss, work sketch, samples) of its
    sample-summed gradient, split into micro-batches as the miner's trainer splits it.

    Never changes the model's parameters or ``.grad``.
    """
    total, loss_sum, samples = summed_gradients(model, input_ids, micro_batch_size=micro_batch_size,
                                                precision=precision)
    sketch = gradient_sketch(total, nonce, k=k)
    return Fingerprint(loss=loss_sum / max(samples, 1), sketch=tuple(sketch.tolist()), samples=samples)


def summed_gradients(model: torch.nn.Module, input_ids: torch.Tensor, *, micro_batch_size: int,
                     precision: str = "fp32", into: list | None = None) -> tuple[list, float, int]:
    """(sample-summed gradients per trainable parameter, summed loss, samples) of ``input_ids``,
    split into micro-batches as the miner's trainer splits them; added into ``into`` when given
    (a whole committed batch, page by page). Never changes the model's parameters or ``.grad``."""
    dev = next(model.parameters()).device
    params = trainable_parameters(model)
    total: list[torch.Tensor | None] = into if into is not None else [None] * len(params)
    loss_sum, samples = 0.0, 0
    x_all = input_ids.to(dev)
    for start in range(0, x_all.shape[0], micro_batch_size):
        x = x_all[start : start + micro_batch_size]
        loss, grads = microbatch_gradients(model, params, x, precision)
        for i, g in enumerate(grads):
            if g is not None:
                total[i] = g if total[i] is None else total[i].add_(g)
        loss_sum += float(loss) * x.shape[0]
        samples += x.shape[0]
    return total, loss_sum, samples
