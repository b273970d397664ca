"""dtrain's rules for a formed group: pure functions of what its members gathered.

Every member of a group receives every member's gather (``make_gather``) and applies these
rules to it, so all peers that agree on the model reach the same verdicts and a hostile member
cannot make two honest ones disagree: the model check (WRONG_MODEL), the weight caps, the
scale check, the work commitments, the bench, and whether this peer sits the round out
(docs/swarm.md, "How a round works"). Roles are plain strings (``node``, ``client``, ``aux``);
hivemind's modes appear only in the wall.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from dtrain.swarm.averaging.assembly import EXPECT_KEY
from dtrain.swarm.codecs import wire_format

GATHER_VERSION = 4
# A member that most of the group refused as a reducer (for what it returned) within this many
# of their rounds reduces no share: it still sends, and is recorded FAIL while benched.
BENCH_ROUNDS = 10
# The gather names at most this many such peers (the most recently refused first).
MAX_REFUSED_NAMED = 64
NODE, CLIENT, AUX = "node", "client", "aux"
# What the caller hands its own averager process in the gather and the averager takes out
# before matchmaking broadcasts it (SwarmAverager.keep_private): this peer's claims, of which
# the group sees only their tree's root (contribution.py).
PRIVATE_KEY = "private"


class BenchList:
    """Peers this peer names as refused reducers in its gathers, each for a number of its rounds
    (the swarm's own refusals, and the round audit's findings a validator passes on)."""

    def __init__(self):
        self._left: dict[str, int] = {}  # peer id -> rounds it is still named

    def name(self, peers, rounds: int) -> None:
        for p in peers:
            self._left[str(p)] = int(rounds)

    def tick(self) -> None:
        """One of our rounds has passed."""
        self._left = {p: n - 1 for p, n in self._left.items() if n > 1}

    def named(self) -> list[str]:
        """The peers named, the longest-named (the latest refused) first."""
        return sorted(self._left, key=lambda p: -self._left[p])


def schema_hash(tensors: Sequence[Any], part_size_bytes: int) -> str:
    """Shapes and dtypes of the averaged tensors, in order (not values), and the part size they
    are split by: peers that split alike, and only they, can check each other's claims, so a
    peer with other parts (another release's rule) is another schema, not a cheat."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(f"{tuple(t.shape)}:{t.dtype};".encode())
    h.update(f"parts:{int(part_size_bytes)};".encode())
    return h.hexdigest()[:32]


def make_gather(*, fingerprint: str, schema: str, weight: float, cap: float, norm: float, max_norm_ratio: float,
                peer_caps: Optional[dict] = None, aggregation: str, compression: str, require_commitments: bool,
                commitment: Optional[dict] = None, claims: Optional[bytes] = None, digests: Optional[bytes] = None,
                expect: Optional[list] = None, refused: Optional[list] = None) -> dict:
    """What this peer tells its group about itself (each key is read by a rule below).
    ``claims`` and ``digests`` (the bytes of the claims and part digests ``commitment`` commits
    to) stay in our averager. ``wire`` names the codec's format and version: peers on another
    one are refused by name at formation (:func:`incompatibility`), never decoded."""
    gather = dict(v=GATHER_VERSION, fp=str(fingerprint), schema=schema, w=float(weight), cap=float(cap),
                  norm=norm, ratio=float(max_norm_ratio),
                  caps={str(k): float(v) for k, v in (peer_caps or {}).items()
                        if isinstance(v, (int, float)) and math.isfinite(v) and v >= 0},
                  agg=aggregation, comp=compression, wire=wire_format(compression), req=bool(require_commitments))
    if commitment is not None:
        gather["commit"] = commitment
    if claims is not None:
        gather[PRIVATE_KEY] = {"claims": claims, "digests": digests}
    if expect:
        # The leader forms the group as soon as all of these joined instead of waiting out its
        # matchmaking window (assembly.py); missing ones cost the window.
        gather[EXPECT_KEY] = expect
    if refused:
        # reducers this peer refused for what they returned, lately (bench_votes)
        gather["ref"] = [str(p) for p in refused[:MAX_REFUSED_NAMED]]
    return gather


def private_claims(private: Any):
    """Our claims [num_parts, k] (float32) from the private part of our gather, or None."""
    import numpy as np

    from dtrain.sketch import WORK_SKETCH_K

    data = private.get("claims") if isinstance(private, dict) else None
    if not isinstance(data, bytes) or not data or len(data) % (4 * WORK_SKETCH_K):
        return None
    return np.frombuffer(data, dtype="<f4").reshape(-1, WORK_SKETCH_K)


def private_digests(private: Any) -> Optional[bytes]:
    """Our parts' digests (claims_tree.part_digest, 32 bytes each) from the private part of our gather."""
    data = private.get("digests") if isinstance(private, dict) else None
    return data if isinstance(data, bytes) and data else None


def scale_check(users, compatible, claimed, ratio: float) -> tuple[list[float], set[int]]:
    """Announced norms, and the peers whose norm is out of scale with the weighted majority.

    The reference is the lower median over compatible peers that bring weight (a validator's
    zeros do not count), so a minority cannot drag it up; with two peers it is the smaller.
    """
    norms = []
    for user in users:
        n = user.get("norm") if isinstance(user, dict) else None
        norms.append(float(n) if isinstance(n, (int, float)) and math.isfinite(n) and n >= 0 else math.inf)
    if ratio <= 0:
        return norms, set()
    weighted = sorted(norms[i] for i in range(len(users)) if compatible[i] and claimed[i] > 0 and norms[i] < math.inf)
    if not weighted:
        return norms, set()
    reference = weighted[(len(weighted) - 1) // 2]
    bad = {i for i in range(len(users)) if compatible[i] and claimed[i] > 0
           and (norms[i] == math.inf or (reference > 0 and norms[i] > ratio * reference))}
    return norms, bad


@dataclass
class GroupPlan:
    """Who does what in a group, from this peer's view (all lists indexed like ``peer_ids``)."""

    peer_ids: list[str]
    me: int
    mine: dict  # this peer's own gather
    roles: list[str]
    claimed: list[float]  # weight each member claimed
    used: list[float]  # weight this peer gives it (capped; 0 once excluded)
    compatible: list[bool]  # same model, tensor schema and wire codec as this peer
    norms: list[float]
    incompatible: dict[int, str] = field(default_factory=dict)  # index -> why it is not compatible
    out_of_scale: set[int] = field(default_factory=set)
    unbound: dict[int, str] = field(default_factory=dict)  # index -> why its commitment was refused
    commitments: Optional[dict] = None  # index -> Commitment; None when this peer runs without them
    # whether each member put a commitment in its gather: such a sender heads its stream to every
    # reducer with its claims for that share (contribution.py), which every reducer must read
    # first, whether or not it checks them
    committed: list[bool] = field(default_factory=list)
    # members most of the group refused as reducers lately: no share, recorded FAIL
    benched: set[int] = field(default_factory=set)

    def exclude(self, i: int) -> None:
        """Like a wrong model: no share, and its values are never added."""
        self.used[i], self.roles[i] = 0.0, AUX

    @property
    def senders(self) -> list[int]:
        return [i for i, role in enumerate(self.roles) if role != AUX]

    @property
    def sender_weights(self) -> list[float]:
        return [self.used[i] for i in self.senders]

    @property
    def sender_norms(self) -> list[float]:
        return [self.norms[i] for i in self.senders]

    @property
    def max_norm(self) -> float:
        """An average is never larger than the largest contribution: a bound on a liar's reducer."""
        return max(self.sender_norms, default=0.0)

    @property
    def sender_commitments(self) -> Optional[list]:
        """Per sender, its Commitment (None: not checked); None when this peer runs without them."""
        if self.commitments is None:
            return None
        return [self.commitments.get(i) for i in self.senders]

    @property
    def senders_with_claims(self) -> list[bool]:
        """Per sender, whether its stream starts with its claims (it committed in its gather)."""
        return [bool(self.committed[i]) if i < len(self.committed) else False for i in self.senders]

    @property
    def claims_nonce(self) -> str:
        return self.mine["commit"]["nonce"] if self.commitments is not None else ""

    @property
    def robust(self) -> bool:
        return self.mine.get("agg") == "centered_clip"

    @property
    def receives(self) -> bool:
        """Whether this peer takes part in the butterfly (and gets the average)."""
        return self.roles[self.me] != AUX

    def download_bandwidths(self, bandwidths: Sequence[Optional[float]]) -> list:
        """What load balancing sees: only nodes reduce a share, and no benched one."""
        return [bw if role == NODE and i not in self.benched else 0.0
                for i, (bw, role) in enumerate(zip(bandwidths, self.roles))]

    def work_reports(self) -> dict:
        return {self.peer_ids[i]: c.report for i, c in (self.commitments or {}).items()}


def plan_group(peer_ids: Sequence[str], me: int, users: Sequence[Any], roles: Sequence[Optional[str]]) -> GroupPlan:
    """The model check, the weight caps and the scale check over a group's gathers.

    ``roles`` are what each member announced (None: a mode id hivemind does not know, which is
    an error only for a member that passes the model check).
    """
    mine = users[me]
    cap = float(mine["cap"])
    # Per-peer limits (e.g. 0 for a miner that failed verification) override the default cap.
    peer_caps = mine.get("caps") if isinstance(mine.get("caps"), dict) else {}
    plan_roles, claimed, used, compatible, incompatible = [], [], [], [], {}
    for i, (user, role) in enumerate(zip(users, roles)):
        why = incompatibility(user, mine)
        ok = not why
        if why:
            incompatible[i] = why
        compatible.append(ok)
        w = user.get("w", 0.0) if isinstance(user, dict) else 0.0
        w = float(w) if isinstance(w, (int, float)) and math.isfinite(w) and w >= 0 else 0.0
        claimed.append(w)
        limit = peer_caps.get(str(peer_ids[i]), cap)
        used.append(min(w, float(limit)) if ok else 0.0)
        if ok and role is None:
            raise ValueError(f"peer {peer_ids[i]} announced an unknown averaging mode")
        plan_roles.append(role if ok else AUX)
    norms, out_of_scale = scale_check(users, compatible, claimed, float(mine.get("ratio", 0.0) or 0.0))
    plan = GroupPlan(list(map(str, peer_ids)), me, mine, plan_roles, claimed, used, compatible, norms, incompatible,
                     out_of_scale, committed=[isinstance(u, dict) and isinstance(u.get("commit"), dict) for u in users])
    for i in out_of_scale:
        plan.exclude(i)
    plan.benched = bench_votes(plan.peer_ids, users, compatible)
    return plan


def incompatibility(user: Any, mine: dict) -> str:
    """Why a member's gather cannot average with ours ("" when it can): another gather format,
    model fingerprint, tensor schema, or wire codec (named both ways, so that either operator
    sees which codec to change)."""
    if not isinstance(user, dict) or user.get("v") != GATHER_VERSION:
        theirs = user.get("v") if isinstance(user, dict) else None
        return f"gather format {theirs!r} differs from ours ({GATHER_VERSION}): another dtrain release"
    if user.get("fp") != mine["fp"] or user.get("schema") != mine["schema"]:
        return "model fingerprint or tensor schema (shapes, dtypes, part size) differs"
    if user.get("wire") != mine["wire"]:
        return f"wire codec {str(user.get('wire'))[:80]!r} differs from ours ({mine['wire']!r})"
    return ""


def bench_votes(peer_ids: Sequence[str], users: Sequence[Any], compatible: Sequence[bool]) -> set[int]:
    """Members named in the ``ref`` of a strict majority of the other compatible members.

    A receiver that refuses a reducer for what it returned (an account that does not check
    out, claims that do not prove out: accounts.py) names it in its next gathers for
    ``BENCH_ROUNDS`` of its rounds. Every member reads the same gathers, so all agree on who
    is benched, and a minority cannot bench an honest peer. It takes two votes at least (in a
    group of two neither can tell which of them lies), and a group never benches all of its
    members.
    """
    named: dict[str, int] = {}
    voters = [i for i, ok in enumerate(compatible) if ok]
    for i in voters:
        ref = users[i].get("ref") if isinstance(users[i], dict) else None
        if isinstance(ref, list):
            for p in {str(p) for p in ref[:MAX_REFUSED_NAMED] if isinstance(p, str)}:
                if p != str(peer_ids[i]):
                    named[p] = named.get(p, 0) + 1
    benched = set()
    for j, peer in enumerate(peer_ids):
        others = sum(1 for i in voters if i != j)
        votes = named.get(str(peer), 0)
        # two votes at least: in a group of two, neither can tell which of them lies
        if votes >= 2 and 2 * votes > others:
            benched.add(j)
    if benched and all(j in benched for j in voters):
        return set()  # someone must reduce: a group that benches everyone benches no one
    return benched


def check_commitments(users, mine: dict, compatible, claimed, report_type) -> tuple[Optional[dict], dict]:
    """Parse every peer's work commitment and decide which weighted peers are not bound by one.

    ``report_type``: the work report class of this swarm's averaging mode, whose ``from_wire``
    parses a commitment's report and refuses one of another kind. Returns ``(commitments,
    unbound)``: ``commitments`` maps the index of each peer whose commitment parsed to its
    Commitment (None overall when this peer runs without them), ``unbound`` maps peer index to
    the reason its contribution is refused.
    """
    from dtrain.swarm.averaging.contribution import OTHER_EPOCH, Commitment, binding_verdict

    own = mine.get("commit")
    if not isinstance(own, dict):
        return None, {}
    required = bool(mine.get("req"))
    commitments, unbound = {}, {}
    for i, user in enumerate(users):
        if not compatible[i]:
            continue
        data = user.get("commit") if isinstance(user, dict) else None
        parsed = None
        reason = ""
        if data is not None:
            try:
                parsed = Commitment.parse(data, report_type)
                commitments[i] = parsed
            except ValueError as exc:
                reason = f"malformed work commitment: {exc}"
        if claimed[i] > 0 and (required or data is not None):
            reason = reason or binding_verdict(parsed, weight=claimed[i], nonce=own.get("nonce"),
                                               compression=str(mine.get("comp", "none")))
        elif parsed is not None and parsed.nonce != own.get("nonce"):
            # A weight-0 peer (a validator) of another epoch brings nothing to average but
            # would reduce a share under its own epoch's rules: it owns none.
            reason = OTHER_EPOCH
        if reason:
            unbound[i] = reason
    return commitments, unbound


def apply_commitments(plan: GroupPlan, commitments: Optional[dict], unbound: dict) -> None:
    plan.commitments, plan.unbound = commitments, dict(unbound)
    for i in unbound:
        plan.exclude(i)


def reducer_rules(plan: GroupPlan, users: Sequence[Any]) -> dict[int, tuple[list[float], bool]]:
    """Per member that reduces a share: the weight it gives each sender (in sender order) and
    whether it runs CenteredClip, from its own gather, as plan_group computes them on that
    member. Receivers check a reducer's account against these (runner.py): a reducer applies
    its own caps (those of the validator whose query reached it first), not ours, and every
    exclusion is common to all members, so the senders are ours.
    A member whose gather holds no valid cap gives everyone 0."""
    rules = {}
    for j, role in enumerate(plan.roles):
        if role != NODE:
            continue
        user = users[j] if isinstance(users[j], dict) else {}
        cap = user.get("cap")
        cap = float(cap) if isinstance(cap, (int, float)) and math.isfinite(cap) and cap >= 0 else 0.0
        caps = user.get("caps") if isinstance(user.get("caps"), dict) else {}
        weights = []
        for i in plan.senders:
            limit = caps.get(plan.peer_ids[i], cap)
            limit = float(limit) if isinstance(limit, (int, float)) and math.isfinite(limit) and limit >= 0 else 0.0
            weights.append(min(plan.claimed[i], limit))
        rules[j] = (weights, user.get("agg") == "centered_clip")
    return rules


def out_of_step(plan: GroupPlan) -> Optional[str]:
    """Why this peer must sit the round out, or None.

    The group has no epoch in its matchmaking key, so a peer that is late (or early) can land
    in another epoch's group. When most of the others committed under another nonce, this peer
    is the odd one: everyone else gives it no share, and its record says so instead of
    averaging something of another epoch.
    """
    commitments = plan.commitments or {}
    others = [i for i in commitments if i != plan.me]
    elsewhere = [i for i in others if commitments[i].nonce != plan.mine["commit"]["nonce"]]
    if others and 2 * len(elsewhere) > len(others):
        return (f"this peer is at another epoch than the group ({len(elsewhere)} of {len(others)} peers "
                "committed under another epoch's nonce)")
    return None
