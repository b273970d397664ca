"""Deliberate misbehaviour of a swarm peer, for tests: a slow, broken or lying sender or reducer.

Production code has no fault switches. A faulty peer is an honest GradientSwarm whose round is
built from faulty mechanisms (dtrain.swarm.averaging.mechanisms): what it sends other reducers
(sending), how it reduces its share (share), what it returns (reply), and how it answers
questions about what it sent (kept). Everything else, its own share included, is the honest
code path.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Optional

import torch

from dtrain.sketch import WORK_SKETCH_K, project_out_sketch
from dtrain.swarm.averaging import GradientSwarm
from dtrain.swarm.averaging.butterfly import OurParts
from dtrain.swarm.averaging.kept import SentContribution, decode_ask
from dtrain.swarm.averaging.mechanisms import Mechanisms
from dtrain.swarm.averaging.reply import ReducerReply
from dtrain.swarm.averaging.share import ShareChecks
from dtrain.swarm.hivemind_internals import deserialize_part, serialize_part


@dataclass(frozen=True)
class FaultInjection:
    send_delay_s: float = 0.0  # sleep before each part sent to another reducer (a slow peer)
    # after its last part to a reducer, hold the stream's end-of-stream marker back this long: an
    # honest sender on a loaded host whose writer lags, so the reducer's last averaged part
    # reaches it first and it hangs up before its stream's end went out
    end_delay_s: float = 0.0
    send_nonfinite: bool = False  # send NaN/Inf instead of our values (a broken/cheating peer)
    scale_parts: float = 1.0  # multiply sent parts after announcing the true norm (a lying poisoner)
    fail_after_parts: Optional[int] = None  # raise in the writer after this many parts (a broken encoder)
    # prove, to every reducer, the claims of the parts actually sent (its parts times scale_parts)
    # instead of the committed ones: a liar whose per-part claims would all check out
    forge_claims: bool = False
    # multiply the averaged parts this peer returns as a reducer (its account stays the honest
    # one): a reducer that alters its results
    scale_results: float = 1.0
    # add Gaussian noise of this relative norm to the averaged parts it returns
    noise_results: float = 0.0
    # as a reducer, leave the sender with this peer id out of every combination (weight 0), and
    # say so in the account: a result the claims explain, but not the rule
    drop_sender: Optional[str] = None
    # as a reducer, return each averaged part reflected through its public sketch's null space
    # (about negated, every public check unchanged: dtrain.sandbox.adversary.nullspace_reduced)
    nullspace_results: bool = False
    # send each part reflected through its public sketch's null space, after committing the
    # digests of the honest bytes (its claims still match): other bytes than committed
    nullspace_parts: bool = False
    # as a reducer, add to each averaged part random noise projected onto its public sketch's
    # null space, of this relative norm (another null-space construction than the reflection)
    nullspace_noise_results: float = 0.0
    # answer the members' result-check questions with false sketches (negated): "all" of them,
    # or only the "first" part of each question that another reducer holds (one reducer's part)
    lie_in_result_check: str = ""
    # refuse every result-check question (an older release, or a peer that went away)
    silent_in_result_check: bool = False


def _nullspace(plan, values, global_part: int):
    from dtrain.sandbox.adversary import nullspace_reduced

    param, start, _ = plan.layout.parts[global_part]
    return nullspace_reduced(values, param, start, plan.rules.claims_nonce).to(values.dtype)


def mechanisms(fault: FaultInjection) -> Mechanisms:
    """The round's mechanisms of a peer with ``fault`` (each runs in its averager process)."""
    rounds = {}  # the round's plan, for the kept contribution's lies (it knows no plan of its own)

    class Sending(OurParts):
        def head_for(self, reducer_index: int):
            if not fault.forge_claims or self.plan.own_tree is None:
                return super().head_for(reducer_index)
            from dtrain.swarm.averaging.claims_tree import ClaimsTree

            forged = ClaimsTree(self.plan.own_tree.claims * fault.scale_parts)  # sketches are linear
            return forged.range_proof(*self.plan.share_of(reducer_index))

        async def stream(self, reducer_index: int, parts):
            sent = 0
            async for item in super().stream(reducer_index, parts):
                if isinstance(item, bytes):  # the head
                    yield item
                    continue
                if fault.fail_after_parts is not None and sent >= fault.fail_after_parts:
                    raise RuntimeError("injected: the part could not be encoded")
                sent += 1
                if fault.send_delay_s > 0:
                    await asyncio.sleep(fault.send_delay_s)
                yield self._altered(item, self.plan.share_of(reducer_index)[0] + sent - 1)
            if fault.end_delay_s > 0:
                await asyncio.sleep(fault.end_delay_s)

        def _altered(self, msg, global_part: int):
            if fault.send_nonfinite:
                part = deserialize_part(msg.tensor_part)
                bad = torch.full_like(part, float("nan"))
                bad.view(-1)[::2] = float("inf")
                msg.tensor_part.CopyFrom(serialize_part(bad, msg.tensor_part.compression))
            if fault.scale_parts != 1.0:
                part = deserialize_part(msg.tensor_part)
                msg.tensor_part.CopyFrom(serialize_part(part * fault.scale_parts, msg.tensor_part.compression))
            if fault.nullspace_parts:
                part = _nullspace(self.plan, deserialize_part(msg.tensor_part), global_part)
                msg.tensor_part.CopyFrom(serialize_part(part, msg.tensor_part.compression))
            return msg

    class Share(ShareChecks):
        def __init__(self, plan):
            rounds["plan"] = plan
            super().__init__(plan)

        def new_reducer(self, part_shapes):
            if fault.drop_sender in self.plan.sender_ids:
                weights = list(self.plan.rules.sender_weights)
                weights[self.plan.sender_ids.index(fault.drop_sender)] = 0.0
                from dtrain.swarm.averaging.reducer import CheckedReducer

                return CheckedReducer(part_shapes, self.plan.num_senders, weights, self.plan.rules.sender_norms,
                                      robust=self.plan.rules.robust)
            return super().new_reducer(part_shapes)

    class Reply(ReducerReply):
        def serialized(self, part_index: int, averaged, compression):
            return super().serialized(part_index, self._altered(part_index, averaged), compression)

        def _altered(self, part_index: int, averaged):
            g = self.plan.share_of(self.plan.me)[0] + part_index
            if fault.nullspace_results:
                averaged = _nullspace(self.plan, averaged, g)
            if fault.nullspace_noise_results:
                param, start, _ = self.plan.layout.parts[g]
                noise = torch.randn(averaged.shape, generator=torch.Generator().manual_seed(part_index),
                                    dtype=torch.float64)
                hidden = project_out_sketch(noise, param, start, self.plan.rules.claims_nonce, k=WORK_SKETCH_K)
                scale = fault.nullspace_noise_results * float(averaged.norm()) / max(float(hidden.norm()), 1e-30)
                averaged = (averaged.double() + scale * hidden).to(averaged.dtype)
            if fault.scale_results != 1.0 or fault.noise_results:
                altered = averaged * fault.scale_results
                if fault.noise_results:
                    noise = torch.randn(averaged.shape, generator=torch.Generator().manual_seed(part_index))
                    altered += noise * (fault.noise_results * float(averaged.norm()) / float(noise.norm()))
                averaged = altered
            return averaged

    class Kept(SentContribution):
        async def answer_member(self, payload, asker, nonce_of):
            if fault.silent_in_result_check:
                return None
            answer = await super().answer_member(payload, asker, nonce_of)
            if answer is None or not fault.lie_in_result_check:
                return answer
            import numpy as np

            sketches = np.frombuffer(answer, dtype="<f4").reshape(-1, WORK_SKETCH_K).copy()
            if fault.lie_in_result_check == "all":
                rows = list(range(len(sketches)))
            else:  # the first part asked of another reducer's share (a lie about our own result frames no one)
                own = rounds["plan"].own_share
                _, _, parts = decode_ask(payload, len(self.layout))
                rows = [next(i for i, g in enumerate(parts) if g not in own)]
            sketches[rows] = -sketches[rows]
            return sketches.astype("<f4").tobytes()

    return Mechanisms(sending=Sending, share=Share, reply=Reply, kept=Kept)


def swarm(dht, templates, fingerprint, config=None, *, fault: Optional[FaultInjection] = None, **kwargs):
    """A GradientSwarm that commits per-step work reports, faulty when ``fault`` is given."""
    from dtrain.training.work import WorkReport

    kwargs.setdefault("report_type", WorkReport)
    if fault is not None:
        kwargs["mechanisms"] = mechanisms(fault)
    return GradientSwarm(dht, templates, fingerprint, config, **kwargs)
