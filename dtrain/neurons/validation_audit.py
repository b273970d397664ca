"""The validator's audits after the all-reduce: the secret-seed round audit and the work audit.

Two phases of a validation round (dtrain.neurons.validation_round lists them all):
``round_audit`` checks what each member sent and returned under a seed drawn after the round
(dtrain.swarm.averaging.audit) -> ``round_audit``, ``sent`` on each Probe; ``audit`` checks the
work each miner committed (the mode's recomputation or replay) -> ``work``, ``note``.
"""

from __future__ import annotations

import dataclasses
import random
import secrets
import time
from concurrent.futures import ThreadPoolExecutor

from dtrain.neurons.validation_round import Probe
from dtrain.validation.round_rules import Target

AUDIT_ATTEMPTS = 2  # questions to a miner that does not answer the round audit
AUDIT_RETRY_S = 2.0


def round_audit(client, swarm, probes: list[Probe], record, averaged, *, others=None, timeout_s: float = 60.0):
    """The secret-seed audit of the round (dtrain.swarm.averaging.audit): draw a seed now, after
    every part was sent and every result returned; ask every miner of the group for its parts'
    sketches under it; check every part we applied against its reducer's account; settle what
    does not add up with the parts' committed bytes. Sets ``round_audit`` on the miners at fault
    and ``sent`` (its SenderAudit) on the others, for the mode's batch audit. Returns the
    AuditResult (None when the round left no evidence: no group, or no commitments). The parts
    our result check refused during the round are settled too, and a reducer refused for a
    sender's lie gets SUCCESS back in ``record``.

    ``others``: peer id -> (api, hotkey) of miners we did not probe (other validators' picks);
    those in the group are asked too, so the parts they are in can be checked, and the ones at
    fault are in the result (we tell the miners to bench them) though we score only our probes."""
    from dtrain.swarm.averaging.audit import (
        SenderAudit, audit_nonce, audit_round, clear_framed_reducers, draw_seed,
    )
    from dtrain.swarm.averaging.contribution import binding_rtol

    evidence = getattr(record, "evidence", None)
    if evidence is None or not record.round_id:
        return None
    seed = draw_seed()
    nonce = audit_nonce(seed)
    members = {p.peer_id: p for p in probes if p.peer_id in evidence.senders and not p.shared_peer_id}
    probed = {p.peer_id for p in probes}
    where = {peer: (p.api, p.hotkey) for peer, p in members.items()}
    where.update({peer: tuple(at) for peer, at in (others or {}).items()
                  if peer in evidence.senders and peer not in probed and peer != swarm.peer_id})
    asker = _AuditAsker(client, swarm, record.round_id, seed, where, timeout_s)
    reports = asker.sketches_of_all(nonce)
    rtol = binding_rtol(record.compression)
    result = audit_round(evidence, averaged, reports, nonce, rtol, asker.wire)
    # a reducer our result check refused because a sender lied about its sketch is not at fault
    clear_framed_reducers(record, evidence, result)
    for peer in result.problems:
        if peer in asker.errors:
            result.problems[peer] += f" ({asker.errors[peer]})"
    for peer, p in members.items():
        if peer in result.problems:
            p.round_audit = "round audit: " + result.problems[peer]
        elif reports.get(peer) is not None:
            p.sent = SenderAudit(nonce=nonce, sketches=reports[peer], layout=evidence.layout, rtol=rtol,
                                 confirmed=frozenset(result.confirmed.get(peer, ())))
    return result


class _AuditAsker:
    """The round audit's questions: to each miner at ``where`` (peer id -> (api, hotkey)) over its
    signed API, and to our own swarm for what we sent."""

    def __init__(self, client, swarm, round_id: str, seed: bytes, where: dict, timeout_s: float):
        self.client, self.swarm, self.round_id = client, swarm, round_id
        self.seed, self.where, self.timeout_s = seed, where, timeout_s
        self.errors: dict = {}  # peer id -> why its sketches could not be had
        self.timed_out: set = set()  # peers whose question took half the timeout or more

    def sketches_of_all(self, nonce: str) -> dict:
        """Peer id -> its sketches [num_parts, k] under the audit's seed (None: it did not answer)."""
        reports: dict = {}
        # A miner whose question failed at once is asked once more: its silence fails its work
        # audit, so a refused connection or a busy chain read must not be taken for it (one that
        # let the question time out is not asked again: that would slow the round down).
        for attempt in range(AUDIT_ATTEMPTS):
            ask = {peer: at for peer, at in self.where.items()
                   if reports.get(peer) is None and peer not in self.timed_out}
            if not ask:
                break
            if attempt:
                time.sleep(AUDIT_RETRY_S)
            with ThreadPoolExecutor(max_workers=min(16, len(ask))) as pool:
                for peer, sketches in zip(ask, pool.map(self._sketches_of, ask.items())):
                    reports[peer] = sketches
                    if sketches is not None:
                        self.errors.pop(peer, None)
        swarm = self.swarm
        if swarm.sent_round == self.round_id:
            try:
                reports[swarm.peer_id] = swarm.sent_sketches(self.round_id, nonce)
            except LookupError:
                reports[swarm.peer_id] = None
        return reports

    def _sketches_of(self, item):
        import base64

        import numpy as np

        from dtrain.api.client import ApiError
        from dtrain.api.messages import RoundAuditRequest
        from dtrain.sketch import WORK_SKETCH_K

        peer, (api, hotkey) = item
        t0 = time.monotonic()
        try:
            answer = self.client.round_audit(api, hotkey, RoundAuditRequest(group=self.round_id, seed=self.seed.hex()),
                                             timeout=self.timeout_s)
            data = base64.b64decode(answer.sketches or "", validate=True)
        except (ApiError, ValueError) as exc:
            self.errors[peer] = str(exc)[:200]
            if time.monotonic() - t0 >= self.timeout_s / 2:
                self.timed_out.add(peer)
            return None
        if len(data) != answer.parts * 4 * WORK_SKETCH_K:
            return np.zeros((answer.parts, 0), dtype="<f4")  # the wrong size: audit_round names it
        return np.frombuffer(data, dtype="<f4").reshape(answer.parts, WORK_SKETCH_K)

    def wire(self, peer: str, part: int):
        """The wire bytes of ``peer``'s part ``part`` (None: it did not show them)."""
        import base64

        from dtrain.api.client import ApiError
        from dtrain.api.messages import RoundAuditRequest

        if peer == self.swarm.peer_id:
            try:
                return self.swarm.sent_wire(self.round_id, part)
            except (LookupError, IndexError):
                return None
        if peer not in self.where:
            return None
        api, hotkey = self.where[peer]
        try:
            answer = self.client.round_audit(api, hotkey, RoundAuditRequest(group=self.round_id, seed=self.seed.hex(),
                                                                           part=part), timeout=self.timeout_s)
            return base64.b64decode(answer.wire or "", validate=True)
        except (ApiError, ValueError):
            return None


