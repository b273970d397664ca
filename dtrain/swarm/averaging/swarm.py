"""GradientSwarm: the caller's side of gradient averaging (runs in the neuron's process).

One GradientSwarm per model: :meth:`GradientSwarm.run_round` puts this peer's tensors and its
gather (group_rules.make_gather) into the averager process (averager.py), waits for the round,
and turns the result into a :class:`~dtrain.swarm.records.RoundRecord` from this peer's view.
"""

from __future__ import annotations

import functools
import math
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Optional, Sequence

import torch

import dtrain.swarm.hivemind_internals  # noqa: F401  (first: hivemind's shims, and its version check)
from dtrain.swarm.averaging.assembly import expect_list
from dtrain.swarm.averaging.group_rules import BENCH_ROUNDS, MAX_REFUSED_NAMED, make_gather, schema_hash
from dtrain.swarm.averaging.norms import part_check
from dtrain.swarm.averaging.settings import AveragingConfig, part_size_for
from dtrain.swarm.wire import make_compression
from dtrain.swarm.records import Outcome, PeerResult, RoundLog, RoundRecord


class Interrupted(Exception):
    """A wait was abandoned because the caller's stop event was set."""


class NoAnswer(FutureTimeout):
    """A wait ran out of its own time (not the future's own timeout error)."""


# How often a blocked wait looks at its stop event: short enough that SIGINT ends a neuron
# promptly, long enough to cost nothing.
_STOP_POLL_S = 0.25
# Beyond a round's matchmaking and all-reduce timeouts, how long the caller waits for the
# averager process before it counts the process as hung (its record says so; the neuron then
# restarts the swarm node, dtrain/neurons/swarm_health.py).
AVERAGER_GRACE_S = 30.0


