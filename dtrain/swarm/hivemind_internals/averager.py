"""hivemind's DecentralizedAverager driven by dtrain's round handler (the ``RoundHandler`` protocol).

dtrain does not subclass it: the handler (dtrain/swarm/averaging/averager.py) decides, the
averager process moves the round through hivemind and offers the handler its I/O
(``run_butterfly``, ``ask_member``, the locked tensors). docs/architecture.md lists each call.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Optional, Protocol, Sequence

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import MPFuture
from hivemind.utils.asyncio import as_aiter, azip, enter_asynchronously
from hivemind.utils.timed_storage import get_dht_time

from dtrain.pools import default_executor_size, full_thread_pool
from dtrain.swarm import startup
from dtrain.swarm.hivemind_internals.matchmaking import LeaderSide
from dtrain.swarm.hivemind_internals.processes import (
    ServesCommandPipe,
    collect_garbage_of_last_round,
    heap_frozen_for_fork,
    release_inherited_tensors,
    undeclare_in_background,
)
from dtrain.procmem import trim_heap
from dtrain.swarm.hivemind_internals.runner import ButterflyChecks, ButterflyFacts, ButterflyRunner

logger = logging.getLogger(__name__)

# hivemind names an RPC handle after the servicer's class ("<prefix>::_DtrainAverager.rpc_join_group"):
# every release keeps the name the first one had, whatever its classes are called, or peers stop meeting.
AVERAGER_WIRE_NAME = "_DtrainAverager"

# hivemind's averaging modes as dtrain's roles: a node reduces a share, a client only sends,
# an auxiliary peer neither sends nor owns a share.
ROLE_OF_MODE = {AveragingMode.NODE.value: "node", AveragingMode.CLIENT.value: "client",
                AveragingMode.AUX.value: "aux"}
_MODE_OF_ROLE = {role: AveragingMode(mode) for mode, role in ROLE_OF_MODE.items()}

# torch threads of the averager process: its work is many part-sized operations already spread
# over the event loop's executor; torch's intra-op pool would only add OpenMP workers that spin
# after every parallel region, CPU taken from training and from p2pd (docs/swarm.md, "CPU per byte").
AVERAGER_TORCH_THREADS = 1


def reset_torch_threads_after_fork() -> None:
    """Set the averager's torch thread count while its forked process still has one thread: that
    also rebuilds torch's pool once, before several threads race to rebuild it (docs/swarm.md,
    "Measured"). A failure is only logged: the averager works without it."""
    try:
        torch.set_num_threads(AVERAGER_TORCH_THREADS)
    except RuntimeError as exc:
        logger.warning("swarm: could not set torch's threads in the averager process: %s", exc)


def _loop_with_a_full_default_executor() -> None:
    """In the averager's own process: the event loop hivemind makes gets a default executor whose
    threads all start at once, so the process's thread count stays flat (dtrain/pools.py)."""
    import hivemind.averaging.averager as hivemind_averager

    make_loop = hivemind_averager.switch_to_uvloop

    def switch_to_uvloop():
        loop = make_loop()
        loop.set_default_executor(full_thread_pool(default_executor_size(), "averager"))
        return loop

    hivemind_averager.switch_to_uvloop = switch_to_uvloop  # this process only: it is the averager's


class _OneWriterAtATime:
    """A multiprocessing Connection whose ``send`` holds a lock (the rest passes through)."""

    def __init__(self, conn):
        self._conn = conn
        self._lock = threading.Lock()

    def send(self, obj) -> None:
        with self._lock:
            self._conn.send(obj)

    def __getattr__(self, name):
        return getattr(self._conn, name)


