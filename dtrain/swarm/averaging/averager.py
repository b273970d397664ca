"""The averager process: runs one group's round under dtrain's rules.

It lives in hivemind's background process (the wall's AveragerProcess). For each formed
group it applies the group rules (group_rules.py) to the gathered data, sits the round out if
this peer is at another epoch, balances the shares, runs the butterfly with a CheckedRunner
(``make_runner``: the seam tests use to substitute a faulty runner), and then checks every
result it applied under the round's result seed before the caller gets it (result_check.py),
answering the other members' questions for that from what it sent. As a matchmaking leader
it also forms its group early once every expected peer joined (assembly.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from dtrain.swarm import startup
from dtrain.swarm.averaging import group_rules
from dtrain.swarm.averaging.assembly import claim_from_gather_bytes, lapsed_followers, ready_to_assemble
from dtrain.swarm.averaging import result_check
from dtrain.swarm.averaging.contribution import binding_rtol
from dtrain.swarm.averaging.runner import CheckedRunner
from dtrain.swarm.hivemind_internals import AveragerProcess, Group, load_balance

logger = logging.getLogger(__name__)

@dataclass
class _KeptRound:
    """What we sent in our last committed round, kept for the members' questions after it."""

    group_id: bytes
    members: frozenset
    sent: object  # audit.SentContribution
    by_seed: dict = field(default_factory=dict)  # result seed -> future of its sketches
    served: dict = field(default_factory=dict)  # member -> the parts whose bytes it was sent


