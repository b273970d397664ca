"""One validation round's I/O, phase by phase; dtrain.neurons.validator runs them in order.

Phase by phase, what each reads -> what it writes on each miner's :class:`Probe`:

- ``ask_statuses``: where each miner is -> ``status`` (or ``train_error``);
- ``probe``: the Train challenge and a timed state-slice download -> ``train``,
  ``train_seconds``, ``slice_bps``, ``slice_check`` (or the errors; a ``note``);
- ``check_slices``: the slices against our replica -> ``replica_distance`` (a far one
  zeroes ``slice_bps``);
- ``spot_moved_on``: where the miners whose answers did not fit are now -> ``moved_on``, ``note``;
- ``verify``: recomputed micro-batches of each Train answer -> ``checks``, ``note``;
- ``allreduce_request``, ``allreduce``: the round, joined with weight 0 -> ``allreduce``;
  returns the round's record and the averaged tensors;
- ``round_audit`` and ``audit`` (dtrain.neurons.validation_audit): what each member sent and
  returned, under a seed drawn after the round -> ``round_audit``, ``sent``; the work each miner
  committed in the round -> ``work``, ``note``;
- ``update_probation``: the audits -> ``note``; returns the new probation map;
- ``assess``: all of it -> ``outcome``, ``note``; returns the scoring inputs.

Every phase takes what it uses as arguments: the API client, the workbench, the config and
a :class:`Challenge` (what this round asks and compares with), never the neuron. Every
decision is made in dtrain.validation.round_rules (the round's flow, a miner's verdict) and
dtrain.validation.verification (what a piece of evidence means); the mode's audit
(dtrain.modes) decides what committed work is recomputed or replayed.
"""

from __future__ import annotations

import math
import random
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from dtrain.api.messages import (
    AllReduceRequest,
    AllReduceResponse,
    StatusResponse,
    TrainRequest,
    TrainResponse,
)
from dtrain.validation import round_rules
from dtrain.validation.round_rules import Target


@dataclass
class Probe:
    """What one miner answered this round, and what this validator made of it."""

    target: Target
    note: str = ""  # the first problem found (the round record's note)
    status: StatusResponse | None = None
    train: TrainResponse | None = None
    train_error: str = ""
    train_seconds: float = 0.0
    slice_bps: float | None = None
    slice_error: str = ""
    slice_check: tuple | None = None  # (offset, length, data, bytes received) of its state slice
    replica_distance: float | None = None  # of its state slice from ours (dtrain.training.replica)
    moved_on: bool = False  # it stepped to a later epoch while we were checking it (another validator's round)
    checks: list = field(default_factory=list)  # MicroBatchCheck per recomputed micro-batch
    allreduce: AllReduceResponse | None = None
    allreduce_error: str = ""
    work: object | None = None  # its WorkVerdict (dtrain.validation.verification), after the audit
    round_audit: str = ""  # why it failed the round's secret-seed audit ("" when it did not)
    sent: object | None = None  # its SenderAudit (dtrain.swarm.averaging.audit): what that audit confirmed it sent
    outcome: str = ""

    @classmethod
    def of(cls, target: Target) -> Probe:
        return cls(target, note=round_rules.SHARED_PEER_ID_NOTE if target.shared_peer_id else "")

    # who it is, read often enough to be worth the shorthand
    uid = property(lambda self: self.target.uid)
    hotkey = property(lambda self: self.target.hotkey)
    api = property(lambda self: self.target.api)
    peer_id = property(lambda self: self.target.peer_id)
    shared_peer_id = property(lambda self: self.target.shared_peer_id)


@dataclass(frozen=True)
class Challenge:
    """What this round asks every miner, and what the answers are compared with: our replica at
    ``epoch``, described once per round."""

    epoch: int
    nonce: str  # the Train challenge's pages and fingerprints follow from it
    request: TrainRequest  # carries our parameter sketch and digest
    rms: float  # of our parameters: scales every state-slice comparison
    num_values: int  # float32 values in our replica: where a state slice may start


