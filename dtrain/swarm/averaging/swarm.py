"""GradientSwarm: the caller's side of gradient averaging (runs in the neuron's process).

One GradientSwarm per model: :meth:`GradientSwarm.run_round` puts this peer's tensors and its
gather (group_rules.make_gather) into the averager process, waits for the round, and turns the
RoundReport into a :class:`~dtrain.swarm.records.RoundRecord` from this peer's view. What this
peer sent in its last committed round stays in the averager process; ``sent_sketches`` and
``sent_wire`` ask it (the validators' round audit).
"""

from __future__ import annotations

import contextlib

import math
import threading
import time
from typing import Any, Callable, Optional, Sequence

import torch

import dtrain.swarm.hivemind_internals as wall  # first: hivemind's shims, and its version check
from dtrain.swarm import node
from dtrain.swarm.averaging.assembly import expect_list
from dtrain.swarm.averaging.averager import SwarmAverager, matchmaking_key
from dtrain.swarm.averaging.group_rules import BENCH_ROUNDS, MAX_REFUSED_NAMED, BenchList, make_gather, schema_hash
from dtrain.swarm.averaging.kept import CallerQuestion
from dtrain.swarm.averaging.mechanisms import Mechanisms
from dtrain.swarm.averaging.norms import part_check
from dtrain.swarm.averaging.report import RoundReport
from dtrain.swarm.averaging.settings import AveragingConfig, part_size_for
from dtrain.swarm.averaging.waits import NoAnswer, wait_unless_stopped
from dtrain.swarm.records import Outcome, PeerResult, RoundLog, RoundRecord
from dtrain.swarm.sent_round import SentRound
from dtrain.swarm.wire import make_compression

# Beyond a round's matchmaking and all-reduce timeouts, how long the caller waits for the
# averager process before it counts the process as hung (the neuron then restarts the swarm
# node: dtrain/neurons/swarm_health.py).
AVERAGER_GRACE_S = 30.0
# How long the neuron waits for its averager process to sketch (or serialise a part of) what it
# sent: a model's worth of sketches takes seconds on a CPU.
KEPT_ANSWER_TIMEOUT_S = 300.0


