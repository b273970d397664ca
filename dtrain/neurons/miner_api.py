"""The miner's HTTP service: what it answers validators, from which thread.

The API server's threads authenticate requests (btauth/1, validator permits) and answer
what needs no model from the miner's published state (status, the round audit, a state
slice copied under the model lock); a Train query or an all-reduce round becomes a job on
the training thread (``Miner.jobs``), which owns the model. docs/protocol.md, "Miner HTTP API".
"""

from __future__ import annotations

import math
from concurrent.futures import TimeoutError as FuturesTimeout

from dtrain import __version__
from dtrain.api.messages import (
    AllReduceRequest, AllReduceResponse, RoundAuditRequest, RoundAuditResponse, StatusResponse, TrainRequest,
    TrainResponse,
)
from dtrain.neurons.runtime import NeuronError

# The most Train pages one validator query may ask of this miner (a permitted validator is
# trusted to query, not to freeze the training thread for a day or exhaust memory).
MAX_QUERY_PAGES = 64
# How long a Train query waits for the training thread.
TRAIN_ANSWER_S = 300.0
# How long a round audit waits for our own round to end: a validator audits as soon as its round
# ended, and ours may end moments later. Well inside the validator's 60 s audit request.
ROUND_AUDIT_WAIT_S = 20.0


class MinerApi:
    """The API of one running ``miner`` (dtrain.neurons.miner.Miner)."""

    def __init__(self, miner):
        self.miner = miner

    def start(self):
        """Start the server; ``(server, the API address to commit)``. NeuronError when that
        address would send every validator to its own machine (loopback outside the sandbox)."""
        from dtrain.api.messages import QueryLimits
        from dtrain.api.server import Handlers, MinerApiServer
        from dtrain.chain.permits import ValidatorPermits
        from dtrain.metrics import register
        from dtrain.swarm.deadlines import max_accepted_deadline_s
        from dtrain.swarm.reachability import REFUSE, WARN, check_api, committed_api_address

        m, a = self.miner, self.miner.cfg.api
        server = MinerApiServer(
            Handlers(status=self.status, train=self.train, allreduce=self.allreduce, state_slice=self.state_slice,
                     round_audit=self.round_audit),
            self_hotkey=m.hotkey, is_allowed=ValidatorPermits(m.chain, refresh_s=30.0),
            host=a.host, port=a.port, max_body_bytes=a.max_body_bytes,
            limits=QueryLimits(max_pages=MAX_QUERY_PAGES, max_deadline_s=max_accepted_deadline_s(m.cfg.allreduce)))
        register(m.tel, server.registry)
        server.start()
        address = committed_api_address(a.external_address, a.host, server.port)
        finding = check_api(address, m.cfg.chain.network,
                            source="api.external_address" if a.external_address else "api.host/api.port")
        if finding.level == REFUSE:
            server.stop()
            raise NeuronError(finding.message)
        if finding.level == WARN:
            m.tel.event(f"warning: {finding.message}")
        return server, address

    def status(self) -> StatusResponse:
        m = self.miner
        snap = m.tel.snapshot()
        loss = snap.loss if snap.loss is not None and math.isfinite(snap.loss) else None
        progress = m.bench.mode.progress()
        return StatusResponse(
            version=__version__, uid=m.uid, epoch=m.epoch, kind="miner", samples=progress.samples,
            samples_accumulated=m._samples_this_epoch(), inner_step=progress.inner_step,
            model_fingerprint=m.bench.fingerprint, swarm_fingerprint=m.bench.swarm_fingerprint,
            params_digest=m._digest, peer_id=m.node.peer_id, maddrs=tuple(m._maddrs), loss=loss, state=snap.state)

    def train(self, request: TrainRequest, caller: str) -> TrainResponse:
        from dtrain.api.server import HandlerError

        future = self.miner.jobs.submit(lambda: self.miner._do_train(request))
        try:
            return future.result(timeout=TRAIN_ANSWER_S)
        except FuturesTimeout:
            future.cancel()  # a late answer is useless to the validator: do not train it later
            raise HandlerError(503, "training thread busy; try again") from None

    def allreduce(self, request: AllReduceRequest, caller: str) -> AllReduceResponse:
        from dtrain.api.server import HandlerError

        m = self.miner
        if not m._joins_rounds():
            return AllReduceResponse(joined=False, epoch=m.epoch, round=None, reason="not joining")
        future = m.jobs.submit(lambda: m._do_round(request))
        try:
            return future.result(timeout=request.deadline_s + 120)
        except FuturesTimeout:
            future.cancel()
            raise HandlerError(503, "round did not finish in time") from None

    def round_audit(self, request: RoundAuditRequest, caller: str) -> RoundAuditResponse:
        """The secret-seed audit of our last round (dtrain.swarm.averaging.audit): what we sent,
        sketched under the validator's seed, or one part's wire bytes for a dispute. 404 when
        that round is not the one we kept (only the last is). An audit that arrives while our
        round is still ending waits for it (ROUND_AUDIT_WAIT_S)."""
        import base64

        from dtrain.api.server import HandlerError
        from dtrain.swarm.averaging.audit import audit_nonce

        swarm = self.miner.round_swarm
        if swarm is None or not swarm.wait_for_sent(request.group, ROUND_AUDIT_WAIT_S):
            raise HandlerError(404, f"no committed round {request.group} kept here (only the last round is)")
        parts = swarm.num_parts
        if request.part is not None and request.part >= parts:
            raise HandlerError(422, f"field 'part' must be below {parts}")
        try:
            if request.part is not None:
                return RoundAuditResponse(parts=parts, wire=base64.b64encode(
                    swarm.sent_wire(request.group, request.part)).decode())
            sketches = swarm.sent_sketches(request.group, audit_nonce(bytes.fromhex(request.seed)))
        except LookupError as exc:  # the averager no longer keeps it (its next round began)
            raise HandlerError(404, f"no committed round {request.group} kept here: {exc}") from None
        return RoundAuditResponse(parts=parts, sketches=base64.b64encode(sketches.tobytes()).decode())

    def state_slice(self, offset: int, length: int, snapshot: tuple[int, int] | None = None) -> bytes:
        """Bytes of the current (shared) parameters, float32, for the validator's bandwidth check;
        or, with ``snapshot`` = (epoch, step), of a committed DiLoCo snapshot for its replay."""
        from dtrain.neurons.sync import state_slice

        m = self.miner
        if snapshot is not None:
            from dtrain.api.server import HandlerError
            from dtrain.training.snapshots import SnapshotError

            try:
                return m.bench.mode.snapshot(snapshot[0], snapshot[1], offset, length)
            except SnapshotError as exc:
                raise HandlerError(404, str(exc)) from None
        with m.model_lock:
            return state_slice(m.trainer, offset, length)