def challenge(trainer, cfg, *, epoch: int, digest: str, sketch: tuple) -> Challenge:
    """A fresh challenge for this round against ``trainer``'s replica (after following the swarm)."""
    from dtrain.training.replica import params_rms

    nonce = secrets.token_hex(16)
    request = TrainRequest(nonce=nonce, epoch=epoch, pages=cfg.validator.pages_per_query,
                           micro_batch_size=cfg.training.micro_batch_size, params_digest=digest, params_sketch=sketch)
    return Challenge(epoch=epoch, nonce=nonce, request=request, rms=params_rms(trainer.params),
                     num_values=sum(p.numel() for p in trainer.params))


def _each(probes: list[Probe], fn, workers: int = 8) -> None:
    """``fn(probe)`` for every probe, a few at a time: the miners answer in parallel."""
    if probes:
        with ThreadPoolExecutor(max_workers=min(workers, len(probes))) as pool:
            list(pool.map(fn, probes))


# ------------------------------------------------------------------ before the all-reduce

def ask_statuses(client, probes: list[Probe]) -> None:
    from dtrain.api.client import ApiError

    def ask(probe: Probe) -> None:
        try:
            probe.status = client.status(probe.api, timeout=10)
        except ApiError as exc:
            probe.train_error = f"status: {exc}"

    _each(probes, ask)


def probe(client, probes: list[Probe], challenge: Challenge, *, swarm_fingerprint: str, slice_bytes: int) -> None:
    """Send every reachable miner the Train challenge, and time a download of a state slice."""
    from dtrain.api.client import ApiError

    def one(p: Probe) -> None:
        if p.status is None or p.shared_peer_id:
            return
        problem = round_rules.swarm_settings_problem(p.status.swarm_fingerprint, swarm_fingerprint)
        if problem:
            # its work cannot be verified here: say why in the round record
            p.note = problem
            return
        t0 = time.perf_counter()
        try:
            p.train = client.train(p.api, p.hotkey, challenge.request, timeout=300)
        except ApiError as exc:
            p.train_error = str(exc)
        p.train_seconds = time.perf_counter() - t0
        # A random offset, and the bytes must be our own replica's: a miner cannot serve zeros
        # (or a cached blob) without holding the model.
        # Aligned to whole float32 values, so the slice can also be compared value by value.
        offset = 4 * secrets.randbelow(max(1, challenge.num_values))
        try:
            dl = client.state_slice(p.api, p.hotkey, offset, slice_bytes, timeout=60, keep_data=True)
        except ApiError as exc:
            p.slice_bps, p.slice_error = 0.0, str(exc)
            return
        p.slice_bps = dl.bytes_per_second
        p.slice_check = (offset, slice_bytes, dl.data or b"", dl.bytes_received)

    _each(probes, one)


def check_slices(probes: list[Probe], trainer, rms: float) -> None:
    """Each slice must be this model's parameters at its offset, within the replica tolerance
    (honest replicas differ in the last bits); its distance tells who drifted."""
    from dtrain.neurons.sync import state_slice
    from dtrain.training.replica import slice_distance, within_tolerance

    for p in probes:
        if p.slice_check is None:
            continue
        offset, length, data, received = p.slice_check
        ours = state_slice(trainer, offset, length)
        p.replica_distance = slice_distance(data, ours, rms) if received == len(ours) else math.inf
        if not within_tolerance(p.replica_distance):
            p.slice_bps = 0.0
            p.slice_error = "state slice does not match the model (beyond the replica tolerance)"


def spot_moved_on(client, probes: list[Probe], epoch: int) -> None:
    """Ask again where the miners whose answers did not fit ``epoch`` are now; one that has
    stepped since moved on mid-check (round_rules.answers_look_stale)."""
    from dtrain.api.client import ApiError
    from dtrain.validation.verification import moved_on_during_checks

    def recheck(p: Probe) -> None:
        try:
            now = client.status(p.api, timeout=10)
        except ApiError:
            return
        if moved_on_during_checks(p.status.epoch, epoch, now.epoch):
            p.moved_on = True
            p.note = (f"moved to epoch {now.epoch} during this validator's checks (another validator's "
                      f"round averaged epoch {epoch} first)")

    _each([p for p in probes if round_rules.answers_look_stale(
        epoch, status_epoch=None if p.status is None else p.status.epoch, shared_peer_id=p.shared_peer_id,
        train_epoch=None if p.train is None else p.train.epoch, train_failed=bool(p.train_error),
        replica_distance=p.replica_distance)], recheck)


