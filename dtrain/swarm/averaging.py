"""Gradient averaging over hivemind's butterfly all-reduce, with dtrain's robustness rules.

Transport, matchmaking and the butterfly itself are hivemind's (DecentralizedAverager /
AllReduceRunner / TensorPartReducer). dtrain subclasses them only where the protocol needs
a rule hivemind does not have:

* Model check (WRONG_MODEL). Every peer puts ``{fingerprint, schema}`` in its matchmaking
  gather data. All peers use one constant matchmaking schema hash, so a peer with a
  different model still *joins* (and can be reported) but each honest peer then marks it
  as auxiliary with a zero share: it owns no part, and its part RPCs are refused
  (hivemind answers PROTOCOL_VIOLATION to a non-sender). The partition is a pure function
  of the gathered data, so all peers that agree on the model compute the same one.
* Weight cap. hivemind lets each sender state its own weight on every message. dtrain's
  reducer ignores the wire weight and uses ``min(claimed_weight_from_gather, cap)``, with
  ``cap`` the *reducing* peer's own limit: a peer claiming a huge weight cannot dominate
  the parts others reduce.
* Non-finite values. The reducer rejects a part containing NaN/Inf, bans that sender from
  the rest of the round (FAIL) and never adds its values. Averaged parts coming back from
  a reducer are checked too; a non-finite result makes us keep our LOCAL values for that
  peer's share (FAIL).
* Failures keep local values. A reducer that drops out or times out leaves its share at
  our local values (hivemind's ``register_failed_reducer``); a sender that is too slow
  (``sender_timeout``) or dies is banned by hivemind and the rest is averaged without it.

Each round yields a :class:`~dtrain.swarm.records.RoundRecord` from this peer's view.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Optional, Sequence

import torch

from dtrain.swarm import compat, startup
from dtrain.swarm.command_pipe import ServesCommandPipe
from dtrain.swarm.records import Outcome, PeerResult, RoundLog, RoundRecord

compat.apply()

from hivemind.averaging import DecentralizedAverager  # noqa: E402  (after the shim, on purpose)
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode  # noqa: E402
from hivemind.averaging.group_info import GroupInfo  # noqa: E402
from hivemind.averaging.matchmaking import MatchmakingException  # noqa: E402
from hivemind.averaging.partition import AllreduceException, BannedException, TensorPartReducer  # noqa: E402
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor  # noqa: E402
from hivemind.p2p import P2PContext  # noqa: E402
from hivemind.proto import averaging_pb2  # noqa: E402
from hivemind.utils.asyncio import amap_in_executor, as_aiter, azip, enter_asynchronously  # noqa: E402
from hivemind.utils.timed_storage import get_dht_time  # noqa: E402

logger = logging.getLogger(__name__)

GATHER_VERSION = 1

def _undeclare_in_background(key_manager) -> None:
    """Make a peer's "no longer looking for a group" DHT store fire and forget.

    hivemind's leader, once its group is assembled, cancels its own search, and the search's
    cleanup *awaits* that DHT store before the leader may start the all-reduce. The followers
    start at once and fill the links, so the store (a DHT round trip under load) held the
    leader back 0.7-2.8 s at 8 peers on 25 Mbit links while every reducer waited for its
    parts. Nothing depends on the store's reply: it is written with the declaration's own
    expiration (nudged up), so a store that lands after the next round's declaration (a
    later expiration) is overridden by it.
    """
    if getattr(key_manager, "_dtrain_prompt", False):
        return
    declare = key_manager.declare_averager
    pending: set = set()

    async def declare_averager(group_key, peer_id, expiration_time, looking_for_group: bool = True) -> bool:
        if looking_for_group:
            return await declare(group_key, peer_id, expiration_time, looking_for_group)
        task = asyncio.get_event_loop().create_task(declare(group_key, peer_id, expiration_time, False))
        pending.add(task)  # keep a reference until it finishes, or asyncio may collect it
        task.add_done_callback(lambda t: (pending.discard(t), t.cancelled() or t.exception()))
        return True

    key_manager.declare_averager = declare_averager
    key_manager._dtrain_prompt = True


# How long a reducer keeps a sender's stream open after its last averaged part, waiting for
# the sender to hang up (it does so at once; this only bounds a sender that does not).
REPLY_LINGER_S = 30.0

# How long a leader holds its parts back for its followers' BEGIN messages to leave (a dead
# follower's write fails at once; this only bounds a stuck one).
BEGIN_FLUSH_LIMIT_S = 5.0


@dataclass
class AveragingConfig:
    """Knobs of one averaging swarm (the lead maps the TOML ``[swarm]`` table onto this)."""

    prefix: str = "dtrain"  # run namespace; peers of one run must share it
    min_group_size: int = 2
    target_group_size: Optional[int] = 16
    min_matchmaking_time_s: float = 5.0
    request_timeout_s: float = 3.0
    allreduce_timeout_s: float = 120.0
    sender_timeout_s: Optional[float] = 10.0  # a sender silent this long between parts is banned
    reducer_timeout_s: Optional[float] = None  # default 2 x sender timeout
    matchmaking_timeout_s: float = 30.0  # give up looking for a group after this long
    compression: str = "none"  # none | fp16 | 8bit | 8bit-quantile
    part_size_bytes: int = 2**17  # 128 KiB: finer pipelining than hivemind's 512 KiB; measured faster in netns
    bandwidth: Optional[float] = None  # MB/s hint for load balancing; None = "same as others"
    client_mode: Optional[bool] = None  # None: follow the DHT
    allow_state_sharing: bool = True
    declare_state_period_s: float = 30.0
    log_path: Optional[str] = None  # JSON lines of RoundRecords
    # A contribution whose announced L2 norm exceeds this many times the median norm of the
    # weighted peers is refused (a scaled/noisy "poisoned" gradient); 0 disables the check.
    max_norm_ratio: float = 10.0
    # Work commitments (dtrain.swarm.contribution): with True, a peer that brings weight
    # without a commitment binding its contribution to its work report is excluded. The
    # neurons require them; the library default keeps bare averaging possible.
    require_commitments: bool = False
    # How a reducer combines the senders' parts: "mean" (hivemind's weighted mean) or
    # "centered_clip" (dtrain.swarm.robust: bounds what one undetected bad sender can do).
    aggregation: str = "mean"


class Interrupted(Exception):
    """A wait was abandoned because the caller's stop event was set."""


