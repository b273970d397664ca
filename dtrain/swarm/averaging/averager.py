"""The averager process's round handler: wires one round's mechanisms together.

For each formed group: the plan (formation.py), then the checked butterfly (butterfly.py), the
result check and re-reduction (result_check.py, re_reduction.py), and one RoundReport
(report.py). Between rounds it keeps what this peer sent (kept.py) and answers questions about
it. The averager process (the wall's AveragerProcess) calls it; it never subclasses hivemind.
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Any, Optional

from dtrain.swarm.averaging import group_rules
from dtrain.swarm.averaging.assembly import lapsed_followers
from dtrain.swarm.averaging.butterfly import CheckedButterfly
from dtrain.swarm.averaging.contribution import PartLayout
from dtrain.swarm.averaging.formation import EarlyAssembly, OwnCommitment, RoundPlan, SitOut, plan_round
from dtrain.swarm.averaging.kept import CallerQuestion, SentContribution
from dtrain.swarm.averaging.mechanisms import Mechanisms
from dtrain.swarm.averaging.re_reduction import re_reduce
from dtrain.swarm.averaging.report import Figures, RoundReport, Verdicts, build_report, sit_out_report
from dtrain.swarm.averaging.result_check import check_results, result_nonce
from dtrain.swarm.hivemind_internals import ButterflyFacts, Group

logger = logging.getLogger(__name__)

# How long a leader holds its parts back for its followers' BEGIN messages to leave (a dead
# follower's write fails at once; this only bounds a stuck one).
BEGIN_FLUSH_LIMIT_S = 5.0


def matchmaking_key(prefix: str) -> bytes:
    """One matchmaking key per run: a peer with another model still joins, to be *reported*
    (WRONG_MODEL); the real check uses the gathered data (group_rules.py)."""
    return hashlib.sha256(f"dtrain-swarm:{prefix}".encode()).digest()


class SwarmAverager:
    """The round handler of a GradientSwarm (the wall's ``RoundHandler``).

    ``report_type``: the swarm's work report class (parses the group's commitments);
    ``compression``: the wire codec's setting; ``kept_dir``: where what we sent is kept;
    ``state_provider`` returns ``(metadata, tensors)``
    for peers catching up (None: the averaged tensors); ``mechanisms``: the classes a round is built from."""

    def __init__(self, *, report_type=None, compression: str = "none", state_provider=None,
                 mechanisms: Mechanisms = Mechanisms(), kept_dir: Optional[str] = None):
        self.report_type, self.compression = report_type, compression
        self.kept_dir = kept_dir  # what we sent is kept on disk there (kept.KeptFile); None: in memory
        self.mechanisms = mechanisms
        self._state_provider = state_provider
        self._assembly = EarlyAssembly()
        self._own = OwnCommitment()
        self._layout: Optional[PartLayout] = None
        self.sent: Optional[SentContribution] = None  # what we sent in our last committed round

    # -- matchmaking ---------------------------------------------------------------------------
    def keep_private(self, user_gather):
        """Our claims stay here; the group gets only their tree's root (contribution.py)."""
        self._own = OwnCommitment()
        if not isinstance(user_gather, dict) or group_rules.PRIVATE_KEY not in user_gather:
            return user_gather
        public = dict(user_gather)
        private = public.pop(group_rules.PRIVATE_KEY)
        self._own = OwnCommitment(group_rules.private_claims(private), group_rules.private_digests(private))
        return public

    def should_form_group(self, members, min_group_size: int) -> bool:
        if self._assembly.ready(members, min_group_size):
            logger.debug("every expected peer joined: forming the group of %d now", len(members))
            return True
        return False

    def followers_to_leave_out(self, deadlines: dict, now: float, request_timeout: float) -> set:
        return lapsed_followers(deadlines, now, request_timeout)

    def current_state(self):
        return None if self._state_provider is None else self._state_provider()

    # -- one group -------------------------------------------------------------------------------
    async def average_with_group(self, group: Group, io) -> RoundReport:
        plan = await plan_round(group, io, own=self._own, report_type=self.report_type,
                                layout=self._part_layout(group, io), compression_name=self.compression)
        if isinstance(plan, SitOut):
            return sit_out_report(plan.rules, group.round_id, plan.reason)
        t_start = time.monotonic()
        await io.until_begins_sent(group.group_id, BEGIN_FLUSH_LIMIT_S)
        async with io.locked_tensors() as tensors:
            butterfly = CheckedButterfly(plan, tensors, self.mechanisms)
            self._keep_sent(plan, tensors)
            facts = await io.run_butterfly(group, tensors, butterfly, parts_by_peer=plan.parts_by_peer,
                                           peer_fractions=plan.peer_fractions, roles=plan.rules.roles,
                                           weight=plan.rules.used[plan.me], receives=plan.rules.receives)
            butterfly.butterfly_done(facts)
            allreduce_s = time.monotonic() - t_start
            check = await self._checks_after(plan, butterfly, io, group.part_size_bytes)
            check_s = time.monotonic() - t_start - allreduce_s
        return self._report(plan, butterfly, facts, check, allreduce_s, check_s)

    async def _checks_after(self, plan: RoundPlan, butterfly: CheckedButterfly, io, part_size_bytes: int):
        """The result check, then re-reduction; a fault of the checks themselves must not lose the
        round: it is logged, and the round applied as the butterfly left it."""
        if not plan.rules.receives:
            return None
        kept = self.sent if self.sent is not None and self.sent.group_id == plan.group_id else None
        check = None
        try:
            check = await check_results(plan, butterfly, butterfly.tensors, io, kept)
            await re_reduce(plan, butterfly, io, kept, part_size_bytes)
        except Exception:
            logger.exception("swarm: the result check failed; applying the round as the butterfly left it")
        return check

    def _report(self, plan: RoundPlan, butterfly: CheckedButterfly, facts: ButterflyFacts, check, allreduce_s: float,
                check_s: float) -> RoundReport:
        senders, reducer = plan.sender_ids, butterfly.share.reducer
        verdicts = Verdicts(
            rejected={senders[i] for i in reducer.rejected}, too_large={senders[i] for i in reducer.too_large},
            contradicted={senders[i] for i in reducer.contradicted},
            unproven={senders[i] for i in butterfly.share.unproven}, banned=facts.banned,
            never_started=facts.never_started, failed_reducers=facts.failed_reducers,
            sending_failures=facts.sending_failures, accused_reducers=dict(butterfly.reply.accused),
            unconfirmed_reducers=dict(butterfly.unconfirmed_reducers))
        figures = Figures(total_size=facts.total_size, failed_size=butterfly.failed_size,
                          refused_size=butterfly.refused_size, recovered_size=butterfly.recovered_size,
                          bytes_sent=facts.bytes_sent, bytes_received=facts.bytes_received,
                          allreduce_s=allreduce_s, result_check_s=check_s)
        refused = sorted(plan.rules.peer_ids[i] for i in facts.refused_reducers)
        return build_report(plan.rules, plan.round_id, verdicts, figures, refused=refused,
                            evidence=butterfly.evidence(check))

    # -- what we sent (kept.py) --------------------------------------------------------------------
    def _keep_sent(self, plan: RoundPlan, tensors) -> None:
        """Keep a copy of what we are about to send, replacing the last round's (memory stays flat)."""
        self.sent = None
        if plan.rules.commitments is None or not plan.rules.committed[plan.me]:
            return
        self.sent = self.mechanisms.kept.keep(tensors, plan.layout, plan.compression, directory=self.kept_dir,
                                              round_id=plan.round_id, group_id=plan.group_id,
                                              members=frozenset(plan.rules.peer_ids))

    async def answer_member(self, group_id: bytes, payload: bytes, asker: str) -> Optional[bytes]:
        sent = self.sent
        if sent is None or sent.group_id != group_id:
            return None  # not our last committed round
        return await sent.answer_member(payload, asker, result_nonce)

    async def answer_caller(self, question: CallerQuestion) -> Any:
        """The caller's question about what we sent (IndexError for a part we do not have)."""
        sent = self.sent
        return None if sent is None else await sent.answer_caller(question)

    def _part_layout(self, group: Group, io) -> PartLayout:
        """hivemind's parts of our tensors (the same every round)."""
        if self._layout is None:
            with io.get_tensors() as tensors:
                self._layout = PartLayout.of(tensors, group.compression, group.part_size_bytes)
        return self._layout