def wait_unless_stopped(future, stop: Optional[threading.Event], timeout_s: Optional[float] = None,
                        alive: Optional[Callable[[], bool]] = None):
    """``future.result(timeout_s)``, but cancel the future and raise :class:`Interrupted` once ``stop`` is set.

    hivemind's futures block in a lock that a signal does not wake; a neuron that got SIGINT
    mid-round would otherwise sit out the whole matchmaking and all-reduce timeouts before it
    could save its checkpoint and leave. Raises ``concurrent.futures.TimeoutError`` (and
    cancels the future) after ``timeout_s``: a :class:`NoAnswer`, which callers can tell from the
    future's own TimeoutError. With ``alive`` (whether the process that owes the answer still
    runs), a dead one ends the wait at once, with a :class:`NoAnswer` that says so.
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        if stop is not None and stop.is_set():
            future.cancel()
            raise Interrupted("stopped while waiting for the swarm")
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            future.cancel()
            raise NoAnswer(f"no answer within {timeout_s:g} s")
        wait_s = _STOP_POLL_S if remaining is None else min(_STOP_POLL_S, remaining)
        try:
            return future.result(timeout=wait_s)
        except FutureTimeout:
            if future.done():  # the future's own outcome is a timeout (Python 3.11: one class)
                raise
        if alive is not None and not future.done() and not alive():
            future.cancel()
            raise NoAnswer("the process that owed the answer is not running")


# How long the neuron waits for its averager process to sketch (or serialise a part of) what it
# sent: a model's worth of sketches takes seconds on a CPU.
KEPT_ANSWER_TIMEOUT_S = 300.0


class KeptContribution:
    """What this peer sent in its last committed round, for the validators' round audit: its
    averager process keeps the one copy (it answers the members' result checks from it too), and
    this asks it. The interface of audit.SentContribution; LookupError once the averager no
    longer keeps the round (its next round began, or it went away)."""

    def __init__(self, averager, round_id: str, layout, compression):
        self._averager = averager
        self.round_id = round_id
        self.layout = layout
        self.compression = compression

    def _ask(self, **kwargs):
        try:
            answer = self._averager.call_in_process("_answer_caller", KEPT_ANSWER_TIMEOUT_S, round_id=self.round_id,
                                                    **kwargs)
        except (IndexError, ValueError):
            raise
        except Exception as exc:  # the averager went away, or did not answer in time
            raise LookupError(f"the averager could not answer for round {self.round_id}: {exc!r}") from exc
        if answer is None:
            raise LookupError(f"round {self.round_id} is no longer kept (only the last round is)")
        return answer

    def sketches(self, nonce: str):
        """float32 [num_parts, k]: each part's sketch under ``nonce``, as a receiver decodes it."""
        return self._ask(nonce=nonce, part=None)

    def wire(self, part: int) -> bytes:
        """The wire bytes of part ``part`` (IndexError when there is no such part)."""
        if not 0 <= part < len(self.layout):
            raise IndexError(f"part {part} of {len(self.layout)}")
        return self._ask(nonce=None, part=int(part))


class GradientSwarm:
    """One averaging participant. Create once per model; call :meth:`run_round` per global step.

    ``templates`` fixes the order, shapes and dtypes of the tensors every round averages
    (e.g. ``[p.grad for p in model.parameters()]`` or zeros shaped like them).
    ``state_provider`` (optional) returns ``(metadata, tensors)`` for peers catching up.
    """

    def __init__(
        self,
        dht,
        templates: Sequence[torch.Tensor],
        fingerprint: str,
        config: Optional[AveragingConfig] = None,
        *,
        state_provider: Optional[Callable[[], tuple[Any, Sequence[torch.Tensor]]]] = None,
        mode: str = "gradient",
    ):
        self.dht = dht
        config = config or AveragingConfig()
        if config.part_size_bytes is None:
            config = config.replace(part_size_bytes=part_size_for(sum(4 * t.numel() for t in templates)))
        self.config = config
        self.fingerprint = str(fingerprint)
        self.mode = mode
        self._buffers = [torch.zeros_like(t, device="cpu").float() for t in templates]
        self._schema = schema_hash(self._buffers, self.config.part_size_bytes)
        self._log = RoundLog(self.config.log_path) if self.config.log_path else None
        # Only the last round is kept in memory (a neuron runs for weeks); the round log on
        # disk (config.log_path) keeps them all.
        self.last_record: Optional[RoundRecord] = None
        # The running round's hivemind StepControl. It is dropped when the round ends: it holds
        # a descriptor of the averager process's result pipe, which would otherwise stay open
        # until the next round (one more fd for the soak to count, for no use).
        self._step = None
        self._last_stage: Optional[str] = None
        self._layout = None
        # reducer peer id -> how many more of our rounds we name it in our gather as refused
        # (bounded by the peers we meet; kept in memory: a restart forgets, which only delays
        # a bench by one refusal)
        self._bench: dict[str, int] = {}
        # what we sent in our last committed round, for its secret-seed audit (audit.py): a
        # KeptContribution, whose one copy the averager process keeps
        self.last_sent = None
        self._committed = False
        cfg = self.config
        self._averager = self._new_averager(
            self._buffers,
            dht,
            state_provider=state_provider,
            start=True,
            prefix=cfg.prefix,
            target_group_size=cfg.target_group_size,
            min_group_size=cfg.min_group_size,
            min_matchmaking_time=cfg.min_matchmaking_time_s,
            request_timeout=cfg.request_timeout_s,
            allreduce_timeout=cfg.allreduce_timeout_s,
            sender_timeout=cfg.sender_timeout_s,
            reducer_timeout=cfg.reducer_timeout_s,
            next_chunk_timeout=cfg.sender_timeout_s,
            compression=make_compression(cfg.compression),
            part_size_bytes=cfg.part_size_bytes,
            bandwidth=cfg.bandwidth,
            client_mode=cfg.client_mode,
            allow_state_sharing=cfg.allow_state_sharing if not cfg.client_mode else False,
            declare_state_period=cfg.declare_state_period_s,
        )

    def _new_averager(self, buffers, dht, **kwargs):
        """Start the averager process (tests substitute one that misbehaves: tests/faults.py)."""
        from dtrain.swarm.averaging.averager import SwarmAverager

        return SwarmAverager(buffers, dht, **kwargs)

    @property
    def peer_id(self) -> str:
        return str(self.dht.peer_id)

    @property
    def stage(self) -> Optional[str]:
        """Stage of the current/last round: LOOKING_FOR_GROUP, RUNNING_ALLREDUCE, FINISHED... (None before any)."""
        step = self._step
        return self._last_stage if step is None else step.stage.name

    def run_round(
        self,
        tensors: Sequence[torch.Tensor],
        weight: float,
        cap: float,
        *,
        expected_peers: Sequence[str] = (),
        tokens: int = 0,
        timeout_s: Optional[float] = None,
        peer_caps: Optional[dict[str, float]] = None,
        stop: Optional[threading.Event] = None,
        work=None,
        work_nonce: Optional[str] = None,
    ) -> RoundRecord:
        """Average ``tensors`` in place with whoever matchmakes; return this peer's RoundRecord.

        ``weight`` is the number of samples accumulated (0 for a validator), ``cap`` the largest
        weight this peer accepts from anyone, and ``peer_caps`` (peer id -> limit) tighter limits for
        particular peers, such as the weight a validator has verified for each miner. On failure
        to form a group the tensors keep their local values and the record carries ``error``.
        ``expected_peers`` (peer ids) that did not join are reported NON_PARTICIPATING or
        NOT_ALIVE; they also go in the gather, so that a peer without weight (a validator)
        lets its group form as soon as all of them joined (assembly.py). Setting ``stop`` (a
        neuron shutting down) abandons the round at once: the tensors keep their local values
        and the record's error says it was interrupted.

        ``work`` (a WorkReport) and ``work_nonce`` commit this contribution to the pages it came
        from (contribution.py); a peer without weight (a validator) passes an empty report. The
        record's ``work_reports`` then holds every committed report of the group.
        """
        if len(tensors) != len(self._buffers):
            raise ValueError(f"expected {len(self._buffers)} tensors, got {len(tensors)}")
        squares = 0.0
        for i, (t, b) in enumerate(zip(tensors, self._buffers)):
            if tuple(t.shape) != tuple(b.shape):
                raise ValueError(f"tensor #{i} has shape {tuple(t.shape)}, expected {tuple(b.shape)}")
            # finiteness and norm in one pass (a separate isfinite pass cost more than the norm)
            finite, norm = part_check(t)
            if not finite:
                # an honest peer never ships NaN/Inf; refuse locally instead of being banned remotely
                raise ValueError(f"tensor #{i} has non-finite values; skip this round or fix the step")
            squares += norm * norm
        if not (math.isfinite(weight) and weight >= 0 and math.isfinite(cap) and cap >= 0):
            raise ValueError("weight and cap must be finite and >= 0")
        cfg = self.config
        problem = self.problem()
        if problem:  # hivemind's step() itself would wait for ever for a dead averager
            return self._failed_record(problem, weight, tokens)
        try:
            with self._averager.tensors_within(cfg.allreduce_timeout_s + AVERAGER_GRACE_S) as bufs:
                for b, t in zip(bufs, tensors):
                    b.copy_(t.detach().to(device="cpu", dtype=b.dtype))
        except TimeoutError as exc:
            return self._failed_record(str(exc), weight, tokens)
        norm = math.sqrt(squares)
        self.last_sent = None
        commitment, claims, digests = (self._commitment(tensors, work, work_nonce) if work_nonce is not None
                                       else (None, None, None))
        self._committed = commitment is not None
        gather = make_gather(
            fingerprint=self.fingerprint, schema=self._schema, weight=weight, cap=cap, norm=norm,
            max_norm_ratio=cfg.max_norm_ratio, peer_caps=peer_caps, aggregation=cfg.aggregation,
            compression=cfg.compression, require_commitments=cfg.require_commitments,
            commitment=commitment, claims=claims, digests=digests, expect=expect_list(expected_peers) if expected_peers else None,
            refused=sorted(self._bench, key=lambda p: -self._bench[p]))
        started = time.time()
        t0 = time.monotonic()
        result, error = None, ""
        step_timeout = timeout_s if timeout_s is not None else cfg.matchmaking_timeout_s
        try:
            self._step = self._averager.step(
                gather=gather,
                weight=float(min(weight, cap)),
                timeout=step_timeout,
                allow_retries=True,
                wait=False,
            )
            # hivemind's step has no overall deadline: an averager process that died (or whose
            # DHT died) would leave this wait open for ever.
            averager = self._averager
            result = wait_unless_stopped(self._step, stop, step_timeout + cfg.allreduce_timeout_s + AVERAGER_GRACE_S,
                                         alive=averager.is_alive)
            if result is None:
                error = "no group formed"
        except NoAnswer:
            error = ("the averager process is not running" if not self._averager.is_alive() else
                     "the averager process did not finish the round within "
                     f"{step_timeout + cfg.allreduce_timeout_s + AVERAGER_GRACE_S:g} s")
        except Exception as e:  # hivemind surfaces matchmaking failures as various exception types
            error = f"{type(e).__name__}: {e}"[:300] or type(e).__name__
        finally:
            self._let_go_of_step()
        record = self._new_record(started, time.monotonic() - t0, tokens)
        if error or not isinstance(result, dict) or "report" not in result:
            self._mark_failed(record, error or "averager returned no report", weight)
        else:
            self._fill(record, result["report"], tensors)
        missing = [p for p in expected_peers if p not in record.group]
        if missing:
            alive = self._reachable(missing)
            for p in missing:
                outcome = Outcome.NON_PARTICIPATING if alive.get(p) else Outcome.NOT_ALIVE
                record.peers.append(PeerResult(p, outcome, reason="did not join the group"))
        return self._keep(record)

    def name_refused(self, peer_ids: Sequence[str]) -> None:
        """Name these peers as refused reducers in our gathers for the next BENCH_ROUNDS rounds,
        as if our own checks had refused them (a validator's secret-seed round audit caught them:
        docs/protocol.md, "Round audit"); a majority of the group naming one benches it."""
        for p in list(peer_ids)[:MAX_REFUSED_NAMED]:
            self._bench[str(p)] = BENCH_ROUNDS

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

    def _fill(self, record: RoundRecord, rep: dict, tensors: Sequence[torch.Tensor]) -> None:
        """Copy the averager's report into ``record``, and the average into ``tensors``."""
        record.round_id = rep["round_id"]
        record.group = list(rep["group"])
        record.peers = [PeerResult.from_dict(p) for p in rep["peers"]]
        record.bytes_sent = rep["bytes_sent"]
        record.bytes_received = rep["bytes_received"]
        record.fraction_averaged = rep["fraction_averaged"]
        record.fraction_refused = rep.get("fraction_refused", 0.0)
        record.fraction_recovered = rep.get("fraction_recovered", 0.0)
        # reducers refused for what they returned are named in our next gathers (group_rules.bench_votes)
        self._bench = {p: n - 1 for p, n in self._bench.items() if n > 1}
        for p in rep.get("refused", ()):
            self._bench[str(p)] = BENCH_ROUNDS
        record.total_weight = rep["total_weight"]
        record.allreduce_s = rep["allreduce_s"]
        record.result_check_s = float(rep.get("result_check_s", 0.0))
        record.work_reports = dict(rep.get("work_reports") or {})
        record.evidence = self._evidence(rep.get("evidence"))
        if self._committed and record.round_id:
            compression = make_compression(self.config.compression)
            self.last_sent = KeptContribution(self._averager, record.round_id, self._part_layout(compression),
                                              compression)
        if rep.get("out_of_step"):
            record.error = rep["out_of_step"]  # nothing of this group is ours to apply
            return
        with self._averager.tensors_within(self.config.allreduce_timeout_s + AVERAGER_GRACE_S) as bufs:
            for b, t in zip(bufs, tensors):
                t.copy_(b.to(device=t.device, dtype=t.dtype))

    def _commitment(self, tensors, work, nonce: str) -> tuple[dict, bytes, bytes]:
        """(the gather's commitment, the claims and part digests it commits to): those go to our
        averager, which hands each reducer those of its share (contribution.py). What we send is
        kept by the averager process until its next round (last_sent asks it), for this round's
        audits (result_check.py, audit.py)."""
        from dtrain.swarm.averaging.contribution import Commitment, commit_parts
        from dtrain.training.work import WorkReport

        compression = make_compression(self.config.compression)
        layout = self._part_layout(compression)
        claims, digests = commit_parts([t.detach().float().cpu() for t in tensors], layout, nonce, compression)
        report = work if work is not None else WorkReport(epoch=0)
        return Commitment.of_claims(nonce, report, claims, digests).to_gather(), claims.tobytes(), digests.tobytes()

    def _evidence(self, data):
        """The audit's RoundEvidence from the averager's plain values (None without accounts)."""
        from dtrain.swarm.averaging.audit import ReducedPart, RoundEvidence
        from dtrain.swarm.averaging.result_check import ResultCheck

        if not isinstance(data, dict):
            return None
        compression = make_compression(self.config.compression)
        parts = {int(g): ReducedPart(reducer, tuple(c), tuple(d)) for g, (reducer, c, d) in data["parts"].items()}
        check = data.get("result_check")
        return RoundEvidence(senders=list(data["senders"]), layout=self._part_layout(compression),
                             compression=compression, parts=parts,
                             result_check=ResultCheck.from_plain(check) if check else None)

    def _part_layout(self, compression):
        """hivemind's parts of our tensors under the wire codec (the same every round)."""
        from dtrain.swarm.averaging.contribution import PartLayout

        if self._layout is None:
            self._layout = PartLayout.of(self._buffers, compression, self.config.part_size_bytes)
        return self._layout

    def _reachable(self, peer_ids: Sequence[str], timeout_s: float = 3.0) -> dict[str, bool]:
        from dtrain.swarm.node import _ping_peer_ids

        try:
            future = self.dht.run_coroutine(functools.partial(_ping_peer_ids, list(peer_ids), timeout_s),
                                            return_future=True)
            # bounded: a DHT process that died never answers (the pings time out after timeout_s)
            return future.result(timeout=timeout_s + 5.0)
        except Exception:
            return {p: False for p in peer_ids}

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

        Raises :class:`Interrupted` when ``stop`` is set before the download finishes.
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