@dataclass
class Group:
    """A formed group as the round handler sees it."""

    group_id: bytes
    peer_ids: list[str]  # in hivemind's order (the butterfly's)
    me: int  # this peer's index in peer_ids
    bandwidths: tuple  # what each member announced (None: "same as others")
    roles: list[Optional[str]]  # node / client / aux as each member announced it; None: unknown mode id
    users: list  # each member's decoded gather (what it passed to ``step(gather=...)``)
    min_vector_size: int
    compression: Any  # the wire compression (hivemind object)
    part_size_bytes: int
    info: Any  # hivemind's GroupInfo, for the wall only
    runner_kwargs: dict  # hivemind's all-reduce arguments, for the wall only

    @property
    def round_id(self) -> str:
        return self.group_id.hex()


class RoundHandler(Protocol):
    """What the averager process asks of dtrain (dtrain.swarm.averaging.averager.SwarmAverager)."""

    def keep_private(self, user_gather: Any) -> Any:
        """At the start of each step: the caller's decoded gather -> what the group may see."""

    def should_form_group(self, members: list[tuple[str, Any, Callable[[], Any]]], min_group_size: int) -> bool:
        """As a leader, after each accepted follower: form the group now? ``members`` are
        ``(peer id, token, user_gather())``, ourselves first; a token stays the same object while
        the member's request does; ``user_gather()`` is None for bytes that do not decode."""

    def followers_to_leave_out(self, deadlines: dict[str, float], now: float, request_timeout: float) -> set[str]:
        """As a leader forming its group at ``now``: the followers not to count in."""

    async def average_with_group(self, group: Group, io: "AveragerProcess") -> Any:
        """The round in a formed group; the result is what ``step()`` returns to the caller."""

    async def answer_member(self, group_id: bytes, payload: bytes, asker: str) -> Optional[bytes]:
        """A group member's question after the butterfly (``ask_member`` on its side); None refuses."""

    async def answer_caller(self, question: Any) -> Any:
        """The caller process's question (``ask_handler``)."""

    def current_state(self) -> Optional[tuple[Any, Sequence[torch.Tensor]]]:
        """``(metadata, tensors)`` for peers catching up; None: the averaged tensors themselves."""