def verify(probes: list[Probe], bench, cfg, challenge: Challenge) -> None:
    """Recompute a random subset of each Train answer's micro-batches on ``bench``'s model."""
    for p in probes:
        _verify_one(p, bench, cfg, challenge)


def _verify_one(p: Probe, bench, cfg, challenge: Challenge) -> None:
    from dtrain.training.data import assign_pages
    from dtrain.training.fingerprint import Fingerprint, compare_fingerprints
    from dtrain.training.trainer import recompute_fingerprints
    from dtrain.validation.scoring import check_from_comparison
    from dtrain.validation.verification import (
        answer_problem,
        choose_recomputed,
        in_sync_problem,
    )

    if p.moved_on:
        return  # its answers are stale: see spot_moved_on
    if p.train is None:
        p.note = p.note or p.train_error or "no Train answer"
        return
    answer, epoch, nonce = p.train, challenge.epoch, challenge.nonce
    problem = in_sync_problem(answer.epoch, epoch, p.replica_distance)
    if problem:
        # Not a forgery we can prove, but nothing we can verify either: no credit.
        p.note = problem
        return
    reader, mbs = bench.reader, cfg.training.micro_batch_size
    pages = assign_pages(run_id=bench.run_id, uid=p.uid, epoch=epoch, page_counter=0,
                         count=cfg.validator.pages_per_query, num_pages=reader.num_pages, nonce=nonce)
    tokens = reader.read_pages(pages)
    expected = math.ceil(tokens.shape[0] / mbs)
    micro = answer.microbatches
    problem, failed = answer_problem(len(micro), expected)
    if problem:
        p.checks, p.note = failed, problem
        return
    chosen = choose_recomputed(expected, cfg.validator.recompute_fraction, random.Random(secrets.randbits(64)))
    checks = []
    for index in chosen:
        x = tokens[index * mbs:(index + 1) * mbs]
        reference = recompute_fingerprints(bench.model, x, nonce=nonce, micro_batch_size=mbs,
                                           precision=bench.trainer.precision)[0]
        report = micro[index]
        claimed = Fingerprint(loss=report.loss, sketch=report.sketch, samples=report.samples, nonce=report.nonce or "")
        cmp = compare_fingerprints(claimed, reference)
        checks.append(check_from_comparison(cmp, reference.loss))
        if not cmp.passed:
            p.note = "; ".join(cmp.reasons)
    p.checks = checks


# ------------------------------------------------------------------ the all-reduce

def allreduce_request(probes: list[Probe], *, run_id: str, epoch: int, round_no: int, digest: str,
                      weight_cap: float, deadline_s: float, probation: dict[str, int],
                      refused: tuple = (), unchecked: dict | None = None,
                      announcer: str | None = None, round_id: str | None = None) -> AllReduceRequest:
    """The AllReduce query, with each miner's weight cap: what we verified (round_rules.may_contribute)
    for the checked ones; the full cap for every other miner (``unchecked``: peer id -> hotkey),
    bound by its commitment like theirs, unless it is on probation; and the peers our round
    audits caught lately (``refused``: the miners vote to bench them). ``round_id``: another
    validator's round we join (None: ours, named by run, epoch and round number)."""
    from dtrain.validation.verification import on_probation, weight_caps

    allowed = {peer: not on_probation(probation, hotkey, round_no) for peer, hotkey in (unchecked or {}).items()}
    allowed.update({p.peer_id: round_rules.may_contribute(p.checks, shared_peer_id=p.shared_peer_id,
                                                          probation=probation, hotkey=p.hotkey, round_no=round_no)
                    for p in probes})
    caps = weight_caps(allowed, weight_cap)
    return AllReduceRequest(round_id=round_id or f"{run_id}-{epoch}-{round_no}", epoch=epoch, weight_cap=weight_cap,
                            deadline_s=deadline_s, weight_caps=caps, params_digest=digest,
                            refused=tuple(refused)[:64] or None, announcer=announcer)


