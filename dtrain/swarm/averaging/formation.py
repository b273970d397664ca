"""Group formation: when a leader forms its group early, and the plan of a formed group's round.

Matchmaking asks :class:`EarlyAssembly` after each accepted follower (assembly.py has the
rule); a formed group's gathers become a :class:`RoundPlan` (the group rules, the work
commitments, the load-balanced shares, the part layout), or a :class:`SitOut` when this peer
is at another epoch than its group. Every mechanism of the round reads the plan; none changes it.
"""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass
from typing import Any, Optional

import torch

from dtrain.swarm.averaging import group_rules
from dtrain.swarm.averaging.assembly import claim_from_user_gather, ready_to_assemble
from dtrain.swarm.averaging.claims_tree import ClaimsTree
from dtrain.swarm.averaging.contribution import PartLayout, binding_rtol
from dtrain.swarm.hivemind_internals import Group, load_balance


class EarlyAssembly:
    """A leader's "every expected peer is in" (assembly.ready_to_assemble). Each member's claim is
    decoded once while its request (or our own step) is the same object: a group of n would
    otherwise decode n gathers on each of n joins."""

    def __init__(self):
        self._claims: dict = {}  # member -> (its request, its claim)

    def ready(self, members, min_group_size: int) -> bool:
        cache, claims, present = self._claims, [], set()
        for peer, token, user_gather in members:
            hit = cache.get(peer)
            if hit is None or hit[0] is not token:
                hit = cache[peer] = (token, claim_from_user_gather(peer, user_gather()))
            claims.append(hit[1])
            present.add(peer)
        for peer in [p for p in cache if p not in present]:
            del cache[peer]
        return ready_to_assemble(claims, min_group_size)


@dataclass(frozen=True)
class OwnCommitment:
    """What this peer committed this step and kept out of its gather (the group sees the root)."""

    claims: Any = None  # float32 [num_parts, k]
    digests: Optional[bytes] = None  # 32 bytes per part


@dataclass(frozen=True)
class SitOut:
    """This peer sits the round out (``reason``); ``rules`` are the group rules' verdicts."""

    rules: group_rules.GroupPlan
    reason: str


@dataclass(frozen=True, eq=False)
class RoundPlan:
    """One formed group's round from this peer's view (all peer indices in hivemind's order)."""

    group_id: bytes
    rules: group_rules.GroupPlan  # the group rules' verdicts, commitments applied
    layout: PartLayout  # hivemind's parts of the vector, in order
    parts_by_peer: tuple[int, ...]  # how many of those parts each member reduces
    peer_fractions: tuple
    compression: Any  # the wire codec (hivemind object)
    compression_name: str  # its setting (allreduce.compression)
    own_tree: Optional[ClaimsTree]  # our claims and part digests; None: we committed none
    reducer_rules: dict  # reducer index -> (the weight it gives each sender, whether it clips)
    sender_timeout: float

    @property
    def round_id(self) -> str:
        return self.group_id.hex()

    @property
    def me(self) -> int:
        return self.rules.me

    @functools.cached_property
    def sender_ids(self) -> list[str]:
        return [self.rules.peer_ids[i] for i in self.rules.senders]

    @functools.cached_property
    def my_sender_index(self) -> Optional[int]:
        mine = self.rules.peer_ids[self.me]
        return self.sender_ids.index(mine) if mine in self.sender_ids else None

    @property
    def num_senders(self) -> int:
        return len(self.sender_ids)

    def share_of(self, peer_index: int) -> tuple[int, int]:
        """The global part indices ``[first, end)`` that member ``peer_index`` reduces."""
        first = sum(self.parts_by_peer[:peer_index])
        return first, first + self.parts_by_peer[peer_index]

    @property
    def own_share(self) -> range:
        return range(*self.share_of(self.me))

    def piece(self, tensors, part: int) -> torch.Tensor:
        """The view of global part ``part`` in ``tensors`` (the averaged tensors; writes go through)."""
        param_index, start, length = self.layout.parts[part]
        return tensors[param_index].view(-1)[start:start + length]

    def commitment_of(self, sender_index: int):
        """Sender ``sender_index``'s parsed Commitment (None: it committed none, or we check none)."""
        commitments = self.rules.sender_commitments
        return None if commitments is None else commitments[sender_index]

    @functools.cached_property
    def committed(self) -> list[bool]:
        """Per sender, whether it committed (its claims are owed to every receiver)."""
        return [self.commitment_of(i) is not None for i in range(self.num_senders)]

    @property
    def checks_accounts(self) -> bool:
        """Reducers' accounts are checked: with required commitments only, where every weighted
        contribution has claims to check an account against."""
        return bool(self.rules.mine.get("req")) and self.rules.commitments is not None

    @property
    def reducers_account(self) -> bool:
        """Reducers head their replies with the senders' claims (from the gathers: every peer agrees)."""
        return any(self.rules.senders_with_claims)

    @property
    def account_rtol(self) -> float:
        """The wire codec's binding tolerance (contribution.binding_rtol)."""
        return binding_rtol(str(self.rules.mine.get("comp", "none")))


async def plan_round(group: Group, io, *, own: OwnCommitment, report_type, layout: PartLayout,
                     compression_name: str) -> RoundPlan | SitOut:
    """The group rules over the gathers, the commitments (parsed with ``report_type``, the swarm's
    work report class), and the load-balanced shares of the butterfly."""
    loop = asyncio.get_event_loop()
    rules = group_rules.plan_group(group.peer_ids, group.me, group.users, group.roles)
    if isinstance(rules.mine.get("commit"), dict):
        commitments, unbound = await loop.run_in_executor(
            None, group_rules.check_commitments, group.users, rules.mine, rules.compatible, rules.claimed, report_type)
        group_rules.apply_commitments(rules, commitments, unbound)
    reason = group_rules.out_of_step(rules)
    if reason:
        return SitOut(rules, reason)
    fractions = await loop.run_in_executor(None, load_balance, io.total_size,
                                           rules.download_bandwidths(group.bandwidths), group.min_vector_size)
    committed = bool(rules.committed[rules.me]) and own.claims is not None
    return RoundPlan(
        group_id=group.group_id, rules=rules, layout=layout, parts_by_peer=layout.split(fractions),
        peer_fractions=tuple(fractions), compression=group.compression, compression_name=compression_name,
        own_tree=ClaimsTree(own.claims, own.digests) if committed else None,
        reducer_rules=group_rules.reducer_rules(rules, group.users),
        sender_timeout=float(group.runner_kwargs.get("sender_timeout") or 0.0))
