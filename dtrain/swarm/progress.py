"""Global training progress on the DHT (replaces WandB): who is at which epoch, how many samples.

Each peer stores a small record under ``<prefix>_progress`` with its peer id as subkey and a
short expiration, so dead peers drop out on their own. Anyone can read all records and
derive the global epoch (the highest epoch reported) and the samples accumulated toward the
target global batch at that epoch. Records are untrusted input: malformed ones are ignored
and each peer's samples are clipped to the target batch so one liar cannot declare the
batch complete alone.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Optional


@dataclass
class PeerProgress:
    peer_id: str
    epoch: int
    samples_accumulated: int
    samples_per_second: float
    time: float


@dataclass
class GlobalProgress:
    epoch: int
    samples_accumulated: int  # at `epoch`, summed over live peers
    target_batch_size: int
    num_peers: int  # live peers at `epoch`
    samples_per_second: float  # summed over live peers at `epoch`
    eta_s: Optional[float]  # until the target batch is reached (None if nobody is progressing)

    @property
    def ready(self) -> bool:
        return self.samples_accumulated >= self.target_batch_size

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ready"] = self.ready
        return d


def _parse(peer_id: str, value) -> Optional[PeerProgress]:
    if not isinstance(value, dict):
        return None
    try:
        epoch = int(value["epoch"])
        samples = int(value["samples"])
        sps = float(value.get("sps", 0.0))
        ts = float(value.get("time", 0.0))
    except (KeyError, TypeError, ValueError):
        return None
    if epoch < 0 or samples < 0 or not math.isfinite(sps) or sps < 0:
        return None
    return PeerProgress(peer_id, epoch, samples, sps, ts)


class ProgressTracker:
    """Report local progress and read the swarm's, via plain DHT store/get with expiration."""

    def __init__(self, dht, prefix: str, target_batch_size: int, expiration_s: float = 60.0,
                 timeout_s: float = 30.0):
        if target_batch_size <= 0:
            raise ValueError("target_batch_size must be positive")
        self.dht = dht
        # A store or get on a DHT process that died would otherwise block its caller (the
        # neuron's refresher thread) forever; it raises TimeoutError instead.
        self.timeout_s = float(timeout_s)
        self.key = f"{prefix}_progress"
        self.target_batch_size = int(target_batch_size)
        self.expiration_s = float(expiration_s)

    def report(self, epoch: int, samples_accumulated: int, samples_per_second: float = 0.0) -> bool:
        from hivemind.utils.timed_storage import get_dht_time

        value = dict(epoch=int(epoch), samples=int(samples_accumulated), sps=float(samples_per_second), time=time.time())
        return bool(
            self.dht.store(
                self.key,
                subkey=str(self.dht.peer_id),
                value=value,
                expiration_time=get_dht_time() + self.expiration_s,
                return_future=True,
            ).result(timeout=self.timeout_s)
        )

    def peers(self) -> list[PeerProgress]:
        from hivemind.utils.timed_storage import ValueWithExpiration

        found = self.dht.get(self.key, latest=True, return_future=True).result(timeout=self.timeout_s)
        if found is None or not isinstance(found.value, dict):
            return []
        out = []
        for subkey, item in found.value.items():
            if not isinstance(item, ValueWithExpiration):
                continue
            parsed = _parse(str(subkey), item.value)
            if parsed is not None:
                out.append(parsed)
        return out

    def fetch(self) -> GlobalProgress:
        peers = self.peers()
        if not peers:
            return GlobalProgress(0, 0, self.target_batch_size, 0, 0.0, None)
        epoch = max(p.epoch for p in peers)
        current = [p for p in peers if p.epoch == epoch]
        samples = sum(min(p.samples_accumulated, self.target_batch_size) for p in current)
        sps = sum(p.samples_per_second for p in current)
        remaining = max(self.target_batch_size - samples, 0)
        eta = 0.0 if remaining == 0 else (remaining / sps if sps > 0 else None)
        return GlobalProgress(epoch, samples, self.target_batch_size, len(current), sps, eta)

    def is_behind(self, local_epoch: int) -> bool:
        """True when the swarm is ahead of us: the caller should load state from a peer."""
        return self.fetch().epoch > int(local_epoch)