# How often a blocked wait looks at its stop event: short enough that SIGINT ends a neuron
# promptly, long enough to cost nothing.
_STOP_POLL_S = 0.25


def _wait_unless_stopped(future, stop: Optional[threading.Event], timeout_s: Optional[float] = None):
    """``future.result(timeout_s)``, but cancel the future and raise :class:`Interrupted` once ``stop`` is set.

    hivemind's futures block in a lock that a signal does not wake; a neuron that got SIGINT
    mid-round would otherwise sit out the whole matchmaking and all-reduce timeouts before it
    could save its checkpoint and leave. Raises ``concurrent.futures.TimeoutError`` (and
    cancels the future) after ``timeout_s``.
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        if stop is not None and stop.is_set():
            future.cancel()
            raise Interrupted("stopped while waiting for the swarm")
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            future.cancel()
            raise FutureTimeout(f"no answer within {timeout_s:g} s")
        wait_s = _STOP_POLL_S if remaining is None else min(_STOP_POLL_S, remaining)
        try:
            return future.result(timeout=wait_s)
        except FutureTimeout:
            if future.done():  # the future's own outcome is a timeout (Python 3.11: one class)
                raise


@dataclass
class FaultInjection:
    """Deliberate misbehaviour for tests and ``dtrain sandbox --adversary``. Never enabled by config."""

    send_delay_s: float = 0.0  # sleep before each part sent to another reducer (a slow peer)
    send_nonfinite: bool = False  # send NaN/Inf instead of our values (a broken/cheating peer)
    scale_parts: float = 1.0  # multiply sent parts after announcing the true norm (a lying poisoner)


def schema_hash(tensors: Sequence[torch.Tensor]) -> str:
    """Shapes and dtypes of the averaged tensors, in order (not values)."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(f"{tuple(t.shape)}:{t.dtype};".encode())
    return h.hexdigest()[:32]


# --------------------------------------------------------------------------------------------
# hivemind subclasses (run inside the averager's background process)
# --------------------------------------------------------------------------------------------


# Slack for the norm bounds: the wire codec can make a decoded part a little larger than the
# values sent. 8-bit (compat.BlockwiseAbsmax8Bit) adds at most eps = 0.031 relative, fp16 2**-11,
# hivemind's codebook quantizers nothing (a codebook of bucket means only shrinks a vector). An
# averaged part passes the codec twice (senders' parts, then the result): (1 + eps)^2 = 1.064 < 1.10.
NORM_SLACK = 1.10


def _within(norm: float, bound: float) -> bool:
    return norm <= bound * NORM_SLACK + 1e-6


def _part_check(part: torch.Tensor) -> tuple[bool, float]:
    """``(all values finite, L2 norm in float64)`` of a part, in one pass over it.

    For float32 (or narrower) values the float64 sum of squares cannot overflow, so the norm
    is finite exactly when every value is: one pass answers both checks. Wider dtypes keep the
    explicit test. Called in the thread that deserialises a part, off the event loop.
    """
    norm = float(part.double().norm())
    if part.element_size() <= 4:
        return math.isfinite(norm), norm
    return bool(torch.isfinite(part).all()), norm


def _scale_check(users, compatible, claimed, ratio: float) -> tuple[list[float], set[int]]:
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


class _CappedFiniteReducer(TensorPartReducer):
    """TensorPartReducer with receiver-side weights and a finiteness check.

    ``sender_weights`` are fixed at group formation (already capped); the weight a sender puts
    on the wire is ignored. A non-finite part bans its sender from this part onward.
    """

    def __init__(self, part_shapes, num_senders: int, sender_weights: Sequence[float],
                 sender_norms: Optional[Sequence[float]] = None, robust: bool = False):
        self.sender_weights = [float(w) for w in sender_weights]
        self.sender_norms = [float(n) for n in sender_norms] if sender_norms is not None else None
        self.robust = robust
        self.rejected: set[int] = set()
        self.too_large: set[int] = set()
        self.contradicted: set[int] = set()
        super().__init__(part_shapes, num_senders)

    def reset_accumulators(self):
        super().reset_accumulators()
        # unweighted running sum: used only if every contributor of a part has weight 0
        # (e.g. only validators left), where the weighted mean would be 0/0
        if not self.finished.is_set():
            self.plain_sum = torch.zeros(self.part_shapes[self.current_part_index])
        # with robust aggregation the senders' parts are kept until the last one arrives
        self.received_parts: list[tuple[torch.Tensor, float]] = []

    def reject(self, sender_index: int, reason_set: set, message: str):
        """Ban a sender whose part failed a check; its values are never added."""
        self.rejected.add(sender_index)
        reason_set.add(sender_index)
        self.on_sender_failed(sender_index)
        raise BannedException(f"sender {sender_index} {message}")

    async def accumulate_part(self, sender_index, part_index, tensor_part, weight=1.0, check=None):
        """Same contract as hivemind's: add a part, wait for the others, return the average part.

        Differences: ``weight`` from the wire is ignored (capped gathered weight is used), a
        non-finite part bans its sender instead of being added, and an unweighted sum is kept.
        ``check`` is :func:`_part_check` of the part when the caller computed it off the loop.
        """
        assert 0 <= sender_index < self.num_senders, "invalid sender index"
        assert 0 <= part_index < self.num_parts, "invalid part index"
        while part_index > self.current_part_index:
            # parts are reduced in order: wait until the previous ones are done
            await asyncio.wait(
                {self.current_part_future, asyncio.create_task(self.finished.wait())},
                return_when=asyncio.FIRST_COMPLETED,
            )
            if self.finished.is_set():
                raise AllreduceException(f"attempted to aggregate part in a finalized {type(self).__name__}")
        if self.sender_failed_after[sender_index] != float("inf"):
            raise BannedException(f"sender {sender_index} was banned in background")
        assert part_index == self.current_part_index
        finite, norm = _part_check(tensor_part) if check is None else check
        if not finite:
            # not counted as received: the ban takes effect from this very part
            self.rejected.add(sender_index)
            self.on_sender_failed(sender_index)
            raise BannedException(f"sender {sender_index} sent non-finite values")
        if self.sender_norms is not None and not _within(norm, self.sender_norms[sender_index]):
            self.rejected.add(sender_index)
            self.too_large.add(sender_index)
            self.on_sender_failed(sender_index)
            raise BannedException(f"sender {sender_index} sent a part larger than its announced norm")
        self.num_parts_received[sender_index] += 1
        current_part_future = self.current_part_future
        w = self.sender_weights[sender_index]
        if self.robust:
            self.received_parts.append((tensor_part, w))
        else:
            self.accumulator.add_(tensor_part, alpha=w)
        self.plain_sum.add_(tensor_part)
        self.current_part_accumulated_from += 1
        self.denominator += w
        self.check_current_part_finished()
        result = await current_part_future
        if isinstance(result, asyncio.Future):
            # robust aggregation runs in a worker thread (check_current_part_finished): the part
            # index has moved on already, and this is the combination still being computed
            result = await result
        return result

    def on_sender_failed(self, sender_index: int):
        # idempotent: hivemind may ban the same sender again from another code path, and a
        # second call would decrement the current part's sender count twice
        if self.sender_failed_after[sender_index] != float("inf"):
            return
        super().on_sender_failed(sender_index)

    def check_current_part_finished(self):
        assert self.current_part_accumulated_from <= self.num_current_senders
        if self.current_part_accumulated_from == self.num_current_senders:
            if self.robust and self.denominator > 0:
                from dtrain.swarm.robust import centered_clip

                # CenteredClip costs milliseconds per part: run it in a worker thread so the loop
                # keeps moving bytes and the next part accumulates meanwhile. The part's future
                # resolves now, with the future of the combination (accumulate_part awaits it):
                # senders of later parts wake up at once, and finalize() after the last part
                # cancels nothing that is still being computed.
                parts, weights = zip(*self.received_parts)
                result = asyncio.get_event_loop().run_in_executor(None, centered_clip, parts, weights)
            elif self.denominator > 0:
                result = self.accumulator.div_(self.denominator)
            elif self.current_part_accumulated_from > 0:
                result = self.plain_sum.div_(self.current_part_accumulated_from)
            else:
                # nobody contributed: NaN makes every receiver keep its local values for this part
                result = torch.full_like(self.accumulator, float("nan"))
            self.current_part_future.set_result(result)
            self.reset_accumulators()



