"""Cheating miners, for tests and ``dtrain sandbox --adversary KIND``.

Each kind misbehaves in one way the subnet's documents name, so validator
operators can watch the scoring catch it:

- ``lazy``: never trains; fabricates losses and fingerprints.
- ``wrong-model``: trains a different architecture.
- ``copycat``: answers a Train challenge with another miner's answer (the work of
  the neighbouring uid for the same nonce).
- ``freeloader``: trains and answers, but never joins the averaging.
- ``inflated-weight``: claims a huge sample count in the averaging.
- ``poisoner``: sends scaled, noisy gradients into the all-reduce.

They are enabled only by the hidden ``--adversary`` flag of ``dtrain mine``, never
by configuration.
"""

from __future__ import annotations

import hashlib
import random
from typing import Sequence

KINDS = ("lazy", "wrong-model", "copycat", "freeloader", "inflated-weight", "poisoner")

INFLATED_WEIGHT = 1e6
POISON_SCALE = 1000.0


def wrong_model_positions(cfg) -> int:
    """A context length the honest swarm does not use: a different architecture and fingerprint."""
    return max(cfg.model.seq_len, 1) * 2


def copycat_uid(uid: int) -> int:
    return uid - 1 if uid > 0 else uid + 1


def fabricated_fingerprints(samples: int, micro_batch_size: int, nonce: str, last_loss: float | None) -> list:
    """Plausible-looking micro-batch fingerprints computed from nothing."""
    from dtrain.training.fingerprint import DEFAULT_K, Fingerprint

    rng = random.Random(hashlib.sha256(nonce.encode()).digest())
    out = []
    remaining = samples
    base = last_loss if last_loss is not None else 7.5
    while remaining > 0:
        n = min(micro_batch_size, remaining)
        remaining -= n
        out.append(Fingerprint(loss=base + rng.uniform(-0.2, 0.2), sketch=tuple(rng.gauss(0, 1) for _ in range(DEFAULT_K)),
                               samples=n, nonce=nonce))
    return out


def poison(tensors: Sequence) -> list:
    import torch

    generator = torch.Generator().manual_seed(1234)
    return [t * POISON_SCALE + torch.randn(t.shape, generator=generator) * POISON_SCALE for t in tensors]
