"""Finding peers from the chain: no hard-coded bootstrap address.

Miners commit ``{peer_id, api, repo}``. A commitment is small, so it does not carry
multiaddrs; a node asks each committed miner's public ``GET /v1/status`` for its
current multiaddrs and keeps only those that end in the committed peer id, so a
miner cannot point others at somebody else's node.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable

log = logging.getLogger("dtrain.discovery")


def _status(api: str, timeout: float):
    from dtrain.api.client import ApiError, MinerClient

    try:
        # The validator's hardened client: a total deadline, size caps, strict JSON.
        return MinerClient(None, timeout=timeout).status(api)
    except ApiError as exc:  # unreachable or malformed: this miner simply does not help bootstrap
        log.debug("status of %s failed: %r", api, exc)
        return None


def peer_maddrs(commitments: Iterable, *, exclude_peer: str = "", timeout: float = 3.0) -> list[str]:
    """Multiaddrs of committed miners that answer, each verified against its committed peer id."""
    targets = [c for c in commitments if c.peer_id != exclude_peer]
    if not targets:
        return []
    with ThreadPoolExecutor(max_workers=min(16, len(targets))) as pool:
        docs = list(pool.map(lambda c: _status(c.api, timeout), targets))
    found: list[str] = []
    for commitment, doc in zip(targets, docs):
        for maddr in (doc.maddrs or ()) if doc is not None else ():
            if maddr.rstrip("/").endswith("/p2p/" + commitment.peer_id):
                found.append(maddr)
    return found