class _DtrainRunner(AllReduceRunner):
    """AllReduceRunner that records per-peer outcomes and bytes, validates results, injects faults."""

    def __init__(self, *, sender_weights: Sequence[float], fault: Optional[FaultInjection],
                 sender_norms: Optional[Sequence[float]] = None, max_norm: Optional[float] = None,
                 robust: bool = False, sender_claims: Optional[Sequence] = None, claims_nonce: str = "",
                 layout=None, **kwargs):
        super().__init__(**kwargs)
        # per sender (in sender order): its claims array [num_parts, k], or None (not checked)
        self.sender_claims = list(sender_claims) if sender_claims is not None else None
        self.claims_nonce = claims_nonce
        self.layout = layout
        self.fault = fault or FaultInjection()
        self.bytes_sent = 0
        self.bytes_received = 0
        self.failed_reducers: dict[Any, str] = {}
        # (part index, compression) -> (averaged part, future of its serialised form)
        self._serialized_cache: dict[tuple[int, int], tuple[torch.Tensor, asyncio.Future]] = {}
        # swap hivemind's reducer for ours (same shapes); retire the old one quietly
        old = self.tensor_part_reducer
        old.finished.set()
        old.current_part_future.cancel()
        self.tensor_part_reducer = _CappedFiniteReducer(
            tuple(part.shape for part in self.parts_for_local_averaging), len(self.sender_peer_ids), sender_weights,
            sender_norms, robust=robust,
        )
        container_ = self.tensor_part_container
        me = self.ordered_peer_ids.index(self.peer_id)
        # global index of the first part this peer reduces (parts go to reducers in order)
        self.first_part = sum(container_.num_parts_by_peer[:me])
        container = self.tensor_part_container
        register = container.register_processed_part

        def register_checked(peer_index: int, part_index: int, part: torch.Tensor):
            # an averaged part (delta) that is not finite is never applied; raising here makes
            # hivemind's _communicate_with_peer fall back to local values for that reducer's share
            # one pass (_part_check): torch.isfinite(...).all() alone costs ~10x the float64 norm
            finite, norm = _part_check(part)
            if not finite:
                raise AllreduceException(f"reducer #{peer_index} returned non-finite values")
            if max_norm is not None and not _within(norm, max_norm):
                raise AllreduceException(f"reducer #{peer_index} returned an average larger than any contribution")
            return register(peer_index, part_index, part)

        container.register_processed_part = register_checked
        # Reducers return the averaged part itself, not hivemind's delta (average - sent part):
        # local + delta differs from the average by rounding, differently on every peer, and
        # the protocol needs bit-identical results so all copies take the same optimizer step.
        # A failed reducer's share therefore falls back to our raw local part.
        container.return_deltas = False
        self._wire_compression = container.compression

    def _as_received(self, averaged: torch.Tensor) -> torch.Tensor:
        """What a remote sender gets for this averaged part (lossy compression round trip)."""
        from dtrain.swarm.contribution import as_received

        return as_received(averaged, self._wire_compression)

    # -- client side -------------------------------------------------------------------
    async def _communicate_with_peer(self, peer_id):
        if peer_id == self.peer_id:
            # our own share: reduce locally; keep exactly what remote senders will receive
            peer_index = self.ordered_peer_ids.index(peer_id)
            sender_index = self.sender_peer_ids.index(peer_id)
            loop = asyncio.get_event_loop()
            lossless = self._wire_compression.compression_type == 0  # as_received is the part itself
            for part_index, tensor_part in enumerate(self.parts_for_local_averaging):
                averaged = await self.tensor_part_reducer.accumulate_part(sender_index, part_index, tensor_part)
                if lossless:  # no thread hop for an identity
                    received = averaged
                else:
                    received = await loop.run_in_executor(None, self._as_received, averaged)
                self.tensor_part_container.register_processed_part(peer_index, part_index, received)
            return
        try:
            await super()._communicate_with_peer(peer_id)
        except BaseException as e:
            if peer_id != self.peer_id:
                self.failed_reducers.setdefault(peer_id, repr(e)[:200] or type(e).__name__)
            raise

    async def _generate_input_for_peer(self, peer_index: int):
        async for msg in super()._generate_input_for_peer(peer_index):
            if self.fault.send_delay_s > 0:
                await asyncio.sleep(self.fault.send_delay_s)
            if self.fault.send_nonfinite:
                part = deserialize_torch_tensor(msg.tensor_part)
                bad = torch.full_like(part, float("nan"))
                bad.view(-1)[::2] = float("inf")
                msg.tensor_part.CopyFrom(serialize_torch_tensor(bad, msg.tensor_part.compression))
            if self.fault.scale_parts != 1.0:
                part = deserialize_torch_tensor(msg.tensor_part)
                msg.tensor_part.CopyFrom(serialize_torch_tensor(part * self.fault.scale_parts,
                                                                msg.tensor_part.compression))
            self.bytes_sent += msg.ByteSize()
            yield msg

    def _get_peer_stub(self, peer):
        expected = self.tensor_part_container.num_parts_by_peer[self.ordered_peer_ids.index(peer)]
        return _CountingStub(super()._get_peer_stub(peer), self, expected)

    # -- server side ---------------------------------------------------------------------
    async def _accumulate_parts_streaming(self, stream, sender_index: int):
        """Reduce a sender's parts as they stream in; reply with the averaged part (not a delta).

        Everything a part costs before it is added (deserialising, the finiteness and norm
        check, the commitment check) runs in one worker-thread call, prefetched while the
        previous part waits for the other senders; the verdicts are applied here, in the same
        order as before, so bans and their reasons do not change.
        """
        part_index = 0

        async def numbered():
            index = 0
            async for msg in stream:
                yield index, msg
                index += 1

        try:
            async for tensor_part, part_compression, check, as_claimed in amap_in_executor(
                lambda item: self._decode_part(sender_index, *item),
                numbered(),
                max_prefetch=self.tensor_part_container.prefetch,
            ):
                try:
                    if not as_claimed:
                        reducer = self.tensor_part_reducer
                        reducer.reject(sender_index, reducer.contradicted, "sent a part that contradicts its commitment")
                    averaged = await self.tensor_part_reducer.accumulate_part(sender_index, part_index, tensor_part,
                                                                              check=check)
                    part_index += 1
                except BannedException:
                    break  # banned (timeout, disconnect, non-finite): stop serving this sender
                serialized = await self._serialized_average(part_index - 1, averaged, part_compression)
                yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=serialized)
        finally:
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])

    def _decode_part(self, sender_index: int, part_index: int, msg):
        """Worker thread: a sender's message -> (part, its compression, _part_check, matches its claim)."""
        tensor_part = deserialize_torch_tensor(msg.tensor_part)
        as_claimed = self._part_as_claimed(sender_index, part_index, tensor_part)
        return tensor_part, msg.tensor_part.compression, _part_check(tensor_part), as_claimed

    def _serialized_average(self, part_index: int, averaged: torch.Tensor, compression):
        """The averaged part as sent back, serialised once and shared by every sender asking for it.

        All senders receive the same averaged tensor, so the bytes are the same for all; parts
        complete in order and a sender asks for part p + 1 only after it has taken part p, so
        only the newest part's entries are kept.
        """
        key = (part_index, compression)
        cache = self._serialized_cache
        hit = cache.get(key)
        if hit is None or hit[0] is not averaged:
            for old in [k for k in cache if k[0] < part_index]:
                del cache[old]
            future = asyncio.get_event_loop().run_in_executor(None, serialize_torch_tensor, averaged, compression)
            hit = cache[key] = (averaged, future)
        return asyncio.shield(hit[1])

    def _part_as_claimed(self, sender_index: int, part_index: int, tensor_part: torch.Tensor) -> bool:
        """True unless the sender committed a claim for this part and the part contradicts it."""
        if self.sender_claims is None or self.layout is None:
            return True
        claims = self.sender_claims[sender_index]
        if claims is None:
            return True
        from dtrain.swarm.contribution import part_matches_claim

        g = self.first_part + part_index
        param_index, start, length = self.layout.parts[g]
        if tensor_part.numel() != length:
            return False
        return part_matches_claim(tensor_part, claims[g], param_index, start, self.claims_nonce)

    async def rpc_aggregate_part(self, stream, context):
        async def counted():
            async for msg in stream:
                self.bytes_received += msg.ByteSize()
                yield msg

        delivered = 0
        async for reply in super().rpc_aggregate_part(counted(), context):
            self.bytes_sent += reply.ByteSize()
            delivered += reply.code == averaging_pb2.AVERAGED_PART
            yield reply
        if delivered < self.tensor_part_reducer.num_parts:
            return  # refused or banned: it expects more and would otherwise wait its reducer timeout for our end
        # Do not end the stream: the sender hangs up once it holds its last averaged part
        # (_CountingStub), which cancels this wait. Returning here would close our side while
        # p2pd may still hold that last part, and the sender, now and then, lost it ("sent 31
        # parts, but we expected 32") and kept its local values for this whole share.
        await asyncio.sleep(REPLY_LINGER_S)


