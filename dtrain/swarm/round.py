"""One round, one object: from its announcement to the applied result, on dtrain's own protocols.

A :class:`Round` carries one round id and epoch through every stage a member sees:

``DECLARING`` (its declaration is with the announcer, or the announcer's window is open) ->
``SAT_OUT`` (it is not a member: it declared late, for another epoch, or the announcer could not
be reached; nobody waits for it and nobody holds it at fault) or ``AVERAGING`` (the signed
membership is verified and the butterfly runs) -> ``DONE`` (the result is in the caller's parts)
or ``FAILED`` (the membership did not verify, the butterfly could not run at all, or the checks
after it broke: the parts may then hold values nobody checked, which the caller must not use).

A round runs on the transport's event loop, never on the caller's thread: :meth:`Rounds.announce`
and :meth:`Rounds.join` return at once with the round, whose :meth:`Round.result` the caller
waits for when it needs the average (a miner keeps training meanwhile).
"""

from __future__ import annotations

import enum
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Collection, Mapping, Optional, Sequence

import torch

from dtrain.swarm.butterfly import NO_CHECKS, ButterflyOutcome, ButterflyService, MembershipError, RoundChecks
from dtrain.swarm.codecs import PartCodec
from dtrain.swarm.membership import Announcer, Declaration, SignedMembership, declare
from dtrain.swarm.questions import KeptRounds
from dtrain.swarm.records import Outcome, PeerResult, RoundRecord
from dtrain.swarm.transport import Transport

logger = logging.getLogger(__name__)


class Stage(enum.Enum):
    DECLARING = "declaring"
    SAT_OUT = "sat_out"
    AVERAGING = "averaging"
    DONE = "done"
    FAILED = "failed"


@dataclass
class Round:
    """One member's round. ``stage`` moves forward only; ``reason`` says why it sat out or failed."""

    round_id: str
    epoch: int
    stage: Stage = Stage.DECLARING
    reason: str = ""
    membership: Optional[SignedMembership] = None
    outcome: Optional[ButterflyOutcome] = None
    times: dict = field(default_factory=dict)  # stage name -> time.time() it was entered
    future: Optional[Future] = None

    def enter(self, stage: Stage, reason: str = "") -> None:
        self.stage, self.reason = stage, reason or self.reason
        self.times[stage.value] = time.time()

    def result(self, timeout_s: Optional[float] = None) -> "Round":
        """Wait for the round to end (DONE, SAT_OUT or FAILED) and return it."""
        if self.future is not None:
            self.future.result(timeout=timeout_s)
        return self

    @property
    def finished(self) -> bool:
        return self.stage in (Stage.DONE, Stage.SAT_OUT, Stage.FAILED)


@dataclass(frozen=True)
class RoundSettings:
    """How long each stage may take (the round's own clock: never the caller's)."""

    window_s: float = 5.0  # the announcer's declaration window
    sender_timeout_s: float = 30.0
    reducer_timeout_s: float = 30.0
    robust: bool = False  # CenteredClip instead of the weighted mean


class Rounds:
    """One node's rounds on its transport: the butterfly for every round, and the announcer's
    desk when the node has a hotkey to sign with (a validator). ``may_announce(hotkey)`` says
    whose memberships this node accepts."""

    def __init__(self, transport: Transport, *, may_announce: Callable[[str], bool], wallet=None,
                 may_declare: Callable[[str], bool] = lambda peer: True, start_timeout_s: float = 30.0):
        self.transport = transport
        self.may_announce = may_announce
        self.butterfly = ButterflyService(transport, start_timeout_s=start_timeout_s)
        self.kept = KeptRounds(transport)  # what we sent in our last committed round, and questions about it
        self.desk = Announcer(transport, wallet, may_declare) if wallet is not None else None

    def announce(self, round_id: str, epoch: int, parts: Sequence[torch.Tensor], codec: PartCodec,
                 settings: RoundSettings = RoundSettings(), *, checks: RoundChecks = NO_CHECKS,
                 gather: bytes = b"", caps: Optional[Mapping[str, float]] = None,
                 benched: Collection[str] = ()) -> Round:
        """Announce a round and take part in it with weight 0 (a validator receives the result).
        ``caps``: each peer's largest weight, signed into the membership so that every member
        applies the same (an unlisted peer gets 0); None: every peer's declared weight.
        ``benched``: peers that reduce no share of it."""
        if self.desk is None:
            raise MembershipError("only a node with a hotkey to sign with announces rounds")
        own = Declaration(round_id, epoch, weight=0.0, reduces=False, gather=gather)
        rnd = Round(round_id, int(epoch))
        rnd.enter(Stage.DECLARING)

        async def membership():
            return await self.desk.announce(round_id, epoch, len(parts), settings.window_s, own=own, caps=caps,
                                            benched=benched), ""

        rnd.future = self.transport.submit(self._run(rnd, membership, parts, codec, settings, checks))
        return rnd

    def join(self, announcer_peer: str, round_id: str, epoch: int, parts: Sequence[torch.Tensor], codec: PartCodec,
             weight: float, settings: RoundSettings = RoundSettings(), *, checks: RoundChecks = NO_CHECKS,
             gather: bytes = b"", reduces: bool = True, bandwidth: Optional[float] = None) -> Round:
        """Declare for an announced round and, once a member, average in it."""
        declaration = Declaration(round_id, epoch, float(weight), reduces, gather, bandwidth)
        rnd = Round(round_id, int(epoch))
        rnd.enter(Stage.DECLARING)

        async def membership():
            # the window, then the signing: a generous bound, past which we sit the round out
            return await declare(self.transport, announcer_peer, declaration, settings.window_s + 30.0)

        rnd.future = self.transport.submit(self._run(rnd, membership, parts, codec, settings, checks))
        return rnd

    async def _run(self, rnd: Round, membership, parts, codec, settings: RoundSettings, checks) -> None:
        try:
            signed, why = await membership()
        except MembershipError as exc:
            rnd.enter(Stage.SAT_OUT, str(exc))
            return
        if signed is None:
            rnd.enter(Stage.SAT_OUT, why)
            return
        try:
            signed.verify(self.may_announce)
            if signed.membership.round_id != rnd.round_id or signed.epoch != rnd.epoch:
                raise MembershipError(f"the announcer answered for round {signed.membership.round_id} "
                                      f"(epoch {signed.epoch}), not {rnd.round_id} (epoch {rnd.epoch})")
            if self.transport.peer_id not in signed.membership.peers:
                raise MembershipError("the membership leaves out this peer, which declared in time")
        except MembershipError as exc:
            rnd.enter(Stage.FAILED, str(exc))
            logger.warning("round %s: %s", rnd.round_id, exc)
            return
        rnd.membership = signed
        self.kept.admit(rnd.round_id, signed.membership.peers)  # they may now ask what we sent
        rnd.enter(Stage.AVERAGING)
        try:
            checks.begin(signed.membership, signed.gathers, signed.membership.index(self.transport.peer_id))
            rnd.outcome = await self.butterfly.run(signed.membership, parts, codec,
                                                   sender_timeout_s=settings.sender_timeout_s,
                                                   reducer_timeout_s=settings.reducer_timeout_s,
                                                   robust=settings.robust, checks=checks)
        except ValueError as exc:  # a MembershipError, or gathers our checks cannot read
            rnd.enter(Stage.FAILED, str(exc))
            return
        try:
            await checks.after_butterfly(parts, rnd.outcome)
        except Exception as exc:  # unchecked results are no result: the caller must not apply them
            logger.exception("round %s: the checks after the butterfly broke", rnd.round_id)
            rnd.enter(Stage.FAILED, f"the checks after the butterfly broke: {type(exc).__name__}: {exc}"[:300])
            return
        rnd.enter(Stage.DONE)


