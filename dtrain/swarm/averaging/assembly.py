"""When a matchmaking leader may form its group before its window ends.

hivemind's leader forms its group when it is full (``target_group_size`` members) or when
its declared expiration (``min_matchmaking_time`` after it started looking) arrives. dtrain's
groups are never "full": the target is an upper bound, and the real members are the miners
a validator asked to join plus the validators themselves. Waiting for the window made a
round on loopback cost ~20 times its all-reduce.

A validator therefore names the peers it expects (the miners it queried) in its gather,
under :data:`EXPECT_KEY`. The leader forms the group as soon as everyone named is a member
(:func:`ready_to_assemble`); a named peer that never joins (dead, declining, in another
group) leaves the leader on hivemind's own timeout path, which forms the group at the
expiration without it, exactly as before.

Why a forged list cannot hurt (any peer can put anything in its gather):

* Lists are *united*: every well-formed list of every member, miner or not, must be fully
  present. Adding names only delays the group, at worst to the expiration (the old
  behaviour); a hostile member cannot remove an honest validator's names.
* Only a member that brings no weight (``w == 0``: a validator) with a non-empty list can
  *start* an early formation. A weighted miner's list constrains but never triggers, so a
  miner cannot hurry its own group past the validator that would witness it. A hostile
  peer that gives up its weight to claim ``w == 0`` and names only present peers could
  form a group early without a validator that has not joined yet; it gains nothing hivemind
  does not already give it: any peer can declare the earliest expiration, become the
  leader, and (running modified code) form its group whenever it likes.
* Anything malformed (undecodable gather, a list that is not a list of short strings, too
  many names) counts as "no list": it neither triggers nor constrains, which is what the
  sender could have had by sending nothing.

Several validators: the group waits for the union of the lists of the validators *in it*.
One that has not joined yet when the last named miner does is left out (its round is
"overtaken", docs/protocol.md), so a validator should also name the other validators it
knows; validators that ask the same miners and start on the shared round clock join before
the miners they query, which is what the sandbox relies on.

Everything here is a pure function of bytes and names; the averager's ``rpc_join_group``
calls it after each accepted follower (dtrain/swarm/averaging/averager.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

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


def claim_from_gather_bytes(peer_id: str, data: Any, loads: Callable[[bytes], Any]) -> MemberClaim:
    """Decode hivemind's gather (``[bandwidth, mode, user_bytes]``, each layer msgpack) safely.

    ``loads`` is the averager's serializer. Whatever a peer sent, the result is a MemberClaim:
    bytes that do not decode as dtrain's layout give one with neither weight nor list.
    """
    try:
        outer = loads(data)
        if not isinstance(outer, (list, tuple)) or len(outer) != 3 or not isinstance(outer[2], (bytes, bytearray)):
            return MemberClaim(str(peer_id), None, None)
        return claim_from_user_gather(peer_id, loads(bytes(outer[2])))
    except Exception:  # hostile or foreign bytes: msgpack raises several types
        return MemberClaim(str(peer_id), None, None)


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
    ``request_timeout``, then gives up and goes on without this group. hivemind's leader
    forms its group by its own expiration, which is never later than any follower's; but a
    leader whose event loop was held up (a loaded host) can form it later, and then counted
    in members that had already left. The group then waited for their parts, and every
    reducer recorded an honest peer FAIL ("banned as sender") for a hivemind race. A
    follower whose deadline is within half a ``request_timeout`` (the BEGIN's time on the
    wire) is therefore left out: it is told the group was disbanded, if it still listens.

    ``deadlines``: follower -> the expiration its join request named.
    """
    margin = request_timeout / 2
    return {peer for peer, expiration in deadlines.items() if now + margin > expiration + request_timeout}