class AveragerProcess(ServesCommandPipe, DecentralizedAverager):
    """hivemind's averager process, its rounds decided by ``handler`` (a RoundHandler).
    ``matchmaking_key`` replaces hivemind's schema hash (peers with another key never meet)."""

    def __init__(self, averaged_tensors, dht, *, handler: RoundHandler, matchmaking_key: bytes, start: bool = False,
                 **kwargs):
        self.handler = handler
        super().__init__(averaged_tensors, dht, start=False, **kwargs)
        # Commands come from several caller threads (a round, a catch-up, the round audit's
        # questions): one writer at a time, so that two large messages never interleave.
        self._outer_pipe = _OneWriterAtATime(self._outer_pipe)
        self.schema_hash = matchmaking_key  # before the fork: Matchmaking is built in the child
        self._leader = LeaderSide(handler, self._user_gather)
        if start:
            self.run_in_background(await_ready=True)

    @classmethod
    def _get_handle_name(cls, namespace: Optional[str], method_name: str) -> str:
        handle_name = f"{AVERAGER_WIRE_NAME}.{method_name}"
        return handle_name if namespace is None else f"{namespace}::{handle_name}"

    @classmethod
    def _collect_rpc_handlers(cls) -> None:
        # hivemind caches the handlers in a class attribute that a subclass inherits: collect for
        # each class itself (a parent's stub would call "DecentralizedAverager.rpc_...").
        if "_rpc_handlers" not in cls.__dict__:
            cls._rpc_handlers = None
        super()._collect_rpc_handlers()

    # -- the caller's side -------------------------------------------------------------------
    @contextlib.contextmanager
    def tensors_within(self, timeout_s: float):
        """``get_tensors()``, but TimeoutError instead of waiting for ever for the lock (an averager
        process killed mid-round never releases it)."""
        if not self.lock_averaged_tensors.acquire(timeout=timeout_s):
            raise TimeoutError(f"the averaged tensors stayed locked for {timeout_s:g} s (averager process "
                               f"{'running' if self.is_alive() else 'not running'})")
        try:
            yield self._averaged_tensors
        finally:
            self.lock_averaged_tensors.release()

    def ask_handler(self, question: Any, timeout_s: float):
        """From the caller's process: the handler's ``answer_caller(question)`` in the averager
        process (TimeoutError past ``timeout_s``; its exception, re-raised)."""
        future = MPFuture()
        self._outer_pipe.send(("_answer_caller", [], dict(question=question, future=future)))
        return future.result(timeout=timeout_s)

    async def _answer_caller(self, question, future) -> None:
        try:
            future.set_result(await self.handler.answer_caller(question))
        except BaseException as exc:
            future.set_exception(exc)

    # -- the round's I/O, for the handler -------------------------------------------------------
    def locked_tensors(self):
        """``async with`` this: the averaged tensors, locked against the caller's process."""
        return enter_asynchronously(self.get_tensors())

    async def until_begins_sent(self, group_id: bytes, limit_s: float) -> None:
        """A leader starts sending parts once every follower's BEGIN is out (matchmaking.py)."""
        await self._leader.until_begins_sent(group_id, limit_s)

    async def run_butterfly(self, group: Group, tensors, checks: ButterflyChecks, *, parts_by_peer: tuple,
                            peer_fractions, roles: Sequence[str], weight: float, receives: bool) -> ButterflyFacts:
        """Run the group's butterfly under ``checks``; a peer that ``receives`` gets the average
        copied into ``tensors``. ``parts_by_peer``: how many parts each member reduces, as dtrain
        computed it (the runner refuses to start if hivemind split otherwise)."""
        runner = ButterflyRunner(
            checks=checks, parts_by_peer=parts_by_peer, p2p=self._p2p, servicer_type=type(self), prefix=self.prefix,
            tensors=tensors, group_id=group.group_id, ordered_peer_ids=group.info.peer_ids,
            peer_fractions=peer_fractions, modes=[_MODE_OF_ROLE[r] for r in roles], weight=weight,
            **group.runner_kwargs)
        self._running_groups[group.group_id].set_result(runner)
        if receives:
            async for tensor, averaged in azip(as_aiter(*tensors), runner):
                tensor.copy_(averaged)  # the average itself (the runner returns no deltas)
            self.last_updated = get_dht_time()
            self._state_updated.set()
        else:
            async for _ in runner:
                raise ValueError("auxiliary peers should not receive averaged tensors")
        return runner.outcome()

    async def ask_member(self, peer_id: str, group_id: bytes, payload: bytes, timeout_s: float) -> Optional[bytes]:
        """Ask a member of the group ``group_id`` a question (its handler's ``answer_member``): its
        answer, or None when it refused, failed or did not answer within ``timeout_s``."""
        request = averaging_pb2.AveragingData(
            code=averaging_pb2.PART_FOR_AVERAGING, group_id=group_id,
            tensor_part=runtime_pb2.Tensor(buffer=payload, size=[len(payload)], dtype="uint8"))
        try:
            stub = self.get_stub(self._p2p, PeerID.from_base58(peer_id), namespace=self.prefix)
            reply = await asyncio.wait_for(stub.rpc_ask_member(request), timeout_s)
        except Exception as e:  # unreachable, gone, an older release without the handler, or slow
            logger.debug("swarm: member %s did not answer: %r", peer_id, e)
            return None
        if reply.code != averaging_pb2.AVERAGED_PART:
            return None
        return bytes(reply.tensor_part.buffer)

    async def rpc_ask_member(self, request: averaging_pb2.AveragingData,
                             context: P2PContext) -> averaging_pb2.AveragingData:
        """The handler behind :meth:`ask_member` (unary; answers are at most p2pd's 4 MiB message)."""
        try:
            answer = await self.handler.answer_member(bytes(request.group_id), bytes(request.tensor_part.buffer),
                                                      str(context.remote_id))
        except Exception as e:  # a malformed question is refused, never a crash of the averager
            logger.debug("swarm: refused a member's question: %r", e)
            answer = None
        if answer is None:
            return averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
        return averaging_pb2.AveragingData(
            code=averaging_pb2.AVERAGED_PART,
            tensor_part=runtime_pb2.Tensor(buffer=answer, size=[len(answer)], dtype="uint8"))

    # -- hivemind overrides ----------------------------------------------------------------
    def run(self):
        release_inherited_tensors()  # the neuron's model and optimizer state (memory_pages.py)
        startup.enable_stack_dumps()
        reset_torch_threads_after_fork()
        self._use_command_pipe()  # see dtrain/swarm/command_pipe.py
        _loop_with_a_full_default_executor()
        super().run()

    async def _step(self, *, step, future_for_init):
        collect_garbage_of_last_round()
        self._take_private_gather(step)
        undeclare_in_background(self._matchmaking.group_key_manager)
        self._leader.leave_out_lapsed_followers(self._matchmaking)
        try:
            return await super()._step(step=step, future_for_init=future_for_init)
        finally:
            trim_heap()  # the round's parts were freed in many threads' arenas: give the pages back

    def _user_gather(self, data: bytes) -> Any:
        """A member's user gather from hivemind's ``[bandwidth, mode, user bytes]``; None when
        the bytes are not that layout (hostile or foreign bytes: msgpack raises several types)."""
        try:
            outer = self.serializer.loads(data)
            if not isinstance(outer, (list, tuple)) or len(outer) != 3 or not isinstance(outer[2], (bytes, bytearray)):
                return None
            return self.serializer.loads(bytes(outer[2]))
        except Exception:
            return None

    def _take_private_gather(self, step) -> None:
        """Let the handler take what is only for this process out of the step's gather before
        matchmaking broadcasts it (hivemind serialises the gather in the caller's process)."""
        try:
            bandwidth, mode, user_bytes = self.serializer.loads(step.data_for_gather)
            user = self.serializer.loads(user_bytes)
        except Exception:  # not dtrain's layout: broadcast as it is
            self.handler.keep_private(None)
            return
        public = self.handler.keep_private(user)
        if public is not user:
            step._data_for_gather = self.serializer.dumps([bandwidth, mode, self.serializer.dumps(public)])

    def run_in_background(self, await_ready: bool = True, timeout: Optional[float] = None) -> None:
        # hivemind ignores SIGINT in the *calling* process for the fork and never restores it (and
        # fails outside the main thread): ignore it only around the fork, then restore it.
        in_main = threading.current_thread() is threading.main_thread()
        previous = signal.getsignal(signal.SIGINT) if in_main else None
        if in_main:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            with heap_frozen_for_fork():
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
        state = self.handler.current_state()
        if state is None:
            return super().get_current_state()
        metadata, tensors = state
        return metadata, list(tensors), None

    async def rpc_join_group(self, request: averaging_pb2.JoinRequest,
                             context: P2PContext) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        """hivemind's join handler, with BEGINs tracked and early formation (matchmaking.py)."""
        async for response in self._leader.join_group(self._matchmaking, request, context):
            yield response

    async def _aggregate_with_group(self, group_info, min_vector_size: int, **kwargs):
        try:
            kwargs.pop("weight", None)  # per-sender weights are dtrain's business
            bandwidths, mode_ids, user_bytes = zip(*map(self.serializer.loads, group_info.gathered))
            group = Group(group_id=group_info.group_id, peer_ids=[str(p) for p in group_info.peer_ids],
                          me=group_info.peer_ids.index(self.peer_id), bandwidths=bandwidths,
                          roles=[ROLE_OF_MODE.get(m) for m in mode_ids],
                          users=[self.serializer.loads(b) for b in user_bytes], min_vector_size=min_vector_size,
                          compression=kwargs["compression"], part_size_bytes=kwargs["part_size_bytes"],
                          info=group_info, runner_kwargs=kwargs)
            return await self.handler.average_with_group(group, self)
        except BaseException as e:
            if isinstance(e, Exception):
                logger.debug("dtrain all-reduce failed: %r", e, exc_info=True)
            raise MatchmakingException(f"Unable to run All-Reduce: {e!r}")
