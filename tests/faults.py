"""Deliberate misbehaviour of a swarm peer, for tests: a slow, broken or lying sender.

Production code has no fault switches. A faulty peer is built from the seams the real one
offers: FaultySwarm starts a FaultyAverager (GradientSwarm._new_averager), whose runner is a
FaultyRunner (SwarmAverager.runner_class / make_runner), which alters the wire messages it
sends to other reducers (ButterflyRunner.messages_to_reducer). Everything else, its own share
included, is the honest code path.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Optional

import torch

from dtrain.swarm.averaging import GradientSwarm
from dtrain.swarm.averaging.averager import SwarmAverager
from dtrain.swarm.averaging.runner import CheckedRunner
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
    # (about negated, every public check unchanged: dtrain.neurons.adversary.nullspace_reduced)
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


class FaultyRunner(CheckedRunner):
    def __init__(self, *, fault: FaultInjection, **kwargs):
        self.fault = fault
        super().__init__(**kwargs)

    def preamble_for(self, peer_index: int):
        if not self.fault.forge_claims or self.own_tree is None:
            return super().preamble_for(peer_index)
        from dtrain.swarm.averaging.claims_tree import ClaimsTree

        forged = ClaimsTree(self.own_tree.claims * self.fault.scale_parts)  # sketches are linear
        return forged.range_proof(*self.share_of(peer_index))

    def new_reducer(self, part_shapes, num_senders):
        if self.fault.drop_sender in self.sender_ids:
            self.sender_weights[self.sender_ids.index(self.fault.drop_sender)] = 0.0
        return super().new_reducer(part_shapes, num_senders)

    def _nullspace(self, values, global_part: int):
        from dtrain.neurons.adversary import nullspace_reduced

        param, start, _ = self.layout.parts[global_part]
        return nullspace_reduced(values, param, start, self.claims_nonce).to(values.dtype)

    def serialized_average(self, part_index: int, averaged, compression):
        fault = self.fault
        if fault.nullspace_results:
            averaged = self._nullspace(averaged, self.first_part + part_index)
        if fault.nullspace_noise_results:
            from dtrain.sketch import project_out_sketch
            from dtrain.sketch import WORK_SKETCH_K

            param, start, _ = self.layout.parts[self.first_part + part_index]
            noise = torch.randn(averaged.shape, generator=torch.Generator().manual_seed(part_index), dtype=torch.float64)
            hidden = project_out_sketch(noise, param, start, self.claims_nonce, k=WORK_SKETCH_K)
            scale = fault.nullspace_noise_results * float(averaged.norm()) / max(float(hidden.norm()), 1e-30)
            averaged = (averaged.double() + scale * hidden).to(averaged.dtype)
        if fault.scale_results != 1.0 or fault.noise_results:
            altered = averaged * fault.scale_results
            if fault.noise_results:
                noise = torch.randn(averaged.shape, generator=torch.Generator().manual_seed(part_index))
                altered += noise * (fault.noise_results * float(averaged.norm()) / float(noise.norm()))
            averaged = altered
        return super().serialized_average(part_index, averaged, compression)

    async def messages_to_reducer(self, peer_index: int, messages):
        fault = self.fault
        sent = 0
        async for msg in messages:
            if fault.fail_after_parts is not None and sent >= fault.fail_after_parts:
                raise RuntimeError("injected: the part could not be encoded")
            sent += 1
            if fault.send_delay_s > 0:
                await asyncio.sleep(fault.send_delay_s)
            if fault.send_nonfinite:
                part = deserialize_part(msg.tensor_part)
                bad = torch.full_like(part, float("nan"))
                bad.view(-1)[::2] = float("inf")
                msg.tensor_part.CopyFrom(serialize_part(bad, msg.tensor_part.compression))
            if fault.scale_parts != 1.0:
                part = deserialize_part(msg.tensor_part)
                msg.tensor_part.CopyFrom(serialize_part(part * fault.scale_parts, msg.tensor_part.compression))
            if fault.nullspace_parts:
                part = self._nullspace(deserialize_part(msg.tensor_part), self.share_of(peer_index)[0] + sent - 1)
                msg.tensor_part.CopyFrom(serialize_part(part, msg.tensor_part.compression))
            yield msg
        if fault.end_delay_s > 0:
            await asyncio.sleep(fault.end_delay_s)


class FaultyAverager(SwarmAverager):
    runner_class = FaultyRunner

    def __init__(self, *args, fault: FaultInjection, **kwargs):
        self.fault = fault
        super().__init__(*args, **kwargs)

    def make_runner(self, *args, **kwargs):
        self.runner = super().make_runner(*args, fault=self.fault, **kwargs)
        return self.runner

    async def answer_member(self, group_id, payload, asker):
        if self.fault.silent_in_result_check:
            return None
        answer = await super().answer_member(group_id, payload, asker)
        if answer is not None and self.fault.lie_in_result_check:
            import numpy as np

            from dtrain.swarm.averaging import result_check

            sketches = np.frombuffer(answer, dtype="<f4").reshape(-1, 64).copy()
            if self.fault.lie_in_result_check == "all":
                rows = list(range(len(sketches)))
            else:  # the first part asked of another reducer's share (a lie about our own result frames no one)
                own = self.runner.own_share()
                _, _, parts = result_check.decode_ask(payload, len(self._sent.sent.layout))
                rows = [next(i for i, g in enumerate(parts) if g not in own)]
            sketches[rows] = -sketches[rows]
            answer = sketches.astype("<f4").tobytes()
        return answer


class FaultySwarm(GradientSwarm):
    def __init__(self, *args, fault: FaultInjection, **kwargs):
        self.fault = fault  # read by _new_averager, which GradientSwarm.__init__ calls
        super().__init__(*args, **kwargs)

    def _new_averager(self, buffers, dht, **kwargs):
        return FaultyAverager(buffers, dht, fault=self.fault, **kwargs)


def swarm(dht, templates, fingerprint, config=None, *, fault: Optional[FaultInjection] = None, **kwargs):
    """A GradientSwarm, faulty when ``fault`` is given."""
    if fault is None:
        return GradientSwarm(dht, templates, fingerprint, config, **kwargs)
    return FaultySwarm(dht, templates, fingerprint, config, fault=fault, **kwargs)