# The least time a member is given to answer the result check's question (its sender timeout
# when longer): it sketches what it sent once per round, a fraction of a second per 16 MiB.
RESULT_CHECK_MIN_TIMEOUT_S = 10.0

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
        # what we sent in our last committed round, for the members' questions (a _KeptRound)
        self._sent = None
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
            self._keep_sent(group, local_tensors, layout, committed=bool(plan.committed[plan.me]))
            await self.run_butterfly(runner, local_tensors, receives=plan.receives)
            allreduce_s = time.monotonic() - t_start
            if plan.receives:
                try:
                    await self._check_results(group, runner, local_tensors)
                    await self._re_reduce(group, runner, local_tensors)
                except Exception:  # a fault of the checks themselves must not lose the round
                    logger.exception("swarm: the result check failed; applying the round as the butterfly left it")
            check_s = time.monotonic() - t_start - allreduce_s
        report = self._report(plan, group, runner)
        report["allreduce_s"] = allreduce_s
        report["result_check_s"] = check_s
        report["work_reports"] = plan.work_reports()
        return dict(gathered=None, report=report)

    # -- the result check (result_check.py) ----------------------------------------------------
    def _keep_sent(self, group: Group, tensors, layout, committed: bool) -> None:
        """Keep a copy of what we are about to send, replacing the last round's (memory stays
        flat): the members check their results against its sketches, re-reduce a refused share
        from its bytes, and the validators' round audit asks for both (through the caller)."""
        from dtrain.swarm.averaging.audit import SentContribution

        self._sent = None
        if layout is None or not committed:
            return
        sent = SentContribution([t.detach().clone() for t in tensors], layout, group.compression, group.round_id)
        self._sent = _KeptRound(group.group_id, frozenset(group.peer_ids), sent)

    async def answer_member(self, group_id: bytes, payload: bytes, asker: str):
        kept = self._sent
        if kept is None or kept.group_id != group_id or asker not in kept.members:
            return None  # not our last committed round, or not a member of it
        kind, seed, parts = result_check.decode_ask(payload, len(kept.sent.layout))
        if kind == result_check.ASK_SKETCHES:
            sketches = await self._sent_sketches(kept, seed)
            return None if sketches is None else result_check.encode_answer(sketches[parts])
        # our parts' bytes, for a refused reducer's share: each member gets each part at most once
        served = kept.served.setdefault(asker, set())
        if served & set(parts):
            return None
        served.update(parts)
        return result_check.encode_wires(await self._kept_wires(kept, parts))

    @staticmethod
    async def _kept_wires(kept, parts: list[int]) -> list[bytes]:
        """The wire bytes of our kept parts ``parts`` (serialised off the loop)."""
        return await asyncio.get_event_loop().run_in_executor(None, lambda: [kept.sent.wire(g) for g in parts])

    async def _answer_caller(self, round_id: str, nonce: Optional[str], part: Optional[int], future) -> None:
        """For the caller's process (swarm.KeptContribution, through call_in_process): the
        sketches of what we sent in round ``round_id`` under ``nonce``, or part ``part``'s wire
        bytes; None when that is not the round we keep. The one copy of it lives here."""
        try:
            kept = self._sent
            if kept is None or kept.sent.round_id != round_id:
                future.set_result(None)
                return
            loop = asyncio.get_event_loop()
            if part is not None:
                result = await loop.run_in_executor(None, kept.sent.wire, part)
            else:
                result = await loop.run_in_executor(None, kept.sent.sketches, nonce)
            future.set_result(result)
        except BaseException as exc:  # IndexError for a part we do not have: the caller's to word
            future.set_exception(exc)

    async def _sent_sketches(self, kept, seed: bytes):
        """The sketches [num_parts, k] of what we sent under ``seed``'s nonce, computed once per
        seed (every honest member asks with the same one); None past MAX_SEEDS_PER_ROUND."""
        future = self._start_sent_sketches(kept, seed)
        return None if future is None else await asyncio.shield(future)

    @staticmethod
    def _start_sent_sketches(kept, seed: bytes):
        """Start (once per seed) sketching what we sent under ``seed``'s nonce; the future, or
        None past MAX_SEEDS_PER_ROUND."""
        future = kept.by_seed.get(seed)
        if future is None:
            if len(kept.by_seed) >= result_check.MAX_SEEDS_PER_ROUND:
                return None
            future = kept.by_seed[seed] = asyncio.get_event_loop().run_in_executor(
                None, kept.sent.sketches, result_check.result_nonce(seed))
        return future

    async def _check_results(self, group: Group, runner: CheckedRunner, tensors) -> None:
        """Check every part another reducer returned and we applied under the round's result
        seed, before the caller gets them; refuse (zero) the parts of a reducer that fails."""
        applied = runner.applied_by_others()
        if not applied:
            return
        loop = asyncio.get_event_loop()
        layout = runner.layout

        def piece(g: int):
            param_index, start, length = layout.parts[g]
            return tensors[param_index].reshape(-1)[start:start + length]

        held = sorted(set(applied) | set(runner.own_share()))
        seed = await loop.run_in_executor(None, result_check.result_seed, group.group_id,
                                          [(g, piece(g)) for g in held])
        nonce = result_check.result_nonce(seed)
        # Every honest member holds the same results, so our seed is the one the others will
        # ask us with: sketch what we sent now instead of when the first question arrives, and
        # our own results while our questions are out. Both were sequential steps of every
        # member's check, and the slowest member's check is the round's.
        kept = self._sent if self._sent is not None and self._sent.group_id == group.group_id else None
        if kept is not None:
            self._start_sent_sketches(kept, seed)
        ours = loop.run_in_executor(None, _sketch_parts, tensors, layout, sorted(applied), nonce)
        wanted: dict[int, list[int]] = {}  # sender index -> the parts it has a coefficient in
        for g, (_, coefficients) in sorted(applied.items()):
            for i, c in enumerate(coefficients):
                if c > 0:
                    wanted.setdefault(i, []).append(g)
        senders = runner.sender_ids
        timeout_s = self._question_timeout(runner)

        async def answers_of(i: int):
            parts = wanted[i]
            if i == runner.my_sender_index:
                sketches = None if kept is None else await self._sent_sketches(kept, seed)
                return None if sketches is None else {g: sketches[g] for g in parts}
            got: dict[int, object] = {}
            for at in range(0, len(parts), result_check.MAX_ASK_PARTS):
                chunk = parts[at:at + result_check.MAX_ASK_PARTS]
                data = await self.ask_member(senders[i], group.group_id, result_check.encode_ask(seed, chunk), timeout_s)
                sketches = result_check.decode_answer(data, len(chunk))
                if sketches is None:
                    return None
                got.update(zip(chunk, sketches))
            return got

        answered = dict(zip(wanted, await asyncio.gather(*(answers_of(i) for i in wanted))))
        got = await ours
        norms = {g: {i: runner.claimed_norm(g, i) for i, c in enumerate(applied[g][1]) if c > 0} for g in applied}
        failing, set_aside = result_check.judge(got, {g: c for g, (_, c) in applied.items()},
                                                {g: p for g, (p, _) in applied.items()}, answered, norms,
                                                runner.account_rtol)
        check = result_check.ResultCheck(nonce=nonce, parts_checked=len(applied),
                                         silent=sorted(senders[i] for i, a in answered.items() if a is None))

        def evidence_of(g: int):
            peer_index, coefficients = applied[g]
            return result_check.FailedPart(
                str(runner.ordered_peer_ids[peer_index]), tuple(coefficients), runner.digests_of(g), got[g],
                {i: a[g] for i, a in answered.items() if a is not None and g in a})

        check.failed = {g: evidence_of(g) for g in sorted(failing)}
        check.disputed = {g: evidence_of(g) for g in sorted(set(set_aside.values()))}
        for i in set_aside:
            logger.warning("swarm: setting aside the result-check answers of %s: they alone contradict several "
                           "reducers", senders[i])
        for peer_index in sorted({applied[g][0] for g in failing}):
            logger.warning("swarm: refusing reducer %s: %s", runner.ordered_peer_ids[peer_index], result_check.REASON)
            runner.refuse_unconfirmed(peer_index, tensors, result_check.REASON)
        runner.result_check = check

    @staticmethod
    def _question_timeout(runner: CheckedRunner) -> float:
        return max(RESULT_CHECK_MIN_TIMEOUT_S, float(runner.sender_timeout or 0.0))

    async def _re_reduce(self, group: Group, runner: CheckedRunner, tensors) -> None:
        """Every receiver re-reduces a refused reducer's share itself, from the senders' bytes.

        A refused reducer's share would otherwise be zeros for the round (a quarter of a step
        lost to one cheat in four). Its senders still keep what they sent; we fetch each weighted
        sender's bytes for the share's zeroed parts, check them as the reducer should have (the
        digest each committed, finiteness, its announced norm, its claim), and combine them
        under the reducer's own rule and weights, in sender order. Every honest receiver does
        the same with the same bytes, so all hold the same values. A part for which any
        weighted sender's bytes are missing stays zeros (a part combined from fewer senders
        would differ from another receiver's).
        """
        plan = runner.refused_parts()
        if not plan:
            return
        from dtrain.swarm.averaging.claims_tree import part_digest
        from dtrain.swarm.averaging.contribution import part_matches_claim
        from dtrain.swarm.wire import decode_wire
        from dtrain.swarm.averaging.norms import part_check, within_norm

        loop = asyncio.get_event_loop()
        senders, layout, compression = runner.sender_ids, runner.layout, runner.wire_compression
        timeout_s = self._question_timeout(runner)
        per_question = max(1, result_check.MAX_ANSWER_BYTES // max(1, group.part_size_bytes))

        async def bytes_of(i: int, parts: list[int]) -> dict[int, bytes]:
            kept = self._sent
            if i == runner.my_sender_index:
                if kept is None or kept.group_id != group.group_id:
                    return {}
                return dict(zip(parts, await self._kept_wires(kept, parts)))
            got: dict[int, bytes] = {}
            for at in range(0, len(parts), per_question):
                chunk = parts[at:at + per_question]
                wires = result_check.decode_wires(
                    await self.ask_member(senders[i], group.group_id, result_check.encode_fetch(chunk), timeout_s),
                    len(chunk))
                if wires is None:
                    break
                got.update(zip(chunk, wires))
            return got

        def combine(k: int, g: int, wires: dict[int, bytes], weights, robust: bool):
            param_index, start, length = layout.parts[g]
            parts, used = [], []
            for i in sorted(wires):
                digest, claim = runner.sender_proof(k, i, g)
                if digest is None or part_digest(wires[i]) != digest:
                    return None  # not the committed bytes: nothing every receiver would agree on
                try:
                    x = decode_wire(wires[i], length, compression)
                except ValueError:
                    return None
                finite, norm = part_check(x)
                bound = runner.sender_norms[i] if runner.sender_norms is not None else None
                if not finite or (bound is not None and not within_norm(norm, bound)) \
                        or not part_matches_claim(x, claim, param_index, start, runner.claims_nonce):
                    continue  # what the reducer should have refused: left out, as it would have been
                parts.append(x.float())
                used.append(float(weights[i]))
            if not parts:
                return None
            if robust:
                from dtrain.swarm.averaging.centered_clip import clip_account

                return clip_account(parts, used)[0]
            w = torch.tensor(used, dtype=torch.float64)
            return (torch.stack([p.double() for p in parts]) * w[:, None]).sum(0).div_(w.sum()).float()

        for k, parts in plan.items():
            rule = runner.reducer_rules.get(k)
            if rule is None:
                continue
            weights, robust = rule
            needed = [i for i, w in enumerate(weights) if w > 0]
            fetched = dict(zip(needed, await asyncio.gather(*(bytes_of(i, parts) for i in needed))))
            recovered = 0
            for g in parts:
                wires = {i: fetched[i][g] for i in needed if g in fetched[i]}
                if len(wires) != len(needed):
                    continue
                values = await loop.run_in_executor(None, combine, k, g, wires, weights, robust)
                if values is not None:
                    runner.write_recovered(k, g, tensors, values)
                    recovered += 1
            logger.info("swarm: re-reduced %d of %d refused parts of reducer %s", recovered, len(parts),
                        runner.ordered_peer_ids[k])

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
        report = group_rules.round_report(
            plan, round_id=group.round_id, rejected={senders[i] for i in reducer.rejected},
            too_large={senders[i] for i in reducer.too_large},
            contradicted={senders[i] for i in reducer.contradicted}, unproven={senders[i] for i in runner.unproven},
            **runner.outcome())
        check = (report.get("evidence") or {}).get("result_check")
        if check is not None:
            # the weight each refused reducer had as a sender: a validator that finds a sender lied
            # gives it back (validation_round.round_audit)
            check["weights"] = {p: plan.used[plan.peer_ids.index(p)] for p in runner.unconfirmed_reducers}
        return report

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


def _sketch_parts(tensors, layout, parts, nonce: str) -> dict:
    """Global part -> the sketch (float64 numpy) of our result for it under ``nonce``."""
    from dtrain.sketch import range_sketch
    from dtrain.sketch import WORK_SKETCH_K

    out = {}
    for g in parts:
        param_index, start, length = layout.parts[g]
        out[g] = range_sketch(tensors[param_index].reshape(-1)[start:start + length], param_index, start, nonce,
                              k=WORK_SKETCH_K).numpy()
    return out
