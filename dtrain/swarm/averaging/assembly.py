"""When a matchmaking leader may form its group before its window ends.

hivemind's leader forms its group when it is full or when its window ends; dtrain's groups are
never "full", so waiting for the window made a round cost ~20 times its all-reduce. A member
without weight (a validator) names the peers it expects under :data:`EXPECT_KEY`, and the
leader forms the group once every name on every member's list is a member
(:func:`ready_to_assemble`). Why a forged list cannot hurt, and how several validators meet:
docs/swarm.md, "How a round works", and docs/protocol.md, "Several validators". Everything here
is a pure function of decoded gathers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence

EXPECT_KEY = "expect"
# A gather may name at most this many peers (hivemind groups are far smaller; a longer list is
# a peer trying to make every leader do work, and is ignored).
MAX_EXPECTED = 4096
# libp2p peer ids in base58 are ~46-53 characters; allow some room for other key types.
MAX_PEER_ID_CHARS = 128


@dataclass(frozen=True)
class MemberClaim:
    """What one group member said about itself in matchmaking, as far as assembly cares."""

    peer_id: str
    weight: Optional[float]  # the claimed weight ``w``; None when absent or not a finite number >= 0
    expect: Optional[frozenset]  # names of peers it waits for; None: no (well-formed) list


def expect_list(peer_ids: Iterable[str]) -> list[str]:
    """The gather value for ``expected_peers``: unique names, sorted (deterministic bytes)."""
    return sorted({str(p) for p in peer_ids})


def claim_from_user_gather(peer_id: str, user: Any) -> MemberClaim:
    """Read a member's decoded user gather (the dict a GradientSwarm puts in ``step(gather=...)``)."""
    if not isinstance(user, dict):
        return MemberClaim(str(peer_id), None, None)
    w = user.get("w")
    weight = float(w) if isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w) and w >= 0 \
        else None
    return MemberClaim(str(peer_id), weight, _parse_expect(user.get(EXPECT_KEY)))


def _parse_expect(value: Any) -> Optional[frozenset]:
    if not isinstance(value, (list, tuple)) or not value or len(value) > MAX_EXPECTED:
        return None  # an empty list expects nobody: no reason to hurry either
    if not all(isinstance(p, str) and 0 < len(p) <= MAX_PEER_ID_CHARS for p in value):
        return None
    return frozenset(value)


def ready_to_assemble(members: Sequence[MemberClaim], min_group_size: int) -> bool:
    """True when the leader may form its group now: a validator-like member (``w == 0``) named
    the peers it expects, and every name on every member's list is a member."""
    present = {m.peer_id for m in members}
    if len(present) < max(1, int(min_group_size)):
        return False
    if not any(m.expect is not None and m.weight == 0.0 for m in members):
        return False
    required = set()
    for m in members:
        if m.expect is not None:
            required |= m.expect
    return required <= present


def lapsed_followers(deadlines: dict[str, float], now: float, request_timeout: float) -> set[str]:
    """Followers a leader must leave out of the group it forms at ``now`` (DHT time).

    A follower waits for its leader's BEGIN until its own request's expiration plus
    ``request_timeout``, then goes on without this group; a leader held up past that must not
    count it in (the group would wait for its parts and blame it). A follower whose deadline is
    within half a ``request_timeout`` (the BEGIN's time on the wire) is left out: it is told the
    group was disbanded, if it still listens (docs/swarm.md, "Measured").

    ``deadlines``: follower -> the expiration its join request named.
    """
    margin = request_timeout / 2
    return {peer for peer, expiration in deadlines.items() if now + margin > expiration + request_timeout}
