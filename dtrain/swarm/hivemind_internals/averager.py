"""hivemind's DecentralizedAverager, with hooks for dtrain's group step (dtrain/swarm/averaging/averager.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Optional, Sequence

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
from dtrain.swarm.hivemind_internals.processes import (
    ServesCommandPipe,
    collect_garbage_of_last_round,
    heap_frozen_for_fork,
    undeclare_in_background,
)

if TYPE_CHECKING:
    from dtrain.swarm.hivemind_internals.runner import ButterflyRunner

logger = logging.getLogger(__name__)

# hivemind names an RPC handle after the servicer's class ("<prefix>::_DtrainAverager.rpc_join_group").
# dtrain's averager class was called _DtrainAverager when peers first met on the wire: every
# release must keep that name, whatever its classes are called, or peers stop finding each other.
AVERAGER_WIRE_NAME = "_DtrainAverager"

# hivemind's averaging modes as dtrain's roles: a node reduces a share, a client only sends,
# an auxiliary peer neither sends nor owns a share.
ROLE_OF_MODE = {AveragingMode.NODE.value: "node", AveragingMode.CLIENT.value: "client",
                AveragingMode.AUX.value: "aux"}
_MODE_OF_ROLE = {role: AveragingMode(mode) for mode, role in ROLE_OF_MODE.items()}


def _loop_with_a_full_default_executor() -> None:
    """In the averager's own process: the event loop hivemind makes (switch_to_uvloop, in
    _run_internal) gets a default executor whose threads all run from the start.

    Serialisation, CenteredClip and the claim checks run on that executor. asyncio's own starts
    its threads lazily, one more at each new peak of concurrent calls, so the averager's thread
    count stepped up now and then for weeks, which a soak cannot tell from a leak.
    """
    import hivemind.averaging.averager as hivemind_averager

    make_loop = hivemind_averager.switch_to_uvloop

    def switch_to_uvloop():
        loop = make_loop()
        loop.set_default_executor(full_thread_pool(default_executor_size(), "averager"))
        return loop

    hivemind_averager.switch_to_uvloop = switch_to_uvloop  # this process only: it is the averager's


def _serve_state_requests(serializer, pipe, get_current_state_ref) -> None:
    """The neuron's thread that answers the averager's requests for this peer's state (a peer
    catching up downloads it): hivemind's protocol, without holding anything between requests.

    hivemind's own loop keeps its last request's locals until the next one arrives: the state
    it served (on a GPU, a host copy of every tensor: the model, and the optimizer with it) and
    the request's future, which holds a duplicate of the averager's reply pipe. So the first
    peer that caught up from a neuron added a descriptor and, on a GPU, a model's worth of host
    memory that stayed for weeks. Here each request is answered in a call of its own, whose
    locals end with it.
    """
    while True:
        try:
            trigger, future = pipe.recv()
        except BaseException as exc:  # the pipe closed: the averager has shut down
            logger.debug("swarm: state server finished: %r", exc)
            return
        if trigger == "_SHUTDOWN":
            return
        served = _answer_state_request(serializer, future, get_current_state_ref)
        del future
        if not served:
            return


def _answer_state_request(serializer, future, get_current_state_ref) -> bool:
    """Set ``future`` to (metadata bytes, CPU tensors, tensor infos); False once the averager is gone."""
    get_current_state = get_current_state_ref()
    if get_current_state is None:
        return False
    try:
        state = tuple(get_current_state())
        del get_current_state
        if not 0 < len(state) <= 3:
            raise ValueError(f"get_current_state returned {len(state)} items, expected 1 to 3")
        metadata, tensors, infos = state + (None,) * (3 - len(state))
        # tensors go over as CPU tensors, so that the averager process never initialises CUDA
        future.set_result((serializer.dumps(metadata),
                           tuple(t.cpu().detach().requires_grad_(t.requires_grad) for t in tensors), infos))
    except BaseException as exc:
        future.set_exception(exc)
        logger.warning("swarm: could not serve this peer's state: %r", exc)
    return True


def install_state_server() -> None:
    """Make :func:`_serve_state_requests` the thread hivemind's averager starts in the neuron
    (idempotent). hivemind looks the function up when an averager is created."""
    import hivemind.averaging.averager as hivemind_averager

    hivemind_averager._background_thread_fetch_current_state = _serve_state_requests


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
    """A formed group as :meth:`AveragerProcess.average_with_group` sees it."""

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


class AveragerProcess(ServesCommandPipe, DecentralizedAverager):
    """hivemind's DecentralizedAverager with hooks for dtrain's group step.

    Subclasses implement :meth:`average_with_group` (required), and may implement
    :meth:`on_process_start`, :meth:`should_form_group`, :meth:`current_state` and
    :meth:`answer_member` (group members' questions after the butterfly, :meth:`ask_member`).
    ``matchmaking_key`` replaces hivemind's schema hash (peers with another key never meet).
    """

    def __init__(self, averaged_tensors, dht, *, matchmaking_key: bytes, start: bool = False, **kwargs):
        super().__init__(averaged_tensors, dht, start=False, **kwargs)
        # Callers in several threads write commands (a round from the training thread, a
        # catch-up, the round audit's questions from the API's threads): one writer at a time,
        # so that two large messages never interleave on the pipe.
        self._outer_pipe = _OneWriterAtATime(self._outer_pipe)
        # Set before the background process forks, since Matchmaking is built there.
        self.schema_hash = matchmaking_key
        if start:
            self.run_in_background(await_ready=True)

    # -- the wire name ---------------------------------------------------------------------
    @classmethod
    def _get_handle_name(cls, namespace: Optional[str], method_name: str) -> str:
        handle_name = f"{AVERAGER_WIRE_NAME}.{method_name}"
        return handle_name if namespace is None else f"{namespace}::{handle_name}"

    @classmethod
    def _collect_rpc_handlers(cls) -> None:
        # hivemind caches the handlers (and a stub type bound to the collecting class) in a class
        # attribute, which a subclass inherits: collect for each class itself, never reuse a
        # parent's (DecentralizedAverager's stub would call "DecentralizedAverager.rpc_...").
        if "_rpc_handlers" not in cls.__dict__:
            cls._rpc_handlers = None
        super()._collect_rpc_handlers()

    # -- hooks -----------------------------------------------------------------------------
    def on_process_start(self) -> None:
        """In the averager's own process, before it starts a thread of its own."""

    async def average_with_group(self, group: Group) -> Any:
        """Run the butterfly in a formed group; the result is what ``step()`` returns."""
        raise NotImplementedError

    def should_form_group(self, members: list[tuple[str, Any, Callable[[], bytes]]], min_group_size: int) -> bool:
        """As a leader, after each accepted follower: form the group now instead of at the window's
        end? ``members`` are ``(peer id, token, gather())``, ourselves first; a token stays the
        same object while the member's request does (for caching decoded gathers)."""
        return False

    def current_state(self) -> Optional[tuple[Any, Sequence[torch.Tensor]]]:
        """``(metadata, tensors)`` for peers catching up; None: hivemind's own (the averaged tensors)."""
        return None

    async def answer_member(self, group_id: bytes, payload: bytes, asker: str) -> Optional[bytes]:
        """Answer a group member's question after the butterfly (:meth:`ask_member` on its side);
        None refuses. dtrain's: the sketches of our sent parts under the round's result seed."""
        return None

    def keep_private(self, user_gather: Any) -> Any:
        """At the start of each step, in the averager process: the caller's decoded gather ->
        what to broadcast to the group. The averager may keep parts of it for itself (dtrain's
        claims: only their tree's root is broadcast); return ``user_gather`` itself to send it
        as it is."""
        return user_gather

    # -- the caller's side -------------------------------------------------------------------
    @contextlib.contextmanager
    def tensors_within(self, timeout_s: float):
        """``get_tensors()``, but raise TimeoutError instead of waiting for ever for the lock: an
        averager process killed in the middle of a round never releases it."""
        if not self.lock_averaged_tensors.acquire(timeout=timeout_s):
            raise TimeoutError(f"the averaged tensors stayed locked for {timeout_s:g} s (averager process "
                               f"{'running' if self.is_alive() else 'not running'})")
        try:
            yield self._averaged_tensors
        finally:
            self.lock_averaged_tensors.release()

    def call_in_process(self, method: str, timeout_s: float, **kwargs):
        """From the caller's process: run the coroutine method ``method`` of this class in the
        averager process (it gets ``future`` and sets its result) and return that result, as
        hivemind's own calls do. TimeoutError past ``timeout_s``."""
        future = MPFuture()
        self._outer_pipe.send((method, [], dict(kwargs, future=future)))
        return future.result(timeout=timeout_s)

    # -- helpers for average_with_group ----------------------------------------------------
    def locked_tensors(self):
        """``async with`` this: the averaged tensors, locked against the caller's process."""
        return enter_asynchronously(self.get_tensors())

    async def until_begins_sent(self, group_id: bytes, limit_s: float) -> None:
        """A leader starts sending parts only after every follower's BEGIN message is out.

        A follower's BEGIN and the leader's parts for that follower share one connection: sent
        in parallel, the BEGIN (which carries every member's gathered data, commitments included)
        queues behind megabytes of parts, and the follower starts the butterfly seconds after
        the leader, while every other reducer waits for it. Followers never have BEGINs to
        send, so for them this returns at once. A dead follower's write fails at once;
        ``limit_s`` only bounds a stuck one.
        """
        await asyncio.sleep(0)  # let the followers' join handlers, woken with us, register theirs
        deadline = time.monotonic() + limit_s
        try:
            while self._begins_in_flight.get(group_id) and time.monotonic() < deadline:
                await asyncio.sleep(0.002)
        finally:
            self._begins_in_flight.pop(group_id, None)

    def new_runner(self, runner_cls: type, group: Group, tensors, *, peer_fractions, roles: Sequence[str],
                   weight: float, **extra) -> "ButterflyRunner":
        """Build the group's runner (a ButterflyRunner subclass) and hand it the RPCs of this group."""
        runner = runner_cls(p2p=self._p2p, servicer_type=type(self), prefix=self.prefix, tensors=tensors,
                            group_id=group.group_id, ordered_peer_ids=group.info.peer_ids,
                            peer_fractions=peer_fractions, modes=[_MODE_OF_ROLE[r] for r in roles], weight=weight,
                            **group.runner_kwargs, **extra)
        assert group.group_id in self._running_groups
        self._running_groups[group.group_id].set_result(runner)
        return runner

    async def run_butterfly(self, runner: "ButterflyRunner", tensors, *, receives: bool) -> None:
        """Run the butterfly; a peer that ``receives`` gets the average copied into ``tensors``."""
        if receives:
            async for tensor, averaged in azip(as_aiter(*tensors), runner):
                tensor.copy_(averaged)  # the average itself (ButterflyRunner returns no deltas)
            self.last_updated = get_dht_time()
            self._state_updated.set()
        else:
            async for _ in runner:
                raise ValueError("auxiliary peers should not receive averaged tensors")

    async def ask_member(self, peer_id: str, group_id: bytes, payload: bytes, timeout_s: float) -> Optional[bytes]:
        """Ask a member of the group ``group_id`` a question (its :meth:`answer_member`): its
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
            answer = await self.answer_member(bytes(request.group_id), bytes(request.tensor_part.buffer),
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
        self.on_process_start()
        self._use_command_pipe()  # see dtrain/swarm/command_pipe.py
        _loop_with_a_full_default_executor()
        super().run()

    async def _step(self, *, step, future_for_init):
        collect_garbage_of_last_round()
        self._take_private_gather(step)
        undeclare_in_background(self._matchmaking.group_key_manager)
        self._leave_out_lapsed_followers(self._matchmaking)
        return await super()._step(step=step, future_for_init=future_for_init)

    def _take_private_gather(self, step) -> None:
        """Let :meth:`keep_private` take what is only for this process out of the step's gather
        before matchmaking broadcasts it (hivemind serialises the gather in the caller's process)."""
        try:
            bandwidth, mode, user_bytes = self.serializer.loads(step.data_for_gather)
            user = self.serializer.loads(user_bytes)
        except Exception:  # not dtrain's layout: broadcast as it is
            self.keep_private(None)
            return
        public = self.keep_private(user)
        if public is not user:
            step._data_for_gather = self.serializer.dumps([bandwidth, mode, self.serializer.dumps(public)])

    def followers_to_leave_out(self, deadlines: dict[str, float], now: float, request_timeout: float) -> set[str]:
        """Hook: as a leader forming its group at ``now``, the followers (peer id -> the expiration
        their join request named) that must not be counted in. None by default."""
        return set()

    def _leave_out_lapsed_followers(self, mm) -> None:
        """Wrap the matchmaking's ``leader_assemble_group`` (once): the followers the hook names
        are dropped from ``current_followers`` first. Their join handlers then tell them the
        group was disbanded, as for any follower the group was formed without."""
        if getattr(mm, "_dtrain_leaves_out", False):
            return
        assemble = mm.leader_assemble_group

        async def leader_assemble_group():
            deadlines = {str(peer): float(request.expiration) for peer, request in mm.current_followers.items()}
            drop = self.followers_to_leave_out(deadlines, get_dht_time(), float(mm.request_timeout))
            for peer in [p for p in mm.current_followers if str(p) in drop]:
                logger.warning("swarm: leaving out follower %s: its wait for this group has run out", peer)
                del mm.current_followers[peer]
            return await assemble()

        mm.leader_assemble_group = leader_assemble_group
        mm._dtrain_leaves_out = True

    def run_in_background(self, await_ready: bool = True, timeout: Optional[float] = None) -> None:
        # hivemind sets SIGINT to SIG_IGN in the *calling* process so the forked child ignores
        # Ctrl-C, and never restores it: the neuron would then ignore Ctrl-C. It also fails
        # outside the main thread. Ignore only around the fork, then restore the old handler.
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
        state = self.current_state()
        if state is None:
            return super().get_current_state()
        metadata, tensors = state
        return metadata, list(tensors), None

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        """hivemind's join handler, plus: BEGIN messages are tracked (until_begins_sent), and a
        leader may form its group after each accepted follower (should_form_group).

        hivemind yields ACCEPTED while it still holds ``lock_request_join_group``, so when we are
        resumed (the follower has been told) no other join, departure or change of leader can
        interleave: the members we read are the ones the group is formed from.
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
                await self._form_group_early()

    @property
    def _begins_in_flight(self) -> dict:
        # group id -> followers whose BEGIN_ALLREDUCE this leader has not yet handed to p2pd
        if getattr(self, "_begins", None) is None:
            self._begins = {}
        return self._begins

    async def _form_group_early(self) -> None:
        mm = self._matchmaking
        try:
            if not (mm.is_looking_for_group and mm.lock_request_join_group.locked() and mm.current_leader is None
                    and mm.step_control is not None and not mm.assembled_group.done() and not mm.client_mode):
                return  # not (or no longer) a leader: hivemind's paths decide
            own = mm.step_control
            members = [(str(mm.peer_id), own, lambda: own.data_for_gather)]
            members += [(str(peer), request, lambda r=request: r.gather)
                        for peer, request in mm.current_followers.items()]
            if self.should_form_group(members, mm.min_group_size):
                await mm.leader_assemble_group()
        except Exception as e:  # never let the shortcut break a join: the expiration path remains
            logger.debug("early group assembly skipped: %r", e, exc_info=True)

    async def _aggregate_with_group(self, group_info, min_vector_size: int, **kwargs):
        try:
            kwargs.pop("weight", None)  # per-sender weights are dtrain's business (average_with_group)
            bandwidths, mode_ids, user_bytes = zip(*map(self.serializer.loads, group_info.gathered))
            peer_ids = [str(p) for p in group_info.peer_ids]
            group = Group(group_id=group_info.group_id, peer_ids=peer_ids, me=group_info.peer_ids.index(self.peer_id),
                          bandwidths=bandwidths, roles=[ROLE_OF_MODE.get(m) for m in mode_ids],
                          users=[self.serializer.loads(b) for b in user_bytes], min_vector_size=min_vector_size,
                          compression=kwargs["compression"], part_size_bytes=kwargs["part_size_bytes"],
                          info=group_info, runner_kwargs=kwargs)
            return await self.average_with_group(group)
        except BaseException as e:
            if isinstance(e, Exception):
                logger.debug("dtrain all-reduce failed: %r", e, exc_info=True)
            raise MatchmakingException(f"Unable to run All-Reduce: {e!r}")
