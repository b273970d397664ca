"""What every dtrain wire codec does around its arithmetic: a floating-point tensor goes in as
flat float32 values with the shape and dtype name that travel beside the buffer, and the
decoded values come back out in that shape and dtype. Free of hivemind; torch only when called.
"""

from __future__ import annotations

import numpy as np


def flat_float32(tensor, codec: str):
    """``(flat float32 values, shape, dtype name)`` of a floating-point tensor (ValueError naming
    ``codec`` for any other dtype: integer tensors are never averaged)."""
    import torch

    if not torch.is_floating_point(tensor):
        raise ValueError(f"{codec} does not support {tensor.dtype} tensors")
    src = tensor.detach().cpu()
    dtype_name = "bfloat16" if src.dtype == torch.bfloat16 else src.numpy().dtype.name
    return src.reshape(-1).to(torch.float32), tuple(src.shape), dtype_name


def value_count(shape) -> int:
    """How many values a tensor of ``shape`` holds (1 for a scalar's empty shape)."""
    shape = tuple(shape)
    return int(np.prod(shape, dtype=np.int64)) if shape else 1


def restored(values, shape, dtype_name: str):
    """Decoded float32 ``values`` in the sender's shape and dtype (float32 when none was named)."""
    import torch

    dtype = getattr(torch, dtype_name) if dtype_name else torch.float32
    return values.reshape(tuple(shape)).to(dtype)
