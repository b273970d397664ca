"""The averager process: runs one group's round under dtrain's rules.

It lives in hivemind's background process (the wall's AveragerProcess). For each formed
group it applies the group rules (group_rules.py) to the gathered data, sits the round out if
this peer is at another epoch, balances the shares, and runs the butterfly with a
CheckedRunner (``make_runner``: the seam tests use to substitute a faulty runner). As a
matchmaking leader it also forms its group early once every expected peer joined (assembly.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time

import torch

from dtrain.swarm import startup
from dtrain.swarm.averaging import group_rules
from dtrain.swarm.averaging.assembly import claim_from_gather_bytes, lapsed_followers, ready_to_assemble
from dtrain.swarm.averaging.contribution import binding_rtol
from dtrain.swarm.averaging.runner import CheckedRunner
from dtrain.swarm.hivemind_internals import AveragerProcess, Group, load_balance

logger = logging.getLogger(__name__)

# How long a leader holds its parts back for its followers' BEGIN messages to leave (a dead
# follower's write fails at once; this only bounds a stuck one).
BEGIN_FLUSH_LIMIT_S = 5.0


def matchmaking_key(prefix: str) -> bytes:
    """One matchmaking key per run: peers with another model must still be able to join, so they
    can be *reported* (WRONG_MODEL); the real check uses the gathered data (group_rules.py)."""
    return hashlib.sha256(f"dtrain-swarm:{prefix}".encode()).digest()


# torch threads of the averager process: one. Its work is many part-sized operations (decode,
# checks, CenteredClip, sums), already spread over the event loop's executor threads; torch's
# intra-op pool only adds OpenMP workers that busy-wait after every parallel region (a part's
# checks and CenteredClip measured 2.5-2.9x the process CPU with 2 threads as with 1, for the same
# work and time), which on a miner's machine is CPU taken from training and from p2pd.
AVERAGER_TORCH_THREADS = 1


def reset_torch_threads_after_fork() -> None:
    """Set the averager's torch thread count (``AVERAGER_TORCH_THREADS``) while its forked
    process still has a single thread.

    Besides the count, this rebuilds torch's thread-pool state safely. Once a process has
    called ``torch.set_num_threads`` (dtrain's tests do, an operator's script may), every new
    thread's first parallel-capable op re-applies that setting, and in a forked child that step
    rebuilds the pool torch marked as lost in the fork. Several threads doing it at once race,
    and one of them fails with "Invalid thread pool!": in the averager that was the 8-bit
    codec's first part, raised inside hivemind's writer task, which ends silently, so the
    reducers heard nothing and banned an honest sender 30 s later. Setting the count once here,
    before the averager starts its threads, does the rebuild single-threaded. It enters no
    parallel region, so it is safe on the forking thread. A failure here is only logged: the
    averager works without it, and an exception would end its process before it says "ready".
    """
    try:
        torch.set_num_threads(AVERAGER_TORCH_THREADS)
    except RuntimeError as exc:
        logger.warning("swarm: could not set torch's threads in the averager process: %s", exc)


class SwarmAverager(AveragerProcess):
    """The averager of a GradientSwarm. ``state_provider`` returns ``(metadata, tensors)`` for
    peers catching up (None: the averaged tensors themselves)."""

    runner_class: type = CheckedRunner

    def __init__(self, averaged_tensors, dht, *, state_provider=None, start: bool = False, **kwargs):
        self._state_provider = state_provider
        self._assembly_claims: dict = {}  # member -> (its request, its decoded claim)
        self._layout_cache = None
        self._own_claims = None  # this step's claims [num_parts, k] (float32), kept out of the gather
        self._own_digests = None  # and its parts' digests (32 bytes each)
        super().__init__(averaged_tensors, dht, matchmaking_key=matchmaking_key(kwargs["prefix"]), start=start,
                         **kwargs)

    # -- process ---------------------------------------------------------------------------
    def on_process_start(self) -> None:
        startup.enable_stack_dumps()
        reset_torch_threads_after_fork()

    def current_state(self):
        return None if self._state_provider is None else self._state_provider()

    def keep_private(self, user_gather):
        """Our claims stay here; the group gets only their tree's root (contribution.py)."""
        self._own_claims = self._own_digests = None
        if not isinstance(user_gather, dict) or group_rules.PRIVATE_KEY not in user_gather:
            return user_gather
        public = dict(user_gather)
        private = public.pop(group_rules.PRIVATE_KEY)
        self._own_claims = group_rules.private_claims(private)
        self._own_digests = group_rules.private_digests(private)
        return public

    # -- early group formation -------------------------------------------------------------
    def should_form_group(self, members, min_group_size: int) -> bool:
        """Form the group once every expected peer is in (the rule, and why a forged list cannot
        abuse it: assembly.py). Decoded claims are kept while a member's request (or our own
        step) is the same object: a group of n would otherwise decode n gathers on each of n joins."""
        cache = self._assembly_claims
        claims, present = [], set()
        for peer, token, gather in members:
            hit = cache.get(peer)
            if hit is None or hit[0] is not token:
                hit = cache[peer] = (token, claim_from_gather_bytes(peer, gather(), self.serializer.loads))
            claims.append(hit[1])
            present.add(peer)
        for peer in [p for p in cache if p not in present]:
            del cache[peer]
        if ready_to_assemble(claims, min_group_size):
            logger.debug("every expected peer joined: forming the group of %d now", len(claims))
            return True
        return False

    def followers_to_leave_out(self, deadlines: dict, now: float, request_timeout: float) -> set:
        return lapsed_followers(deadlines, now, request_timeout)

    # -- one group ---------------------------------------------------------------------------
    async def average_with_group(self, group: Group) -> dict:
        loop = asyncio.get_event_loop()
        plan = group_rules.plan_group(group.peer_ids, group.me, group.users, group.roles)
        commitments, unbound = await loop.run_in_executor(None, self._check_commitments, plan, group)
        group_rules.apply_commitments(plan, commitments, unbound)
        reason = group_rules.out_of_step(plan)
        if reason:
            return dict(gathered=None, report=group_rules.sit_out_report(plan, group.round_id, reason))
        peer_fractions = await loop.run_in_executor(
            None, load_balance, self.total_size, plan.download_bandwidths(group.bandwidths), group.min_vector_size)
        layout = self._layout(group) if plan.commitments is not None else None  # before the tensor lock
        t_start = time.monotonic()
        await self.until_begins_sent(group.group_id, BEGIN_FLUSH_LIMIT_S)
        async with self.locked_tensors() as local_tensors:
            runner = self.make_runner(group, local_tensors, plan, peer_fractions, layout)
            await self.run_butterfly(runner, local_tensors, receives=plan.receives)
            allreduce_s = time.monotonic() - t_start
        report = self._report(plan, group, runner)
        report["allreduce_s"] = allreduce_s
        report["work_reports"] = plan.work_reports()
        return dict(gathered=None, report=report)

    def make_runner(self, group: Group, tensors, plan: group_rules.GroupPlan, peer_fractions, layout, **extra):
        """The group's runner (tests substitute ``runner_class`` and pass ``extra`` arguments)."""
        return self.new_runner(
            self.runner_class, group, tensors, peer_fractions=peer_fractions, roles=plan.roles,
            weight=plan.used[plan.me], sender_weights=plan.sender_weights, sender_norms=plan.sender_norms,
            max_norm=plan.max_norm, robust=plan.robust, sender_commitments=plan.sender_commitments,
            senders_with_claims=plan.senders_with_claims,
            own_claims=self._own_claims if plan.committed[plan.me] else None, own_digests=self._own_digests,
            claims_nonce=plan.claims_nonce, layout=layout,
            account_rtol=binding_rtol(str(plan.mine.get("comp", "none"))),
            require_commitments=bool(plan.mine.get("req")),
            reducer_rules=group_rules.reducer_rules(plan, group.users), **extra)

    def _report(self, plan: group_rules.GroupPlan, group: Group, runner: CheckedRunner) -> dict:
        reducer = runner.reducer
        senders = runner.sender_ids
        return group_rules.round_report(
            plan, round_id=group.round_id, rejected={senders[i] for i in reducer.rejected},
            too_large={senders[i] for i in reducer.too_large},
            contradicted={senders[i] for i in reducer.contradicted}, unproven={senders[i] for i in runner.unproven},
            **runner.outcome())

    def _check_commitments(self, plan: group_rules.GroupPlan, group: Group):
        if not isinstance(plan.mine.get("commit"), dict):
            return None, {}
        return group_rules.check_commitments(group.users, plan.mine, plan.compatible, plan.claimed)

    def _layout(self, group: Group):
        from dtrain.swarm.averaging.contribution import PartLayout

        if self._layout_cache is None:
            with self.get_tensors() as tensors:
                self._layout_cache = PartLayout.of(tensors, group.compression, group.part_size_bytes)
        return self._layout_cache