def announce(dht, run_id: str, request: AllReduceRequest) -> str:
    """Store the round notice every miner joins from (dtrain.swarm.round_notices); why it failed,
    or "" (the checked miners still come on their queries)."""
    from dtrain.swarm.round_notices import RoundNotices

    try:
        RoundNotices(dht, f"dtrain-{run_id}").announce(request.epoch, request.round_id,
                                                         expiration_s=request.deadline_s)
    except Exception as exc:  # noqa: BLE001 - the DHT is best effort
        return f"round notice not stored on the DHT: {exc!r}"
    return ""


def allreduce(client, swarm, probes: list[Probe], request: AllReduceRequest, *, zeros: list, expected: list[str],
              announce, work, work_nonce: str, stop):
    """Give the checked miners our caps, announce the round (every other miner joins from the
    notice: dtrain.neurons.round_joining) and join it with weight 0 (``work``: our empty report).

    Returns the round's record and the averaged tensors, not applied yet. ``expected``: the peers
    the group waits for (every live miner, the other validators met last round); ``announce()``
    stores the round notice on the DHT.
    """
    with ThreadPoolExecutor(max_workers=min(16, len(probes)) + 1) as pool:
        futures = [pool.submit(_ask_allreduce, client, p, request) for p in probes]
        # in the background: a DHT store can take seconds on a busy node, and the group must not
        # form among the miners before we are in matchmaking
        pool.submit(announce)
        tensors = _zeroed_buffers(swarm, zeros)
        record = swarm.run_round(tensors, weight=0.0, cap=0.0, expected_peers=sorted(expected),
                                 timeout_s=request.deadline_s, peer_caps=request.weight_caps, stop=stop, work=work,
                                 work_nonce=work_nonce)
        for f in futures:
            f.result()
    return record, tensors


def announced_allreduce(client, model_rounds, probes: list[Probe], request: AllReduceRequest, *, announce,
                        work_nonce: str, stop, joining: bool = False):
    """The round on dtrain's own protocol: open its declaration window (the round runs on the
    transport's loop), then ask the checked miners and store the notice every other miner joins
    from; every member averages with the membership we sign when the window closes, each at most
    its cap in the query (the caps are signed into it, so every member applies the same), and the
    peers our round audits caught lately (the query's ``refused``) reduce no share. Our weight-0
    part is zeros. ``joining``: the query names another validator's round (``round_to_join``),
    which we declare in with weight 0 and no share, as our checked miners do; no notice of ours.
    Returns the round's record and the averaged tensors, not applied yet."""
    holder: dict = {}

    def run() -> None:
        holder["tensors"] = model_rounds.into_buffers(lambda out: [b.zero_() for b in out])
        if joining:
            holder["record"] = model_rounds.run_round(holder["tensors"], 0.0, round_id=request.round_id,
                                                      epoch=request.epoch, announcer=request.announcer,
                                                      work_nonce=work_nonce, stop=stop, reduces=False)
        else:
            holder["record"] = model_rounds.run_round(holder["tensors"], 0.0, round_id=request.round_id,
                                                      epoch=request.epoch, work_nonce=work_nonce, stop=stop,
                                                      caps=request.weight_caps, benched=request.refused or ())

    with ThreadPoolExecutor(max_workers=min(16, len(probes)) + 2) as pool:
        ours = pool.submit(run)
        # a declaration that arrives an instant before the window opens waits for it (membership.EARLY_DECLARATION_S)
        futures = [pool.submit(_ask_allreduce, client, p, request) for p in probes]
        if not joining:
            pool.submit(announce)
        ours.result()
        for f in futures:
            f.result()
    return holder["record"], holder["tensors"]


# How long a validator that is not first in the epoch's announcer_order waits, per place behind
# the first, for the round notice of one ahead of it before it announces a round itself.
ANNOUNCER_WAIT_S = 1.5
NOTICE_POLL_S = 0.2


