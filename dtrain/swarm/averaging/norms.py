"""Norms of parts: finiteness and L2 norm in one pass, and the bound an averaged part must respect.

Every check of a part's size uses these: the reducer on what it receives, receivers on what
reducers return, CenteredClip on its inputs, and the caller on its own contribution.
"""

from __future__ import annotations

import math

import torch

# Slack for the norm bounds: the wire codec can make a decoded part a little larger than the
# values sent. 8-bit (codecs.BlockwiseAbsmax8Bit) adds at most eps = 0.031 relative, fp16 2**-11,
# hivemind's codebook quantizers nothing (a codebook of bucket means only shrinks a vector). An
# averaged part passes the codec twice (senders' parts, then the result): (1 + eps)^2 = 1.064 < 1.10.
NORM_SLACK = 1.10


def within_norm(norm: float, bound: float) -> bool:
    """Whether a part (or an average) of L2 norm ``norm`` respects a bound of ``bound``."""
    return norm <= bound * NORM_SLACK + 1e-6


def part_check(part: torch.Tensor) -> tuple[bool, float]:
    """``(all values finite, L2 norm)`` of a part (or any tensor), in one pass over it.

    The sum of squares is taken in the part's own float32 first (BLAS dot: about 4x cheaper
    than a float64 norm, which was a large share of a reducer's CPU per byte). A finite float32
    sum means every value is finite and the norm is good to ~1e-6 relative, far inside
    ``NORM_SLACK``; a NaN, an Inf, or a sum past float32's range (values above ~1e19) falls back
    to the float64 pass, where the sum of squares of float32 values cannot overflow, so the norm
    is finite exactly when every value is. Wider dtypes keep the explicit test. Called in the
    thread that deserialises a part, off the event loop, and by run_round on the contribution.
    """
    flat = part.detach().reshape(-1)
    if flat.dtype == torch.float32:
        squares = float(torch.dot(flat, flat))
        if math.isfinite(squares):
            return True, math.sqrt(squares)
    # float64 accumulation without a float64 copy of the part
    norm = float(torch.linalg.vector_norm(flat, dtype=torch.float64))
    if part.element_size() <= 4:
        return math.isfinite(norm), norm
    return bool(torch.isfinite(flat).all()), norm
