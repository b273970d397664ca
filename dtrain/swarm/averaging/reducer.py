"""The part reducer: how this peer combines the parts of its share that the senders send.

It keeps the contract of hivemind's TensorPartReducer (``accumulate_part``, ``on_sender_failed``,
``finalize``, ``finished``, ``num_parts``: parts are reduced in order, each once every sender
still in the round has sent it) and adds dtrain's rules: receiver-side weights fixed at group
formation (the weight on the wire is never read), a part that is non-finite or larger than its
sender's announced norm bans that sender before anything is added, CenteredClip (in a worker
thread) or the weighted mean, and the account of every part (accounts.py). A part only weight-0
peers sent is their plain mean; a part nobody sent is NaN (every receiver keeps its local values).
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Optional, Sequence

import numpy as np
import torch

from dtrain.swarm.averaging.accounts import Account
from dtrain.swarm.averaging.norms import part_check, within_norm

logger = logging.getLogger(__name__)

class SenderBanned(Exception):
    """A sender was refused (a failed check, or banned by the runner): stop serving it."""


class ReducerFinished(Exception):
    """A part arrived after the reducer finished (the round ended or failed)."""



class CheckedReducer:
    """Reduces this peer's share with receiver-side weights, checks, and optional CenteredClip."""

    def __init__(self, part_shapes, num_senders: int, sender_weights: Sequence[float],
                 sender_norms: Optional[Sequence[float]] = None, robust: bool = False):
        self.part_shapes, self.num_senders, self.num_parts = part_shapes, num_senders, len(part_shapes)
        self.sender_weights = [float(w) for w in sender_weights]
        self.sender_norms = [float(n) for n in sender_norms] if sender_norms is not None else None
        self.robust = robust
        self.rejected: set[int] = set()  # senders refused by a check, whatever the check
        self.too_large: set[int] = set()
        self.contradicted: set[int] = set()
        self.current_part_index = -1  # the part being reduced
        self.current_part_accumulated_from = 0  # senders whose current part is in
        self.accumulator: Optional[torch.Tensor] = None  # weighted sum of the current part
        self.denominator = 0.0  # total weight of the current part
        self.current_part_future: asyncio.Future = asyncio.Future()
        self.finished = asyncio.Event()
        self.num_parts_received = [0] * num_senders
        self.sender_failed_after = [math.inf] * num_senders  # first part a banned sender no longer sends
        self.num_current_senders = num_senders
        # part index -> its Account, once combined (robust: once the worker thread is done)
        self.accounts: dict[int, Account] = {}
        self.reset_accumulators()

    def reset_accumulators(self) -> None:
        """Move on to the next part (or finish after the last)."""
        assert self.current_part_accumulated_from == self.num_current_senders or self.current_part_index == -1
        if self.current_part_index >= self.num_parts - 1:
            self.finalize()
        else:
            self.current_part_index += 1
            self.current_part_accumulated_from = 0
            self.current_part_future = asyncio.Future()
            self.num_current_senders = sum(self.current_part_index < failed for failed in self.sender_failed_after)
            # the weighted sum (CenteredClip keeps the parts themselves instead)
            self.accumulator = None if self.robust else torch.zeros(self.part_shapes[self.current_part_index])
            self.denominator = 0.0
            # unweighted sum of the weight-0 contributions: the part when every contributor has
            # weight 0 (e.g. only validators left), where the weighted mean would be 0/0; once
            # anyone brings weight it is never read, so only weight-0 parts go in (one pass less
            # over every weighted part)
            self.plain_sum = torch.zeros(self.part_shapes[self.current_part_index])
        # (sender index, part, weight) of the current part's contributors; robust aggregation
        # keeps the parts themselves until the last one arrives
        self.received_parts: list[tuple[int, Optional[torch.Tensor], float]] = []

    def reject(self, sender_index: int, reason_set: set, message: str):
        """Ban a sender whose part failed a check; its values are never added."""
        self.rejected.add(sender_index)
        reason_set.add(sender_index)
        self.on_sender_failed(sender_index)
        raise SenderBanned(f"sender {sender_index} {message}")

    async def accumulate_part(self, sender_index: int, part_index: int, tensor_part: torch.Tensor,
                              weight: float = 1.0, check: Optional[tuple[bool, float]] = None):
        """Add a sender's part, wait for the others, return the combined part.

        ``weight`` is ignored (the sender's weight from the gather is used); ``check`` is
        :func:`part_check` of the part when the caller computed it off the loop.
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
                raise ReducerFinished(f"attempted to aggregate part in a finalized {type(self).__name__}")
        if self.sender_failed_after[sender_index] != math.inf:
            raise SenderBanned(f"sender {sender_index} was banned in background")
        assert part_index == self.current_part_index
        finite, norm = part_check(tensor_part) if check is None else check
        if not finite:
            self.reject(sender_index, set(), "sent non-finite values")  # not counted as received
        if self.sender_norms is not None and not within_norm(norm, self.sender_norms[sender_index]):
            self.reject(sender_index, self.too_large, "sent a part larger than its announced norm")
        self.num_parts_received[sender_index] += 1
        current_part_future = self.current_part_future
        w = self.sender_weights[sender_index]
        if self.robust:
            self.received_parts.append((sender_index, tensor_part, w))
        else:
            self.received_parts.append((sender_index, None, w))
            self.accumulator.add_(tensor_part, alpha=w)
        if w == 0:
            self.plain_sum.add_(tensor_part)
        self.current_part_accumulated_from += 1
        self.denominator += w
        self.check_current_part_finished()
        # Every sender of this part waits on the same future, shielded: a sender whose handler is
        # cancelled (its peer hung up or died) ends only its own wait, never the part for the others.
        result = await asyncio.shield(current_part_future)
        if isinstance(result, asyncio.Future):
            # robust aggregation runs in a worker thread (check_current_part_finished): the part
            # index has moved on already, and this is the combination still being computed,
            # shared by the senders in the same way
            result = await asyncio.shield(result)
        return result

    def on_sender_failed(self, sender_index: int) -> None:
        """Leave a sender out of every part it has not sent yet.

        Idempotent: the runner may ban the same sender again from another code path, and a
        second call would decrement the current part's sender count twice.
        """
        if self.sender_failed_after[sender_index] != math.inf:
            return
        self.sender_failed_after[sender_index] = self.num_parts_received[sender_index]
        if self.finished.is_set():
            return
        if self.current_part_index == self.num_parts_received[sender_index]:
            self.num_current_senders -= 1
            self.check_current_part_finished()

    def check_current_part_finished(self) -> None:
        assert self.current_part_accumulated_from <= self.num_current_senders
        if self.current_part_accumulated_from == self.num_current_senders:
            part_index, contributors = self.current_part_index, self.received_parts
            if self.robust and self.denominator > 0:
                # CenteredClip costs milliseconds per part: run it in a worker thread so the loop
                # keeps moving bytes and the next part accumulates meanwhile. The part's future
                # resolves now, with the future of the combination (accumulate_part awaits it):
                # senders of later parts wake up at once, and finalize() after the last part
                # cancels nothing that is still being computed.
                result = asyncio.get_event_loop().run_in_executor(None, self._clip, part_index, contributors)
            elif self.denominator > 0:
                result = self.accumulator.div_(self.denominator)
                self._keep_account(part_index, {i: w / self.denominator for i, _, w in contributors})
            elif self.current_part_accumulated_from > 0:
                result = self.plain_sum.div_(self.current_part_accumulated_from)
                self._keep_account(part_index, {i: 1.0 / len(contributors) for i, _, _ in contributors})
            else:
                # nobody contributed: NaN makes every receiver keep its local values for this part
                result = torch.full_like(self.plain_sum, float("nan"))
            self.current_part_future.set_result(result)
            self.reset_accumulators()

    def _keep_account(self, part_index: int, coefficients: dict, tau: float = 0.0) -> None:
        full = np.zeros(self.num_senders)
        for i, c in coefficients.items():
            full[i] = c
        self.accounts[part_index] = Account(full, tau)

    def _clip(self, part_index: int, contributors) -> torch.Tensor:
        """Worker thread: one part's CenteredClip, and its account."""
        from dtrain.swarm.averaging.centered_clip import clip_account

        senders, parts, weights = zip(*contributors)
        result, coefficients, tau = clip_account(parts, weights)
        self._keep_account(part_index, dict(zip(senders, coefficients)), tau)
        return result

    def finalize(self) -> None:
        if self.finished.is_set():
            return
        self.current_part_future.cancel()
        self.accumulator = None
        self.finished.set()
        if self.num_parts and self.num_senders:
            expected, received = self.num_parts * self.num_senders, sum(self.num_parts_received)
            if expected != received:
                logger.warning("Reducer: received %.1f%% of input tensors", received / expected * 100)