class GradientSwarm:
    """One averaging participant. Create once per model; call :meth:`run_round` per global step.

    ``templates`` fixes the order, shapes and dtypes of the tensors every round averages.
    ``report_type``: the class of the work reports this swarm commits and checks (the mode's:
    needed for committed rounds). ``state_provider`` (optional) returns ``(metadata, tensors)``
    for peers catching up. ``mechanisms``: the classes a round is built from (mechanisms.py).
    """

    def __init__(self, dht, templates: Sequence[torch.Tensor], fingerprint: str,
                 config: Optional[AveragingConfig] = None, *,
                 state_provider: Optional[Callable[[], tuple[Any, Sequence[torch.Tensor]]]] = None,
                 mode: str = "gradient", report_type: Optional[type] = None,
                 mechanisms: Mechanisms = Mechanisms()):
        self.dht = dht
        config = config or AveragingConfig()
        if config.part_size_bytes is None:
            config = config.replace(part_size_bytes=part_size_for(sum(4 * t.numel() for t in templates)))
        self.config = config
        self.fingerprint = str(fingerprint)
        self.mode = mode
        self.report_type = report_type
        self._buffers = [torch.zeros_like(t, device="cpu").float() for t in templates]
        self._schema = schema_hash(self._buffers, self.config.part_size_bytes)
        self._log = RoundLog(self.config.log_path) if self.config.log_path else None
        # Only the last round is kept in memory; the round log on disk keeps them all.
        self.last_record: Optional[RoundRecord] = None
        # The running round's StepControl, dropped when the round ends (it holds a descriptor of
        # the averager process's result pipe).
        self._step = None
        self._last_stage: Optional[str] = None
        self._layout = None
        self._bench = BenchList()  # reducers we name as refused (in memory: a restart forgets)
        self._last_sent = SentRound()  # our last committed round, the one the round audit asks about
        handler = SwarmAverager(report_type=report_type, compression=config.compression,
                                state_provider=state_provider, mechanisms=mechanisms, kept_dir=config.kept_dir)
        self._averager = wall.AveragerProcess(self._buffers, dht, handler=handler, start=True,
                                              matchmaking_key=matchmaking_key(config.prefix), **self._averager_kwargs())
        self.release_buffers()  # zeros until the first contribution: no memory needed for them

    def _averager_kwargs(self) -> dict:
        cfg = self.config
        return dict(prefix=cfg.prefix, target_group_size=cfg.target_group_size, min_group_size=cfg.min_group_size,
                    min_matchmaking_time=cfg.min_matchmaking_time_s, request_timeout=cfg.request_timeout_s,
                    allreduce_timeout=cfg.allreduce_timeout_s, sender_timeout=cfg.sender_timeout_s,
                    reducer_timeout=cfg.reducer_timeout_s, next_chunk_timeout=cfg.sender_timeout_s,
                    compression=make_compression(cfg.compression), part_size_bytes=cfg.part_size_bytes,
                    bandwidth=cfg.bandwidth, client_mode=cfg.client_mode,
                    allow_state_sharing=cfg.allow_state_sharing if not cfg.client_mode else False,
                    declare_state_period=cfg.declare_state_period_s)

    @property
    def peer_id(self) -> str:
        return str(self.dht.peer_id)

    @property
    def sent_round(self) -> Optional[str]:
        """The round id of our last committed round (None while a round runs, or none was committed)."""
        return self._last_sent.round_id

    def wait_for_sent(self, round_id: str, timeout_s: float) -> bool:
        """True when ``round_id`` is our last committed round, waiting while our round still runs."""
        return self._last_sent.wait_for(round_id, timeout_s)

    @property
    def stage(self) -> Optional[str]:
        """Stage of the current/last round: LOOKING_FOR_GROUP, RUNNING_ALLREDUCE, FINISHED... (None before any)."""
        step = self._step
        return self._last_stage if step is None else step.stage.name

    @contextlib.contextmanager
    def round_buffers(self):
        """The averager's shared buffers, locked, for the caller to write its contribution into
        and pass to :meth:`run_round` (which then copies nothing): a contribution computed
        straight into them is not held a second time (docs/operators.md, "Memory")."""
        with self._averager.tensors_within(self.config.allreduce_timeout_s + AVERAGER_GRACE_S) as bufs:
            yield list(bufs)

    def into_buffers(self, compute: Callable[[Optional[list]], Any]) -> Any:
        """``compute(buffers)`` with the round buffers locked, its result to pass to run_round; when
        a dead averager holds them, ``compute(None)`` (run_round then reports the averager)."""
        try:
            with self.round_buffers() as buffers:
                return compute(buffers)
        except TimeoutError:
            return compute(None)

    def release_buffers(self) -> int:
        """Free the round buffers' memory once the caller is done with the round's average (4
        bytes per parameter between rounds; the next contribution written into them brings it
        back); returns the bytes freed, 0 when the buffers are busy or cannot be freed here."""
        from dtrain.swarm.memory_pages import free_shared_tensors

        try:
            with self._averager.tensors_within(RELEASE_WAIT_S) as bufs:
                return free_shared_tensors(bufs)
        except TimeoutError:
            return 0

    def run_round(self, tensors: Sequence[torch.Tensor], weight: float, cap: float, *,
                  expected_peers: Sequence[str] = (), tokens: int = 0, timeout_s: Optional[float] = None,
                  peer_caps: Optional[dict[str, float]] = None, stop: Optional[threading.Event] = None,
                  work=None, work_nonce: Optional[str] = None) -> RoundRecord:
        """Average ``tensors`` in place with whoever matchmakes; return this peer's RoundRecord.

        ``weight`` is the number of samples accumulated (0 for a validator), ``cap`` the largest
        weight this peer accepts from anyone, and ``peer_caps`` (peer id -> limit) tighter limits
        for particular peers. On failure to form a group the tensors keep their local values and
        the record carries ``error``. ``expected_peers`` that did not join are reported
        NON_PARTICIPATING or NOT_ALIVE, and a validator's group forms as soon as all of them
        joined (assembly.py). Setting ``stop`` abandons the round at once (the tensors keep their
        values). ``tensors`` may be the :meth:`round_buffers` themselves. ``work`` (a work report
        of ``report_type``) and ``work_nonce`` commit this
        contribution to the pages it came from (contribution.py); the record's ``work_reports``
        then holds every committed report of the group.
        """
        norm = self._checked_norm(tensors, weight, cap)
        problem = self.problem()
        if problem:  # hivemind's step() itself would wait for ever for a dead averager
            return self._failed_record(problem, weight, tokens)
        try:
            with self._averager.tensors_within(self.config.allreduce_timeout_s + AVERAGER_GRACE_S) as bufs:
                for b, t in zip(bufs, tensors):
                    if not _same_memory(b, t):
                        b.copy_(t.detach().to(device="cpu", dtype=b.dtype))
        except TimeoutError as exc:
            return self._failed_record(str(exc), weight, tokens)
        self._last_sent.begin()  # the averager keeps only this round's from now on
        committed = None
        try:
            gather = self._gather(tensors, weight, cap, norm, peer_caps, expected_peers, work, work_nonce)
            started, t0 = time.time(), time.monotonic()
            result, error = self._step_and_wait(gather, weight, cap, timeout_s, stop)
            record = self._new_record(started, time.monotonic() - t0, tokens)
            if error or not isinstance(result, RoundReport):
                self._mark_failed(record, error or "averager returned no report", weight)
            else:
                self._fill(record, result, tensors)
                committed = record.round_id if work_nonce is not None else None
        finally:
            self._last_sent.end(committed)
        missing = [p for p in expected_peers if p not in record.group]
        if missing:
            alive = node.reachable(self.dht, missing)
            for p in missing:
                outcome = Outcome.NON_PARTICIPATING if alive.get(p) else Outcome.NOT_ALIVE
                record.peers.append(PeerResult(p, outcome, reason="did not join the group"))
        return self._keep(record)

    def _checked_norm(self, tensors: Sequence[torch.Tensor], weight: float, cap: float) -> float:
        """The contribution's L2 norm; ValueError for a wrong shape, non-finite values, or a bad weight."""
        if len(tensors) != len(self._buffers):
            raise ValueError(f"expected {len(self._buffers)} tensors, got {len(tensors)}")
        squares = 0.0
        for i, (t, b) in enumerate(zip(tensors, self._buffers)):
            if tuple(t.shape) != tuple(b.shape):
                raise ValueError(f"tensor #{i} has shape {tuple(t.shape)}, expected {tuple(b.shape)}")
            finite, norm = part_check(t)
            if not finite:
                # an honest peer never ships NaN/Inf; refuse locally instead of being banned remotely
                raise ValueError(f"tensor #{i} has non-finite values; skip this round or fix the step")
            squares += norm * norm
        if not (math.isfinite(weight) and weight >= 0 and math.isfinite(cap) and cap >= 0):
            raise ValueError("weight and cap must be finite and >= 0")
        return math.sqrt(squares)

    def _gather(self, tensors, weight, cap, norm, peer_caps, expected_peers, work, work_nonce) -> dict:
        cfg = self.config
        commitment, claims, digests = (self._commitment(tensors, work, work_nonce) if work_nonce is not None
                                       else (None, None, None))
        return make_gather(
            fingerprint=self.fingerprint, schema=self._schema, weight=weight, cap=cap, norm=norm,
            max_norm_ratio=cfg.max_norm_ratio, peer_caps=peer_caps, aggregation=cfg.aggregation,
            compression=cfg.compression, require_commitments=cfg.require_commitments, commitment=commitment,
            claims=claims, digests=digests, expect=expect_list(expected_peers) if expected_peers else None,
            refused=self._bench.named())

    def _step_and_wait(self, gather: dict, weight: float, cap: float, timeout_s: Optional[float],
                       stop: Optional[threading.Event]) -> tuple[Any, str]:
        """The averager's step, waited for within its deadline: ``(result, error)``."""
        cfg = self.config
        step_timeout = timeout_s if timeout_s is not None else cfg.matchmaking_timeout_s
        # hivemind's step has no overall deadline: a dead averager (or DHT) would never answer
        deadline_s = step_timeout + cfg.allreduce_timeout_s + AVERAGER_GRACE_S
        result, error = None, ""
        try:
            self._step = self._averager.step(gather=gather, weight=float(min(weight, cap)), timeout=step_timeout,
                                             allow_retries=True, wait=False)
            result = wait_unless_stopped(self._step, stop, deadline_s, alive=self._averager.is_alive)
            if result is None:
                error = "no group formed"
        except NoAnswer:
            error = ("the averager process is not running" if not self._averager.is_alive() else
                     f"the averager process did not finish the round within {deadline_s:g} s")
        except Exception as e:  # hivemind surfaces matchmaking failures as various exception types
            error = f"{type(e).__name__}: {e}"[:300] or type(e).__name__
        finally:
            self._let_go_of_step()
        return result, error

    def name_refused(self, peer_ids: Sequence[str]) -> None:
        """Name these peers as refused reducers in our gathers for the next BENCH_ROUNDS rounds, as
        if our own checks had refused them (a validator's round audit caught them: docs/protocol.md,
        "Round audit"); a majority of the group naming one benches it."""
        self._bench.name(list(peer_ids)[:MAX_REFUSED_NAMED], BENCH_ROUNDS)

    # -- what we sent (kept by the averager process) -----------------------------------------------
    def sent_sketches(self, round_id: str, nonce: str):
        """float32 [num_parts, k]: the sketches under ``nonce`` of what we sent in round ``round_id``,
        as a receiver decodes it; LookupError once the averager no longer keeps that round."""
        return self._ask_kept(CallerQuestion(round_id, nonce=nonce))

    def sent_wire(self, round_id: str, part: int) -> bytes:
        """The wire bytes of part ``part`` of what we sent in round ``round_id`` (IndexError when
        there is no such part; LookupError once the round is no longer kept)."""
        if not 0 <= part < self.num_parts:
            raise IndexError(f"part {part} of {self.num_parts}")
        return self._ask_kept(CallerQuestion(round_id, part=int(part)))

    @property
    def num_parts(self) -> int:
        """How many parts the averaged vector is split into on the wire."""
        return len(self._part_layout())

    def _ask_kept(self, question: CallerQuestion):
        try:
            answer = self._averager.ask_handler(question, KEPT_ANSWER_TIMEOUT_S)
        except (IndexError, ValueError):
            raise
        except Exception as exc:  # the averager went away, or did not answer in time
            raise LookupError(f"the averager could not answer for round {question.round_id}: {exc!r}") from exc
        if answer is None:
            raise LookupError(f"round {question.round_id} is no longer kept (only the last round is)")
        return answer

    # -- the record ------------------------------------------------------------------------------
    def _let_go_of_step(self) -> None:
        step = self._step
        if step is not None:
            self._last_stage = step.stage.name  # set before the step goes: `stage` reads both
            self._step = None

    def _new_record(self, started: float, duration_s: float, tokens: int) -> RoundRecord:
        return RoundRecord(round_id="", local_peer_id=self.peer_id, started_at=started, duration_s=duration_s,
                           num_elements=sum(b.numel() for b in self._buffers), model_fingerprint=self.fingerprint,
                           compression=self.config.compression, mode=self.mode, tokens=int(tokens))

    def _mark_failed(self, record: RoundRecord, error: str, weight: float) -> None:
        record.error = error
        record.group = [self.peer_id]
        record.peers = [PeerResult(self.peer_id, Outcome.FAIL, float(weight), 0.0, error)]

    def _keep(self, record: RoundRecord) -> RoundRecord:
        self.last_record = record
        if self._log is not None:
            self._log.append(record)
        return record

    def _failed_record(self, error: str, weight: float, tokens: int) -> RoundRecord:
        """The record of a round this peer could not even start (its averager is gone). Nothing
        is said of the expected peers: this peer could not look (its own fault, not theirs)."""
        record = self._new_record(time.time(), 0.0, tokens)
        self._mark_failed(record, error, weight)
        return self._keep(record)

    def _fill(self, record: RoundRecord, report: RoundReport, tensors: Sequence[torch.Tensor]) -> None:
        """Copy the averager's report into ``record``, and the average into ``tensors``."""
        for name in ("round_id", "bytes_sent", "bytes_received", "fraction_averaged", "fraction_refused",
                     "fraction_recovered", "total_weight", "allreduce_s", "result_check_s"):
            setattr(record, name, getattr(report, name))
        record.group, record.peers = list(report.group), list(report.peers)
        record.work_reports, record.evidence = dict(report.work_reports), report.evidence
        # reducers refused for what they returned are named in our next gathers (group_rules.bench_votes)
        self._bench.tick()
        self._bench.name(report.refused, BENCH_ROUNDS)
        if report.out_of_step:
            record.error = report.out_of_step  # nothing of this group is ours to apply
            return
        with self._averager.tensors_within(self.config.allreduce_timeout_s + AVERAGER_GRACE_S) as bufs:
            for b, t in zip(bufs, tensors):
                if not _same_memory(b, t):
                    t.copy_(b.to(device=t.device, dtype=t.dtype))

    def _commitment(self, tensors, work, nonce: str) -> tuple[dict, bytes, bytes]:
        """(the gather's commitment, the claims and part digests it commits to): those go to our
        averager, which hands each reducer those of its share (contribution.py)."""
        from dtrain.swarm.averaging.contribution import Commitment, commit_parts

        if work is None or self.report_type is None or not isinstance(work, self.report_type):
            raise ValueError(f"a committed round needs a work report of this swarm's kind ({self.report_type}), "
                             f"got {type(work).__name__}")
        compression = make_compression(self.config.compression)
        claims, digests = commit_parts([t.detach().float().cpu() for t in tensors], self._part_layout(), nonce,
                                       compression)
        return Commitment.of_claims(nonce, work, claims, digests).to_gather(), claims.tobytes(), digests.tobytes()

    def _part_layout(self):
        """hivemind's parts of our tensors under the wire codec (the same every round)."""
        from dtrain.swarm.averaging.contribution import PartLayout

        if self._layout is None:
            self._layout = PartLayout.of(self._buffers, make_compression(self.config.compression),
                                         self.config.part_size_bytes)
        return self._layout

    def problem(self) -> Optional[str]:
        """Why this swarm's averager cannot take part in rounds (its process is gone), or None."""
        averager = self._averager
        if averager is None:
            return "the averager is shut down"
        if not averager.is_alive():
            return f"the averager process is not running (exit code {averager.exitcode})"
        return None

    def set_state_priority(self, priority: float) -> None:
        """Peers catching up download from the highest priority; neurons use their epoch."""
        if self._averager is not None:
            self._averager.state_sharing_priority = float(priority)

    def load_state_from_peers(self, timeout_s: Optional[float] = 30.0, stop: Optional[threading.Event] = None):
        """Download ``(metadata, tensors)`` from a peer that shares state (None if nobody answered).

        Raises :class:`~dtrain.swarm.averaging.waits.Interrupted` when ``stop`` is set first.
        """
        future = self._averager.load_state_from_peers(wait=False, timeout=timeout_s)
        return wait_unless_stopped(future, stop, timeout_s)

    def shutdown(self) -> None:
        if self._averager is not None:
            try:
                if self._averager.is_alive():
                    self._averager.shutdown()
            finally:
                self._averager = None

    def __enter__(self) -> "GradientSwarm":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


# How long release_buffers waits for the buffers: a round in progress keeps them (and needs them).
RELEASE_WAIT_S = 1.0


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors are the very same elements (a buffer passed back as itself)."""
    return a.device == b.device and a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.dtype == b.dtype