class _CountingStub:
    """Wraps a hivemind stub: counts the bytes of the averaged parts we receive back, and hangs
    up as soon as the last expected part is in (the reducer waits for that, see
    _DtrainRunner.rpc_aggregate_part)."""

    def __init__(self, stub, runner: _DtrainRunner, expected_parts: int):
        self._stub, self._runner, self._expected = stub, runner, expected_parts

    async def rpc_aggregate_part(self, inputs):
        stream = await self._stub.rpc_aggregate_part(inputs)
        runner, expected = self._runner, self._expected

        async def counted():
            received = 0
            try:
                async for msg in stream:
                    runner.bytes_received += msg.ByteSize()
                    yield msg
                    if msg.code == averaging_pb2.AVERAGED_PART:
                        received += 1
                        if received >= expected:
                            break
            finally:
                await stream.aclose()  # closes our end of the p2p stream

        return counted()


def reset_torch_threads_after_fork() -> None:
    """Rebuild torch's thread-pool state in a forked child while it has a single thread.

    Once a process has called ``torch.set_num_threads`` (dtrain's tests do, an operator's
    script may), every new thread's first parallel-capable op re-applies that setting, and in
    a forked child that step rebuilds the pool torch marked as lost in the fork. Several
    threads doing it at once race, and one of them fails with "Invalid thread pool!": in
    the averager that was the 8-bit codec's first part, raised inside hivemind's writer task,
    which ends silently, so the reducers heard nothing and banned an honest sender 30 s later.
    Setting the same thread count once here, before the averager starts its threads, does the
    rebuild single-threaded. It enters no parallel region, so it is safe on the forking thread.
    A failure here is only logged: the averager works without the reset, and an exception
    would end its process before it says "ready".
    """
    try:
        torch.set_num_threads(torch.get_num_threads())
    except RuntimeError as exc:
        logger.warning("swarm: could not reset torch's thread pool in the averager process: %s", exc)