def audit(client, mode, probes: list[Probe], record, epoch: int) -> None:
    """Audit every miner's committed work on the pre-step model (the mode decides how:
    recomputed pages, or a replayed stretch of DiLoCo steps; a sampled per-step batch against
    what the round audit confirmed it sent). A miner that failed the round audit fails this
    audit too (the gate ``work_audit_failed``, and probation: docs/scoring.md)."""
    from dtrain.modes import AuditRequest
    from dtrain.validation.verification import WorkVerdict

    # parsed and checked by the averager; a malformed one was refused in the gather
    audited = [p for p in probes if p.peer_id in record.work_reports and not p.shared_peer_id]
    requests = [AuditRequest(uid=p.uid, report=record.work_reports[p.peer_id],
                             read_snapshot=snapshot_reader(client, p.target), sent=p.sent) for p in audited]
    # Drawn now, after every miner committed in the gather, from a secret it never sees.
    rng = random.Random(secrets.randbits(64))
    for p, verdict in zip(audited, mode.audit(requests, epoch=epoch, rng=rng)):
        if verdict is None:
            continue
        p.work = verdict
        if not verdict.passed:
            p.note = verdict.problem
    for p in probes:
        if p.round_audit:
            report = record.work_reports.get(p.peer_id)
            p.work = WorkVerdict(committed_samples=int(report.samples) if report is not None else 0,
                                 problem=p.round_audit)
            p.note = p.round_audit


def snapshot_reader(client, target: Target):
    """How a DiLoCo audit downloads ``target``'s committed snapshots: signed state-slice
    requests; a failed request reads as a snapshot not served."""

    def read(epoch: int, step: int, offset: int, length: int, timeout_s: float) -> bytes:
        from dtrain.api.client import ApiError
        from dtrain.training.snapshots import SnapshotError

        try:
            dl = client.state_slice(target.api, target.hotkey, offset, length, timeout=timeout_s,
                                    keep_data=True, snapshot=(epoch, step))
        except ApiError as exc:
            raise SnapshotError(str(exc)) from None
        return dl.data or b""

    return read


def proven_faults(record, miners: dict, checked: set[str], audit=None) -> list[Probe]:
    """The miners we did not check (``miners``: peer id -> Target) that the round's own record
    refused for what they published in the gather (``PeerResult.proven``), or that our round
    audit proved at fault with committed bytes (``audit``: its AuditResult): an unchecked
    contribution or share is bound by its commitments all the same, and this validator holds
    the proof. Each comes back with a failed WorkVerdict, for probation and forfeit."""
    from dtrain.validation.verification import WorkVerdict

    proofs = {r.peer_id: f"refused in the round for what it published: {r.reason}" for r in record.peers if r.proven}
    if audit is not None:
        proofs.update({peer: "round audit: " + audit.problems[peer] for peer in audit.proven if peer in audit.problems})
    found = []
    for peer, why in proofs.items():
        if peer in miners and peer not in checked:
            p = Probe.of(miners[peer])
            p.note = why
            p.work = WorkVerdict(committed_samples=0, problem=why)
            found.append(p)
    return found


def caught(probes: list[Probe], record) -> list[int]:
    """The uids whose committed work failed an audit this round, or whose contribution the
    round refused for what they published: they forfeit their EMA (docs/scoring.md)."""
    proven = record.proven_at_fault()
    return [p.uid for p in probes if (p.work is not None and not p.work.passed) or p.peer_id in proven]


def follow_restarts(probes: list[Probe], miners: dict) -> None:
    """Point each probe at the API its miner commits now (``miners``: peer id -> Target, read
    after the round): a miner restarted since the round began keeps its hotkey and peer id but
    serves at a new address, and an audit sent to the old one would read as withheld."""
    for p in probes:
        now = miners.get(p.peer_id)
        if now is not None and now.hotkey == p.hotkey and now.api != p.api:
            p.target = dataclasses.replace(p.target, api=now.api)