def round_to_join(read_notices, *, validators: list[str], own_hotkey: str, own_peer: str, run_id: str,
                  epoch: int, stop, wait_s: float = ANNOUNCER_WAIT_S):
    """The round notice of another validator's round at ``epoch`` to join instead of announcing
    our own (docs/protocol.md, "Several validators on dtrain's round"), or None: announce.

    Every validator computes the same ``announcer_order`` for the epoch from the chain's
    validators (hotkeys). The first announces at once; the one k places behind it waits up to
    k x ``wait_s`` for a notice at the epoch, so one round serves them all, and announces itself
    only when none came (those ahead are down). ``read_notices()``: the notices on the DHT now.
    A notice is untrusted: a forged one costs this validator the round (the membership it gets
    is not signed by a validator), never a miner's score."""
    from dtrain.swarm.membership import announcer_order

    order = announcer_order(run_id, epoch, validators)
    if own_hotkey not in order or order[0] == own_hotkey:
        return None
    deadline = time.monotonic() + wait_s * order.index(own_hotkey)
    while True:
        try:
            notices = read_notices()
        except Exception:  # noqa: BLE001 - the DHT is best effort: look again, then announce
            notices = []
        found = [n for n in notices if n.epoch == epoch and n.announcer != own_peer]
        if found:
            return min(found, key=lambda n: (n.round_id, n.announcer))
        if time.monotonic() >= deadline or stop.wait(NOTICE_POLL_S):
            return None


def _ask_allreduce(client, p: Probe, request: AllReduceRequest) -> None:
    """Send ``p`` the AllReduce query; its answer, or why it failed, on the probe."""
    from dtrain.api.client import ApiError

    try:
        p.allreduce = client.allreduce(p.api, p.hotkey, request, timeout=request.deadline_s + 60)
    except ApiError as exc:
        p.allreduce_error = str(exc)


def _zeroed_buffers(swarm, zeros: list) -> list:
    """Our weight-0 contribution: the swarm's round buffers set to zeros (no copy of the model
    held beside them), or copies of ``zeros`` when the buffers cannot be had (run_round says why)."""
    return swarm.into_buffers(lambda out: [z.clone() for z in zeros] if out is None else [b.zero_() for b in out])


# ------------------------------------------------------------------ after the all-reduce

def update_probation(probes: list[Probe], record, probation: dict[str, int], round_no: int, *,
                     rounds: int) -> dict[str, int]:
    """The probation map after this round's audits and its record (a member refused for what it
    published in the gather is caught like a failed audit, checked or not; ``rounds``: how long
    a caught miner stays on it); notes the miners still on probation. The probation leads a note
    the miner already has (behind, unreachable): it is why it earns nothing for rounds, not just this one."""
    proven = record.proven_at_fault()
    refused = {p.hotkey for p in probes if p.peer_id in proven}
    after, notes = round_rules.probation_update(probation, {p.hotkey: p.work for p in probes}, round_no,
                                                rounds=rounds, refused=refused)
    for p in probes:
        if p.hotkey in notes:
            p.note = f"{notes[p.hotkey]}; {p.note}" if p.note else notes[p.hotkey]
    return after


def assess(probes: list[Probe], record, *, epoch: int, probation: dict[str, int], round_no: int,
           moved_on_streaks: dict[str, int]) -> tuple[dict, dict[str, int]]:
    """Each miner's verdict (round_rules.miner_verdict): the scoring inputs by uid, and the new
    rounds-in-a-row each hotkey has moved on mid-check (absent: 0). ``epoch``: the one the round
    ran at, not the validator's after its step (every miner would read as behind it)."""
    from dtrain.validation.verification import on_probation

    claimed_by_peer = {r.peer_id: r.weight_claimed for r in record.peers}
    streaks = dict(moved_on_streaks)
    inputs = {}
    for p in probes:
        verdict = round_rules.miner_verdict(
            result=record.result_of(p.peer_id), claimed_weight=claimed_by_peer.get(p.peer_id),
            reachable=p.status is not None, status_epoch=None if p.status is None else p.status.epoch,
            our_epoch=epoch, checks=p.checks, note=p.note, moved_on=p.moved_on,
            moved_on_before=streaks.get(p.hotkey, 0), shared_peer_id=p.shared_peer_id, work=p.work,
            slice_bps=p.slice_bps, probation=on_probation(probation, p.hotkey, round_no))
        p.outcome, p.note = verdict.outcome.value, verdict.note
        if verdict.moved_on_streak:
            streaks[p.hotkey] = verdict.moved_on_streak
        else:
            streaks.pop(p.hotkey, None)
        inputs[p.uid] = verdict.scoring
    return inputs, streaks