class _DtrainAverager(ServesCommandPipe, DecentralizedAverager):
    """DecentralizedAverager whose group step applies dtrain's model check, cap and accounting."""

    def __init__(self, averaged_tensors, dht, *, fault=None, state_provider=None, **kwargs):
        self._fault = fault
        self._state_provider = state_provider
        start = kwargs.pop("start", False)
        super().__init__(averaged_tensors, dht, start=False, **kwargs)
        # One matchmaking schema for the whole run: peers with another model must be able to
        # join so they can be *reported* (WRONG_MODEL); the real check uses gathered data.
        # Set before the background process forks, since Matchmaking is built there.
        self.schema_hash = hashlib.sha256(f"dtrain-swarm:{self.prefix}".encode()).digest()
        if start:
            self.run_in_background(await_ready=True)

    def run(self):
        # In the averager's process, before it starts a thread of its own.
        startup.enable_stack_dumps()
        reset_torch_threads_after_fork()
        self._use_command_pipe()  # see dtrain/swarm/command_pipe.py
        super().run()

    async def _step(self, *, step, future_for_init):
        _undeclare_in_background(self._matchmaking.group_key_manager)
        return await super()._step(step=step, future_for_init=future_for_init)

    def run_in_background(self, await_ready: bool = True, timeout: Optional[float] = None) -> None:
        # hivemind sets SIGINT to SIG_IGN in the *calling* process so the forked child ignores
        # Ctrl-C, and never restores it: the neuron would then ignore Ctrl-C. It also fails
        # outside the main thread. Ignore only around the fork, then restore the old handler.
        import signal
        import threading

        in_main = threading.current_thread() is threading.main_thread()
        previous = signal.getsignal(signal.SIGINT) if in_main else None
        if in_main:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            self.start()
        finally:
            if in_main and previous is not None:
                signal.signal(signal.SIGINT, previous)
        if await_ready:
            # hivemind's own wait has no limit and never notices a child that died: bounded here.
            startup.await_ready(self, self.wait_until_ready, "averager",
                                startup.START_TIMEOUT_S if timeout is None else timeout,
                                explain=self._dht_state)

    def _dht_state(self) -> str:
        # The averager's start asks its DHT process for p2pd's address: a dead DHT hangs it.
        dht = self.dht
        try:
            alive = dht.is_alive()
        except AssertionError:  # only the process that started the DHT may ask
            return "its DHT process was started elsewhere"
        if alive:
            return f"its DHT process (pid {dht.pid}) is running"
        return f"its DHT process (pid {dht.pid}) is not running (exit code {dht.exitcode}): restart the node"

    def get_current_state(self):
        if self._state_provider is None:
            return super().get_current_state()
        metadata, tensors = self._state_provider()
        return metadata, list(tensors), None

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        """hivemind's join handler, plus: a leader forms its group once every expected peer is in.

        Without this, a group smaller than ``target_group_size`` waits for the leader's whole
        matchmaking window. hivemind yields ACCEPTED while it still holds
        ``lock_request_join_group``, so when we are resumed (the follower has been told) no
        other join, departure or change of leader can interleave: the members we read are
        the ones the group is formed from. The rule, and why a forged list cannot abuse it,
        is dtrain/swarm/assembly.py.
        """
        async for response in self._matchmaking.rpc_join_group(request, context):
            begin = response.code == averaging_pb2.BEGIN_ALLREDUCE
            if begin:
                self._begins_in_flight.setdefault(response.group_id, set()).add(context.remote_id)
            try:
                yield response  # resumed once hivemind has written it to p2pd (send_protobuf drains)
            finally:
                if begin:
                    pending = self._begins_in_flight.get(response.group_id)
                    if pending is not None:
                        pending.discard(context.remote_id)
                        if not pending:  # also when registered after the leader stopped waiting
                            del self._begins_in_flight[response.group_id]
            if response.code == averaging_pb2.ACCEPTED:
                await self._assemble_if_expected_joined()

    @property
    def _begins_in_flight(self) -> dict:
        # group id -> followers whose BEGIN_ALLREDUCE this leader has not yet handed to p2pd
        if getattr(self, "_begins", None) is None:
            self._begins = {}
        return self._begins

    async def _until_begins_sent(self, group_id: bytes, limit_s: float = BEGIN_FLUSH_LIMIT_S) -> None:
        """A leader starts sending parts only after every follower's BEGIN message is out.

        A follower's BEGIN and the leader's parts for that follower share one connection: sent
        in parallel, the BEGIN (which carries every member's gathered data, claims included)
        queues behind megabytes of parts, and the follower starts the butterfly seconds after
        the leader, while every other reducer waits for it. Followers never have BEGINs to
        send, so for them this returns at once.
        """
        await asyncio.sleep(0)  # let the followers' join handlers, woken with us, register theirs
        deadline = time.monotonic() + limit_s
        try:
            while self._begins_in_flight.get(group_id) and time.monotonic() < deadline:
                await asyncio.sleep(0.002)
        finally:
            self._begins_in_flight.pop(group_id, None)

    async def _assemble_if_expected_joined(self) -> None:
        from dtrain.swarm.assembly import claim_from_gather_bytes, ready_to_assemble

        mm = self._matchmaking
        try:
            if not (mm.is_looking_for_group and mm.lock_request_join_group.locked() and mm.current_leader is None
                    and mm.step_control is not None and not mm.assembled_group.done() and not mm.client_mode):
                return  # not (or no longer) a leader: hivemind's paths decide
            # Decoded claims by member, kept while the member's request (or our own step) is the
            # same object: a group of n would otherwise decode n gathers on each of n joins.
            cache = getattr(self, "_assembly_claims", None)
            if cache is None:
                cache = self._assembly_claims = {}
            sources = {mm.peer_id: mm.step_control}
            sources.update(mm.current_followers)
            members = []
            for peer, source in sources.items():
                hit = cache.get(peer)
                if hit is None or hit[0] is not source:
                    data = source.data_for_gather if peer == mm.peer_id else source.gather
                    hit = cache[peer] = (source, claim_from_gather_bytes(str(peer), data, self.serializer.loads))
                members.append(hit[1])
            for peer in [p for p in cache if p not in sources]:
                del cache[peer]
            if ready_to_assemble(members, mm.min_group_size):
                logger.debug("every expected peer joined: forming the group of %d now", len(members))
                await mm.leader_assemble_group()
        except Exception as e:  # never let the shortcut break a join: the expiration path remains
            logger.debug("early group assembly skipped: %r", e, exc_info=True)

    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs):
        try:
            weight = kwargs.pop("weight", None)
            del weight  # per-sender weights come from gathered data, capped by us (below)
            bandwidths, mode_ids, user_bytes = zip(*map(self.serializer.loads, group_info.gathered))
            users = [self.serializer.loads(b) for b in user_bytes]
            me = group_info.peer_ids.index(self.peer_id)
            mine = users[me]
            cap = float(mine["cap"])
            # Per-peer limits (e.g. 0 for a miner that failed verification) override the default cap.
            peer_caps = mine.get("caps") if isinstance(mine.get("caps"), dict) else {}
            modes, claimed, used, compatible = [], [], [], []
            for i, (user, mode_id) in enumerate(zip(users, mode_ids)):
                ok = (
                    isinstance(user, dict)
                    and user.get("v") == GATHER_VERSION
                    and user.get("fp") == mine["fp"]
                    and user.get("schema") == mine["schema"]
                )
                compatible.append(ok)
                w = user.get("w", 0.0) if isinstance(user, dict) else 0.0
                w = float(w) if isinstance(w, (int, float)) and math.isfinite(w) and w >= 0 else 0.0
                claimed.append(w)
                limit = peer_caps.get(str(group_info.peer_ids[i]), cap)
                used.append(min(w, float(limit)) if ok else 0.0)
                modes.append(AveragingMode(mode_id) if ok else AveragingMode.AUX)
            norms, out_of_scale = _scale_check(users, compatible, claimed, float(mine.get("ratio", 0.0) or 0.0))
            for i in out_of_scale:
                # Like a wrong model, an out-of-scale peer owns no share and its values are never
                # added: every peer derives the same verdict from the same gathered data.
                used[i], modes[i] = 0.0, AveragingMode.AUX
            commitments, unbound = await asyncio.get_event_loop().run_in_executor(
                None, self._check_commitments, users, mine, compatible, claimed, kwargs)
            for i in unbound:
                used[i], modes[i] = 0.0, AveragingMode.AUX
            # The group has no epoch in its matchmaking key, so a peer that is late (or early)
            # can land in another epoch's group. When most of the others committed under
            # another nonce, this peer is the odd one: everyone else gives it no share, and its
            # record says so instead of averaging something of another epoch.
            others = [i for i in (commitments or {}) if i != me]
            elsewhere = [i for i in others if commitments[i].nonce != mine["commit"]["nonce"]]
            if others and 2 * len(elsewhere) > len(others):
                # Sit the round out: the others give this peer no share and expect nothing from it.
                reason = (f"this peer is at another epoch than the group ({len(elsewhere)} of {len(others)} peers "
                          "committed under another epoch's nonce)")
                return dict(gathered=None, report=dict(
                    round_id=group_info.group_id.hex(), group=[str(p) for p in group_info.peer_ids],
                    peers=[dict(peer_id=str(p), outcome=Outcome.FAIL.value, weight_claimed=claimed[i], weight_used=0.0,
                                reason=unbound.get(i, "")) for i, p in enumerate(group_info.peer_ids) if i != me],
                    bytes_sent=0, bytes_received=0, fraction_averaged=0.0, total_weight=0.0, allreduce_s=0.0,
                    out_of_step=reason,
                    work_reports={str(group_info.peer_ids[i]): c.report for i, c in commitments.items()}))
            download_bandwidths = [
                (bw if mode == AveragingMode.NODE else 0.0) for bw, mode in zip(bandwidths, modes)
            ]
            peer_fractions = await asyncio.get_event_loop().run_in_executor(
                None, compat.load_balance, self.total_size, download_bandwidths, min_vector_size
            )
            sender_weights = [w for w, mode in zip(used, modes) if mode != AveragingMode.AUX]
            # A sender's part can never be larger than its whole announced vector, and an average
            # never larger than the largest contribution: both bound what a liar can inject.
            sender_norms = [n for n, mode in zip(norms, modes) if mode != AveragingMode.AUX]
            max_norm = max(sender_norms, default=0.0)
            sender_claims = None
            layout = self._layout(kwargs) if commitments is not None else None  # before the tensor lock
            if commitments is not None:
                sender_claims = [commitments[i].claims if i in commitments else None
                                 for i, mode in enumerate(modes) if mode != AveragingMode.AUX]
            t_start = time.monotonic()
            await self._until_begins_sent(group_info.group_id)
            async with enter_asynchronously(self.get_tensors()) as local_tensors:
                runner = _DtrainRunner(
                    p2p=self._p2p,
                    servicer_type=type(self),
                    prefix=self.prefix,
                    tensors=local_tensors,
                    group_id=group_info.group_id,
                    ordered_peer_ids=group_info.peer_ids,
                    peer_fractions=peer_fractions,
                    modes=modes,
                    weight=used[me],
                    sender_weights=sender_weights,
                    sender_norms=sender_norms,
                    max_norm=max_norm,
                    fault=self._fault,
                    robust=mine.get("agg") == "centered_clip",
                    sender_claims=sender_claims,
                    claims_nonce=mine["commit"]["nonce"] if commitments is not None else "",
                    layout=layout,
                    **kwargs,
                )
                assert group_info.group_id in self._running_groups
                self._running_groups[group_info.group_id].set_result(runner)
                if modes[me] != AveragingMode.AUX:
                    async for tensor, averaged in azip(as_aiter(*local_tensors), runner):
                        tensor.copy_(averaged)  # the average itself (see _DtrainRunner)
                    self.last_updated = get_dht_time()
                    self._state_updated.set()
                else:
                    async for _ in runner:
                        raise ValueError("auxiliary peers should not receive averaged tensors")
                allreduce_s = time.monotonic() - t_start
            report = self._report(group_info, runner, modes, compatible, claimed, used, out_of_scale, norms, unbound)
            report["allreduce_s"] = allreduce_s
            report["work_reports"] = {str(group_info.peer_ids[i]): c.report for i, c in (commitments or {}).items()}
            return dict(gathered=None, report=report)
        except BaseException as e:
            if isinstance(e, Exception):
                logger.debug("dtrain all-reduce failed: %r", e, exc_info=True)
            raise MatchmakingException(f"Unable to run All-Reduce: {e!r}")

    def _layout(self, kwargs):
        from dtrain.swarm.contribution import PartLayout

        if getattr(self, "_layout_cache", None) is None:
            with self.get_tensors() as tensors:
                self._layout_cache = PartLayout.of(tensors, kwargs["compression"], kwargs["part_size_bytes"])
        return self._layout_cache

    def _check_commitments(self, users, mine, compatible, claimed, kwargs):
        """Parse every peer's work commitment and decide which weighted peers are not bound by one.

        Returns ``(commitments, unbound)``: ``commitments`` maps the index of each peer whose
        commitment parsed to its Commitment (None overall when this peer runs without them), ``unbound`` maps
        peer index to the reason its contribution is refused. A pure function of the gathered
        data, so every honest peer reaches the same verdicts.
        """
        from dtrain.swarm.contribution import OTHER_EPOCH, Commitment, binding_verdict
        from dtrain.training.work import WorkReportError

        own = mine.get("commit")
        if not isinstance(own, dict):
            return None, {}
        required = bool(mine.get("req"))
        layout = self._layout(kwargs)
        try:  # every peer's report must be of the kind ours is: one averaging mode per swarm
            from dtrain.training.trajectory import parse_report

            kind = type(parse_report(own.get("work")))
        except WorkReportError:
            kind = None
        commitments, unbound = {}, {}
        for i, user in enumerate(users):
            if not compatible[i]:
                continue
            data = user.get("commit") if isinstance(user, dict) else None
            parsed = None
            reason = ""
            if data is not None:
                try:
                    parsed = Commitment.parse(data, len(layout), kind=kind)
                    commitments[i] = parsed
                except WorkReportError as exc:
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

    def _report(self, group_info, runner: _DtrainRunner, modes, compatible, claimed, used, out_of_scale=(),
                norms=(), unbound=None) -> dict:
        unbound = unbound or {}
        reducer = runner.tensor_part_reducer
        rejected = {runner.sender_peer_ids[i] for i in reducer.rejected}
        too_large = {runner.sender_peer_ids[i] for i in reducer.too_large}
        contradicted = {runner.sender_peer_ids[i] for i in reducer.contradicted}
        peers = []
        for i, peer in enumerate(group_info.peer_ids):
            reason = ""
            if not compatible[i]:
                outcome = Outcome.WRONG_MODEL
                reason = "model fingerprint or tensor schema differs"
            elif i in out_of_scale:
                outcome, reason = Outcome.FAIL, f"out-of-scale contribution (norm {norms[i]:.3g})"
            elif i in unbound:
                outcome, reason = Outcome.FAIL, unbound[i]
            elif peer == self.peer_id:
                outcome = Outcome.SUCCESS
            elif peer in contradicted:
                outcome, reason = Outcome.FAIL, "sent a part that contradicts its commitment"
            elif peer in too_large:
                outcome, reason = Outcome.FAIL, "sent a part larger than its announced norm"
            elif peer in rejected:
                outcome, reason = Outcome.FAIL, "sent non-finite values"
            elif peer in runner.banned_senders:
                outcome, reason = Outcome.FAIL, "banned as sender (timeout, disconnect or protocol error)"
            elif peer in runner.failed_reducers:
                outcome, reason = Outcome.FAIL, "did not deliver its averaged part: " + runner.failed_reducers[peer]
            else:
                outcome = Outcome.SUCCESS
            peers.append(
                dict(
                    peer_id=str(peer),
                    outcome=outcome.value,
                    weight_claimed=claimed[i],
                    weight_used=0.0 if outcome != Outcome.SUCCESS else used[i],
                    reason=reason,
                )
            )
        container = runner.tensor_part_container
        total = max(container.total_size, 1)
        my_mode = modes[group_info.peer_ids.index(self.peer_id)]
        return dict(
            round_id=group_info.group_id.hex(),
            group=[str(p) for p in group_info.peer_ids],
            peers=peers,
            bytes_sent=int(runner.bytes_sent),
            bytes_received=int(runner.bytes_received),
            fraction_averaged=0.0 if my_mode == AveragingMode.AUX else 1.0 - container.failed_size / total,
            total_weight=float(sum(p["weight_used"] for p in peers)),
        )


