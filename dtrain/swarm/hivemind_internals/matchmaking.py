"""A matchmaking leader's side that hivemind has no hooks for.

Three things, each asked of dtrain's round handler where a decision is dtrain's:
forming the group early once the handler says every expected peer is in; leaving out
followers whose wait has run out; and starting our parts only once every follower's BEGIN
is out (a BEGIN queued behind our parts delays that follower's whole butterfly).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

from hivemind.proto import averaging_pb2
from hivemind.utils.timed_storage import get_dht_time

logger = logging.getLogger(__name__)


class LeaderSide:
    """One averager's matchmaking additions; ``handler`` is its RoundHandler and
    ``user_gather(data)`` decodes a member's gather bytes to its user part (None if it cannot)."""

    def __init__(self, handler, user_gather: Callable[[bytes], Any]):
        self._handler = handler
        self._user_gather = user_gather
        self._begins: dict = {}  # group id -> followers whose BEGIN_ALLREDUCE is not yet handed to p2pd

    async def join_group(self, mm, request, context):
        """hivemind's join handler, plus BEGINs tracked and an early formation after each
        accepted follower. hivemind yields ACCEPTED while it holds ``lock_request_join_group``,
        so no other join, departure or change of leader interleaves with what we read then."""
        async for response in mm.rpc_join_group(request, context):
            begin = response.code == averaging_pb2.BEGIN_ALLREDUCE
            if begin:
                self._begins.setdefault(response.group_id, set()).add(context.remote_id)
            try:
                yield response  # resumed once hivemind has written it to p2pd (send_protobuf drains)
            finally:
                if begin:
                    self._begin_sent(response.group_id, context.remote_id)
            if response.code == averaging_pb2.ACCEPTED:
                await self._form_early(mm)

    def _begin_sent(self, group_id: bytes, follower) -> None:
        pending = self._begins.get(group_id)
        if pending is not None:
            pending.discard(follower)
            if not pending:  # also when registered after the leader stopped waiting
                del self._begins[group_id]

    async def until_begins_sent(self, group_id: bytes, limit_s: float) -> None:
        """Return once every follower's BEGIN for ``group_id`` is out (at once for a follower);
        ``limit_s`` bounds a stuck follower (a dead one's write fails at once)."""
        await asyncio.sleep(0)  # let the followers' join handlers, woken with us, register theirs
        deadline = time.monotonic() + limit_s
        try:
            while self._begins.get(group_id) and time.monotonic() < deadline:
                await asyncio.sleep(0.002)
        finally:
            self._begins.pop(group_id, None)

    async def _form_early(self, mm) -> None:
        try:
            if not (mm.is_looking_for_group and mm.lock_request_join_group.locked() and mm.current_leader is None
                    and mm.step_control is not None and not mm.assembled_group.done() and not mm.client_mode):
                return  # not (or no longer) a leader: hivemind's paths decide
            own = mm.step_control
            decode = self._user_gather
            members = [(str(mm.peer_id), own, lambda: decode(own.data_for_gather))]
            members += [(str(peer), request, lambda r=request: decode(r.gather))
                        for peer, request in mm.current_followers.items()]
            if self._handler.should_form_group(members, mm.min_group_size):
                await mm.leader_assemble_group()
        except Exception as e:  # never let the shortcut break a join: the expiration path remains
            logger.debug("early group assembly skipped: %r", e, exc_info=True)

    def leave_out_lapsed_followers(self, mm) -> None:
        """Wrap the matchmaking's ``leader_assemble_group`` (once): the followers the handler names
        are dropped from ``current_followers`` first; their join handlers then tell them the group
        was disbanded, as for any follower the group was formed without."""
        if getattr(mm, "_dtrain_leaves_out", False):
            return
        assemble, handler = mm.leader_assemble_group, self._handler

        async def leader_assemble_group():
            deadlines = {str(peer): float(request.expiration) for peer, request in mm.current_followers.items()}
            drop = handler.followers_to_leave_out(deadlines, get_dht_time(), float(mm.request_timeout))
            for peer in [p for p in mm.current_followers if str(p) in drop]:
                logger.warning("swarm: leaving out follower %s: its wait for this group has run out", peer)
                del mm.current_followers[peer]
            return await assemble()

        mm.leader_assemble_group = leader_assemble_group
        mm._dtrain_leaves_out = True