def record_of(rnd: Round, local_peer: str, sizes: Sequence[int], checks: RoundChecks = NO_CHECKS, *,
              fingerprint: str = "", compression: str = "none", mode: str = "gradient", tokens: int = 0) -> RoundRecord:
    """This member's record of a finished round (what scoring, dashboards and the round log
    read). ``sizes``: the values in each part; ``checks``: the round's checks, whose verdicts
    (``refused`` senders, ``accused`` reducers, ``commitments``) the record names when they have them.

    A round it sat out or that failed says why in ``error`` and names nobody: it is nobody's
    fault here. Of a round it averaged in, every member has one outcome: FAIL for a sender
    every member leaves out for its gather (``proven``: anyone can check it), one our reducer
    left out, a reducer our checks refused (``proven`` when its own bytes failed them: every
    receiver of them refuses it alike), accused or that did not deliver; else SUCCESS.
    """
    started = rnd.times.get(Stage.DECLARING.value, time.time())
    ended = max(rnd.times.values()) if rnd.times else started
    record = RoundRecord(round_id=rnd.round_id, local_peer_id=local_peer, started_at=started,
                         duration_s=max(0.0, ended - started), num_elements=int(sum(sizes)),
                         model_fingerprint=fingerprint, compression=compression, mode=mode, tokens=int(tokens))
    if rnd.stage != Stage.DONE or rnd.membership is None or rnd.outcome is None:
        record.error = f"{rnd.stage.value}: {rnd.reason}" if rnd.reason else rnd.stage.value
        return record
    membership, outcome = rnd.membership.membership, rnd.outcome
    refused = getattr(checks, "refused", {})
    accused = getattr(checks, "accused", {})
    commitments = getattr(checks, "commitments", {})
    record.group = list(membership.peers)
    for i, peer in enumerate(membership.peers):
        s = membership.sender_index(i)
        claimed = membership.weights[s] if s is not None else 0.0
        proven = s is not None and s in refused
        if proven:
            verdict, why = Outcome.FAIL, refused[s]
        elif s is not None and s in outcome.banned and peer != local_peer:
            verdict, why = Outcome.FAIL, f"left out of our share: {outcome.banned[s]}"
        elif i in outcome.refused_reducers:
            verdict, why = Outcome.FAIL, f"refused as a reducer: {outcome.refused_reducers[i]}"
            proven = i in outcome.refused_for_bytes
        elif i in accused:
            verdict, why = Outcome.FAIL, f"wronged our part as a reducer: {accused[i]}"
        elif i in outcome.failed_reducers:
            verdict, why = Outcome.FAIL, f"did not deliver its averaged parts: {outcome.failed_reducers[i]}"
        else:
            verdict, why = Outcome.SUCCESS, ""
        used = claimed if verdict == Outcome.SUCCESS else 0.0
        record.peers.append(PeerResult(peer, verdict, claimed, used, why, proven=proven))
        if s is not None and s in commitments:
            record.work_reports[peer] = commitments[s].report
    total = max(1, sum(sizes))
    unaveraged = sum(sizes[g] for g in outcome.unaveraged_parts | outcome.zeroed_parts)
    record.fraction_averaged = 1.0 - unaveraged / total
    record.fraction_refused = sum(sizes[g] for g in outcome.zeroed_parts) / total
    record.fraction_recovered = sum(sizes[g] for g in outcome.recovered_parts) / total
    record.total_weight = float(sum(p.weight_used for p in record.peers))
    record.bytes_sent, record.bytes_received = outcome.bytes_sent, outcome.bytes_received
    record.allreduce_s = outcome.duration_s
    record.evidence = getattr(checks, "evidence", None)
    return record