# --------------------------------------------------------------------------------------------
# caller-facing API (runs in the neuron's process)
# --------------------------------------------------------------------------------------------


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
        fault: Optional[FaultInjection] = None,
        mode: str = "gradient",
    ):
        self.dht = dht
        self.config = config or AveragingConfig()
        self.fingerprint = str(fingerprint)
        self.mode = mode
        self._buffers = [torch.zeros_like(t, device="cpu").float() for t in templates]
        self._schema = schema_hash(self._buffers)
        self._fault = fault
        self._log = RoundLog(self.config.log_path) if self.config.log_path else None
        self.records: list[RoundRecord] = []
        self._step = None
        self._layout = None
        if self.config.aggregation not in ("mean", "centered_clip"):
            raise ValueError(f"aggregation must be 'mean' or 'centered_clip', got {self.config.aggregation!r}")
        cfg = self.config
        self._averager = _DtrainAverager(
            self._buffers,
            dht,
            fault=fault,
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
            compression=compat.make_compression(cfg.compression),
            part_size_bytes=cfg.part_size_bytes,
            bandwidth=cfg.bandwidth,
            client_mode=cfg.client_mode,
            allow_state_sharing=cfg.allow_state_sharing if not cfg.client_mode else False,
            declare_state_period=cfg.declare_state_period_s,
        )

    @property
    def peer_id(self) -> str:
        return str(self.dht.peer_id)

    @property
    def stage(self) -> Optional[str]:
        """Stage of the current/last round: LOOKING_FOR_GROUP, RUNNING_ALLREDUCE, FINISHED... (None before any)."""
        step = self._step
        return None if step is None else step.stage.name

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
        lets its group form as soon as all of them joined (dtrain/swarm/assembly.py). Setting
        ``stop`` (a neuron shutting down) abandons the round at once: the tensors keep their
        local values and the record's error says it was interrupted.

        ``work`` (a WorkReport) and ``work_nonce`` commit this contribution to the pages it came
        from (dtrain.swarm.contribution); a peer without weight (a validator) passes an empty
        report. The record's ``work_reports`` then holds every committed report of the group.
        """
        if len(tensors) != len(self._buffers):
            raise ValueError(f"expected {len(self._buffers)} tensors, got {len(tensors)}")
        for i, (t, b) in enumerate(zip(tensors, self._buffers)):
            if tuple(t.shape) != tuple(b.shape):
                raise ValueError(f"tensor #{i} has shape {tuple(t.shape)}, expected {tuple(b.shape)}")
            if not bool(torch.isfinite(t).all()):
                # an honest peer never ships NaN/Inf; refuse locally instead of being banned remotely
                raise ValueError(f"tensor #{i} has non-finite values; skip this round or fix the step")
        if not (math.isfinite(weight) and weight >= 0 and math.isfinite(cap) and cap >= 0):
            raise ValueError("weight and cap must be finite and >= 0")
        cfg = self.config
        with self._averager.get_tensors() as bufs:
            for b, t in zip(bufs, tensors):
                b.copy_(t.detach().to(device="cpu", dtype=b.dtype))
        norm = math.sqrt(sum(float(t.detach().double().pow(2).sum()) for t in tensors))
        gather = dict(v=GATHER_VERSION, fp=self.fingerprint, schema=self._schema, w=float(weight), cap=float(cap),
                      norm=norm, ratio=float(cfg.max_norm_ratio),
                      caps={str(k): float(v) for k, v in (peer_caps or {}).items()
                            if isinstance(v, (int, float)) and math.isfinite(v) and v >= 0},
                      agg=cfg.aggregation, comp=cfg.compression, req=bool(cfg.require_commitments))
        if work_nonce is not None:
            gather["commit"] = self._commitment(tensors, work, work_nonce)
        if expected_peers:
            # The leader forms the group as soon as all of these joined instead of waiting out
            # its matchmaking window (dtrain/swarm/assembly.py); missing ones cost the window.
            from dtrain.swarm.assembly import EXPECT_KEY, expect_list

            gather[EXPECT_KEY] = expect_list(expected_peers)
        started = time.time()
        t0 = time.monotonic()
        result, error = None, ""
        try:
            self._step = self._averager.step(
                gather=gather,
                weight=float(min(weight, cap)),
                timeout=timeout_s if timeout_s is not None else cfg.matchmaking_timeout_s,
                allow_retries=True,
                wait=False,
            )
            result = _wait_unless_stopped(self._step, stop)
            if result is None:
                error = "no group formed"
        except Exception as e:  # hivemind surfaces matchmaking failures as various exception types
            error = f"{type(e).__name__}: {e}"[:300] or type(e).__name__
        duration = time.monotonic() - t0
        numel = sum(b.numel() for b in self._buffers)
        record = RoundRecord(
            round_id="",
            local_peer_id=self.peer_id,
            started_at=started,
            duration_s=duration,
            num_elements=numel,
            model_fingerprint=self.fingerprint,
            compression=cfg.compression,
            mode=self.mode,
            tokens=int(tokens),
        )
        if error or not isinstance(result, dict) or "report" not in result:
            record.error = error or "averager returned no report"
            record.group = [self.peer_id]
            record.peers = [PeerResult(self.peer_id, Outcome.FAIL, float(weight), 0.0, record.error)]
        else:
            rep = result["report"]
            record.round_id = rep["round_id"]
            record.group = list(rep["group"])
            record.peers = [PeerResult.from_dict(p) for p in rep["peers"]]
            record.bytes_sent = rep["bytes_sent"]
            record.bytes_received = rep["bytes_received"]
            record.fraction_averaged = rep["fraction_averaged"]
            record.total_weight = rep["total_weight"]
            record.allreduce_s = rep["allreduce_s"]
            record.work_reports = dict(rep.get("work_reports") or {})
            if rep.get("out_of_step"):
                record.error = rep["out_of_step"]  # nothing of this group is ours to apply
            else:
                with self._averager.get_tensors() as bufs:
                    for b, t in zip(bufs, tensors):
                        t.copy_(b.to(device=t.device, dtype=t.dtype))
        missing = [p for p in expected_peers if p not in record.group]
        if missing:
            alive = self._reachable(missing)
            for p in missing:
                outcome = Outcome.NON_PARTICIPATING if alive.get(p) else Outcome.NOT_ALIVE
                record.peers.append(PeerResult(p, outcome, reason="did not join the group"))
        self.records.append(record)
        if self._log is not None:
            self._log.append(record)
        return record

    def _commitment(self, tensors, work, nonce: str) -> dict:
        from dtrain.swarm.contribution import Commitment, PartLayout, compute_claims
        from dtrain.training.work import WorkReport

        compression = compat.make_compression(self.config.compression)
        if self._layout is None:
            self._layout = PartLayout.of(self._buffers, compression, self.config.part_size_bytes)
        claims = compute_claims([t.detach().float().cpu() for t in tensors], self._layout, nonce, compression)
        report = work if work is not None else WorkReport(epoch=0)
        return Commitment(nonce=nonce, report=report, claims=claims).to_gather()

    def _reachable(self, peer_ids: Sequence[str], timeout_s: float = 3.0) -> dict[str, bool]:
        import functools

        from dtrain.swarm.node import _ping_peer_ids

        try:
            return self.dht.run_coroutine(functools.partial(_ping_peer_ids, list(peer_ids), timeout_s))
        except Exception:
            return {p: False for p in peer_ids}

    def set_state_priority(self, priority: float) -> None:
        """Peers catching up download from the highest priority; neurons use their epoch."""
        if self._averager is not None:
            self._averager.state_sharing_priority = float(priority)

    def load_state_from_peers(self, timeout_s: Optional[float] = 30.0, stop: Optional[threading.Event] = None):
        """Download ``(metadata, tensors)`` from a peer that shares state (None if nobody answered).

        Raises :class:`Interrupted` when ``stop`` is set before the download finishes.
        """
        future = self._averager.load_state_from_peers(wait=False, timeout=timeout_s)
        return _wait_unless_stopped(future, stop, timeout_s)

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
