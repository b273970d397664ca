"""Cheating miners, for tests and ``dtrain sandbox --adversary KIND`` (``MINERS`` lists the kinds).

Each kind misbehaves in one way, so validator operators can watch the scoring catch it
(docs/scoring.md, "Adversaries"): some answer validators falsely (``lazy``, ``wrong-model``,
``copycat``, ``freeloader``), some alter what they send into the all-reduce, joining only rounds
they trained for (``_AlteredContribution`` and the others down to ``nullspace-sender``), and
some alter what they return as reducers (``negating-reducer``, ``scaling-reducer``,
``nullspace-reducer``). ``fused-adamw`` is no cheat: an honest miner on another optimizer
kernel, the sandbox's "other hardware"; ``third-speed`` is no cheat either: an honest miner on
hardware a third as fast. Each overrides one seam of the honest Miner, its
modes (``build_workbench(modes=...)``) or its round's mechanisms (``_mechanisms``); the honest
code never asks which kind it runs. Run by ``dtrain sandbox --adversary KIND`` through
dtrain/cli/sandbox_neuron.py, never by ``dtrain mine``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import random
from collections.abc import Sequence

from dtrain.modes import DiLoCo, PerStep
from dtrain.neurons.miner import Miner

INFLATED_WEIGHT = 1e6
POISON_SCALE = 1000.0
RESCALE = 2.0
NOISE_RATIO = 0.5
REDUCER_SCALE = 0.5
# The null-space cheats subtract this many times the null-space component of what they alter.
# 2 reflects it: the same norm (the norm checks see nothing), the same public sketch, and a
# cosine with the honest vector of about -(1 - 2k/n) for a part of n values (k = 64 buckets).
# (1 would only remove the component: a vector of about sqrt(k/n) of the norm, still positive.)
NULLSPACE_SCALE = 2.0


class AdversarialMiner(Miner):
    kind = "honest"


class Lazy(AdversarialMiner):
    kind = "lazy"

    def _wants_more_data(self) -> bool:
        return False  # never trains

    def _challenge_fingerprints(self, request, pages):
        return fabricated_fingerprints(len(pages) * self.cfg.data.page_sequences, request.micro_batch_size,
                                       request.nonce, self._last_loss)


class WrongModel(AdversarialMiner):
    kind = "wrong-model"

    def _build_workbench(self):
        from dtrain.neurons import runtime

        return runtime.build_workbench(self.cfg, n_positions=wrong_model_positions(self.cfg))


class Copycat(AdversarialMiner):
    kind = "copycat"

    def _challenge_uid(self) -> int:
        return copycat_uid(self.uid)


class Freeloader(AdversarialMiner):
    kind = "freeloader"

    def _joins_rounds(self) -> bool:
        return False


class _AlteredContribution(AdversarialMiner):
    """Trains honestly and commits its honest work report, then sends ``alter(mean)``.

    It joins only a round it has trained for. With nothing trained this epoch (it has just
    caught up, e.g. after its previous round refused it and left it an epoch behind) its
    contribution would carry weight 0: the swarm checks neither the scale nor the binding of
    a peer that brings no weight (there is nothing of it to average), so it would pass as an
    honest weight-0 peer (SUCCESS), or not, by how the catch-up raced the round. It sits
    such a round out instead: every round it joins is one it cheats in.
    """

    def alter(self, mean: list) -> list:
        raise NotImplementedError

    def _do_round(self, request):
        # Runs on the training thread, like a catch-up: the epoch and samples read here are
        # the ones the honest round below would contribute with.
        if request.epoch == self.epoch and self._samples_this_epoch() <= 0:
            from dtrain.api.messages import AllReduceResponse

            self.tel.event(f"round for epoch {request.epoch}: sitting it out (nothing trained this epoch to alter)")
            return AllReduceResponse(joined=False, epoch=self.epoch, round=None,
                                     reason="nothing trained this epoch to alter")
        return super()._do_round(request)

    def _contribution(self, samples, weight_cap, out=None):
        honest = super()._contribution(samples, weight_cap)  # its own tensors: alter() may replace them
        return dataclasses.replace(honest, tensors=self.alter(honest.tensors))


class InflatedWeight(AdversarialMiner):
    kind = "inflated-weight"

    def _contribution(self, samples, weight_cap, out=None):
        return dataclasses.replace(super()._contribution(samples, weight_cap, out=out), weight=INFLATED_WEIGHT)


class Poisoner(_AlteredContribution):
    kind = "poisoner"

    def alter(self, mean):
        return poison(mean)


class SignFlip(_AlteredContribution):
    kind = "sign-flip"

    def alter(self, mean):
        return [-t for t in mean]


class Zero(_AlteredContribution):
    kind = "zero"

    def alter(self, mean):
        return [t * 0 for t in mean]


class Selective(_AlteredContribution):
    """Honest in the rounds a validator checks it (it learns so from the Train query, before the
    round), zeros in the others: the cheat sampled checks invite, which the audits of unchecked
    work drawn after each round catch (docs/scoring.md, "Sampled checks")."""

    kind = "selective"
    _checked_epoch = -1

    def _do_train(self, request):
        self._checked_epoch = request.epoch
        return super()._do_train(request)

    def alter(self, mean):
        return mean if self._checked_epoch == self.epoch else [t * 0 for t in mean]


class Rescale(_AlteredContribution):
    kind = "rescale"

    def alter(self, mean):
        return [t * RESCALE for t in mean]


class Noisy(_AlteredContribution):
    kind = "noisy"

    def alter(self, mean):
        import torch

        norm = float(sum(float(t.double().pow(2).sum()) for t in mean)) ** 0.5
        numel = sum(t.numel() for t in mean)
        sigma = NOISE_RATIO * norm / max(numel, 1) ** 0.5
        gen = torch.Generator().manual_seed(self.epoch)
        return [t + sigma * torch.randn(t.shape, generator=gen) for t in mean]


class Replay(_AlteredContribution):
    kind = "replay"
    _previous: list | None = None

    def alter(self, mean):
        sent = self._previous if self._previous is not None else mean
        self._previous = [t.clone() for t in mean]
        return [t.clone() for t in sent]


class NullspaceSender(_AlteredContribution):
    """Trains, reports and commits honestly; sends its mean with, in every part, its component in
    the null space of that part's public range sketch reflected (see ``nullspace_altered``)."""

    kind = "nullspace-sender"

    def _build_workbench(self):
        from dtrain.neurons import runtime

        # One local batch a round in gradient mode: the secret-seed batch audit, the only check
        # that sees this cheat, is then drawn at the configured chance itself (1 in the sandbox)
        # instead of local_batch / committed (verification.batch_audit_chance).
        return runtime.build_workbench(self.cfg, modes={"gradient": _OneLocalBatch, "diloco": DiLoCo})

    def alter(self, mean):
        from dtrain.swarm.averaging.contribution import PartLayout
        from dtrain.swarm.wire import make_compression
        from dtrain.training.work import work_nonce

        # The parts and the nonce the swarm will claim this contribution under: the layout from
        # its own wire settings (it splits float32 buffers), the nonce that _do_round commits with.
        settings = self.swarm.config
        tensors = [t.detach().float() for t in mean]
        layout = PartLayout.of(tensors, make_compression(settings.compression), settings.part_size_bytes)
        return nullspace_altered(tensors, layout, work_nonce(self.bench.run_id, self.epoch))


class _OneLocalBatch(PerStep):
    """Per-step training that commits at most one local batch a round (it still accepts the
    swarm's weights up to the target: only what it brings is smaller)."""

    @property
    def contribution_limit(self) -> int:
        return self.settings.local_batch_size

    @property
    def weight_cap(self) -> float:
        return float(max(self.settings.target_batch_size, self.settings.local_batch_size))


class Sandbagger(AdversarialMiner):
    """Trains one page (one inner step in DiLoCo), claims a full contribution with a made-up
    work report: the sandbagging modes below do the training and the making up."""

    kind = "sandbagger"

    def _build_workbench(self):
        from dtrain.neurons import runtime

        # the modes read this miner's uid and epoch when they make up a report (both are known
        # only once it runs)
        modes = {"gradient": functools.partial(_SandbaggingPerStep, miner=self),
                 "diloco": functools.partial(_SandbaggingDiLoCo, miner=self)}
        return runtime.build_workbench(self.cfg, modes=modes)


class _SandbaggingPerStep(PerStep):
    """Trains one page of its local batch and commits a report naming the whole batch: the
    right page ids, each with the sketch of the real page's share of what it sends."""

    def __init__(self, *args, miner, **kwargs):
        super().__init__(*args, **kwargs)
        self.miner = miner

    @property
    def wants_data(self) -> bool:
        return self.trainer.accumulated_samples < self.settings.page_sequences and super().wants_data

    def contribution(self, samples, weight_cap, out=None):
        from dtrain.modes import Contribution
        from dtrain.training.data import assign_pages
        from dtrain.training.work import PageWork, WorkReport

        honest = super().contribution(samples, weight_cap, out=out)
        real = honest.report
        per_page = self.settings.page_sequences
        count = max(1, self.settings.local_batch_size // per_page)
        if not real.pages:
            return dataclasses.replace(honest, weight=0.0)
        # every page "contributes" the same sketch, so the report's mean matches what is sent
        sketch = tuple(v * per_page for v in real.mean_sketch())
        pages = assign_pages(run_id=self.settings.run_id, uid=self.miner.uid, epoch=self.miner.epoch, page_counter=0,
                             count=count, num_pages=self.reader.num_pages)
        fake = tuple(PageWork(page=p, counter=i, samples=per_page, loss=real.pages[0].loss, sketch=sketch)
                     for i, p in enumerate(pages))
        report = WorkReport(epoch=real.epoch, pages=fake)
        return Contribution(honest.tensors, float(min(report.samples, weight_cap)), report)


class _SandbaggingDiLoCo(DiLoCo):
    """One real inner step passed off as H, each "step" repeating the real one's update, with
    the pseudo-gradient scaled to match (so the binding rule holds)."""

    def __init__(self, *args, miner, **kwargs):
        super().__init__(*args, **kwargs)
        self.miner = miner

    @property
    def wants_data(self) -> bool:
        return self.trajectory.steps_done < 1 and super().wants_data

    def contribution(self, samples, weight_cap, out=None):
        from dtrain.modes import Contribution
        from dtrain.training.data import assign_pages
        from dtrain.training.trajectory import InnerStepWork, SnapshotCommit, TrajectoryReport

        honest = super().contribution(samples, weight_cap, out=out)
        real = honest.report
        if not real.steps:
            return dataclasses.replace(honest, weight=0.0)
        H, one = self.settings.inner_steps, real.steps[0]
        n = len(one.pages)
        pages = assign_pages(run_id=self.settings.run_id, uid=self.miner.uid, epoch=self.miner.epoch, page_counter=0,
                             count=H * n, num_pages=self.reader.num_pages)
        steps = tuple(InnerStepWork(counters=tuple(range(i * n, (i + 1) * n)), pages=tuple(pages[i * n:(i + 1) * n]),
                                    samples=one.samples, loss=one.loss, sketch=one.sketch, grad_sketch=one.grad_sketch)
                      for i in range(H))
        first = real.snapshots[0]
        snaps = tuple(SnapshotCommit(step=s, exp_avg=first.exp_avg, exp_avg_sq=first.exp_avg_sq)
                      for s in range(0, H, real.every))
        carry = dataclasses.replace(real.carry, step=real.t0 + H)  # the real end moments, passed off as H steps
        report = TrajectoryReport(epoch=real.epoch, every=real.every, start=real.start, steps=steps, snapshots=snaps,
                                  t0=real.t0, carry=carry)
        return Contribution([t * H for t in honest.tensors], float(min(report.samples, weight_cap)), report)


def _altering_reply(alter):
    """Round mechanisms whose reducer returns ``alter(averaged part)`` with the true account, on
    either protocol: hivemind's (the reply, to every other member; its own copy stays the true
    combination) and dtrain's own (the round's checks publish it, to every member alike)."""
    from dtrain.swarm.averaging.mechanisms import Mechanisms
    from dtrain.swarm.averaging.reply import ReducerReply
    from dtrain.swarm.commitments import CommittedChecks

    class AlteringReply(ReducerReply):
        def serialized(self, part_index, averaged, compression):
            return super().serialized(part_index, alter(averaged, plan=self.plan, part_index=part_index), compression)

    class AlteringChecks(CommittedChecks):
        def published(self, j, averaged):
            g = self.membership.share_of(self.me)[0] + j
            param_index, start, _ = self.layout.parts[g]
            return alter(averaged, param_index=param_index, start=start, nonce=self.nonce,
                         committed=bool(self.commitments))

    return Mechanisms(reply=AlteringReply, round_checks=AlteringChecks)


def _nullspace_reduce(averaged, *, plan=None, part_index=0, param_index=0, start=0, nonce="", committed=True):
    """``averaged`` reflected through its public sketch's null space (unchanged in a round without
    commitments). On hivemind's protocol the part is ``part_index`` of the reducer's share in
    ``plan``; on dtrain's, it holds the elements ``start ...`` of ``param_index``, under ``nonce``."""
    if plan is not None:
        if plan.rules.commitments is None:
            return averaged
        param_index, start, _ = plan.layout.parts[plan.share_of(plan.me)[0] + part_index]
        nonce = plan.rules.claims_nonce
    elif not committed:
        return averaged
    return nullspace_reduced(averaged, param_index, start, nonce)


class NegatingReducer(AdversarialMiner):
    """Honest in everything it sends; returns its share of the average negated."""

    kind = "negating-reducer"

    def _mechanisms(self):
        return _altering_reply(lambda averaged, **_: -averaged)


class ScalingReducer(AdversarialMiner):
    """Honest in everything it sends; returns its share of the average times REDUCER_SCALE."""

    kind = "scaling-reducer"

    def _mechanisms(self):
        return _altering_reply(lambda averaged, **_: averaged * REDUCER_SCALE)


class NullspaceReducer(AdversarialMiner):
    """Honest in everything it sends; returns its share of the average about negated, with every
    part's public range sketch (what its account is checked against) unchanged."""

    kind = "nullspace-reducer"

    def _mechanisms(self):
        return _altering_reply(_nullspace_reduce)


class WrongPages(AdversarialMiner):
    """Trains on another miner's pages (the next page id) but commits its own page ids."""

    kind = "wrong-pages"

    def _read_own_page(self, page: list[int]):
        return self.bench.reader.read_pages([(page[0] + 1) % self.bench.reader.num_pages])


class FusedAdamW(AdversarialMiner):
    """Honest, with torch's fused AdamW instead of the plain one (another optimizer implementation)."""

    kind = "fused-adamw"

    def _build_workbench(self):
        from dtrain.neurons import runtime

        # the local AdamW steps (DiLoCo: the inner copy's) on the fused kernel
        return runtime.build_workbench(self.cfg, fused=True)


class ThirdSpeed(AdversarialMiner):
    """Honest, on hardware a third as fast: each page it trains holds its training thread three
    times as long (the sandbox's slower GPU; pay must follow the samples it verifies)."""

    kind = "third-speed"

    def _train_own_page(self) -> None:
        import time

        t0 = time.perf_counter()
        super()._train_own_page()
        self.stop.wait(2.0 * (time.perf_counter() - t0))


MINERS = {cls.kind: cls for cls in (Lazy, WrongModel, Copycat, Freeloader, InflatedWeight, Poisoner, SignFlip, Zero,
                                    Selective, Rescale, Noisy, Replay, Sandbagger, WrongPages, NullspaceSender, NegatingReducer,
                                    ScalingReducer, NullspaceReducer, FusedAdamW, ThirdSpeed)}
KINDS = tuple(MINERS)


def miner_class(kind: str | None) -> type[Miner]:
    """The Miner class for ``--adversary KIND`` (the honest one for None)."""
    if kind is None:
        return Miner
    try:
        return MINERS[kind]
    except KeyError:
        from dtrain.neurons.runtime import NeuronError

        raise NeuronError(f"unknown adversary kind {kind!r}; expected one of {', '.join(KINDS)}") from None


def wrong_model_positions(cfg) -> int:
    """A context length the honest swarm does not use: a different architecture and fingerprint."""
    return max(cfg.model.seq_len, 1) * 2


def copycat_uid(uid: int) -> int:
    return uid - 1 if uid > 0 else uid + 1


def fabricated_fingerprints(samples: int, micro_batch_size: int, nonce: str, last_loss: float | None) -> list:
    """Plausible-looking micro-batch fingerprints computed from nothing."""
    from dtrain.sketch import DEFAULT_K
    from dtrain.training.fingerprint import Fingerprint

    rng = random.Random(hashlib.sha256(nonce.encode()).digest())
    out = []
    remaining = samples
    base = last_loss if last_loss is not None else 7.5
    while remaining > 0:
        n = min(micro_batch_size, remaining)
        remaining -= n
        out.append(Fingerprint(loss=base + rng.uniform(-0.2, 0.2), sketch=tuple(rng.gauss(0, 1) for _ in range(DEFAULT_K)),
                               samples=n, nonce=nonce))
    return out


def poison(tensors: Sequence) -> list:
    import torch

    generator = torch.Generator().manual_seed(1234)
    return [t * POISON_SCALE + torch.randn(t.shape, generator=generator) * POISON_SCALE for t in tensors]


def nullspace_altered(tensors: Sequence, layout, nonce: str, scale: float = NULLSPACE_SCALE) -> list:
    """``tensors`` (float32, in parameter order) with, part by part of ``layout``, ``scale`` times
    the part's component in the null space of its public range sketch under ``nonce`` subtracted:
    every part's range sketch is the honest one's, the vector is not."""
    out = [t.detach().clone() for t in tensors]
    for param_index, start, length in layout.parts:
        flat = out[param_index].view(-1)  # a view of the clone: the part is written in place
        piece = flat[start:start + length].double()  # float64: the sketch moves by the final rounding only
        altered = piece + _null_component(-scale * piece, param_index, start, nonce)
        flat[start:start + length] = altered.to(flat.dtype)
    return out


def nullspace_reduced(averaged, param_index: int, start: int, nonce: str, scale: float = NULLSPACE_SCALE):
    """An averaged part (elements ``start ...`` of parameter ``param_index``) with ``scale`` times
    its null-space component under ``nonce`` subtracted: its range sketch is unchanged."""
    part = averaged.detach().double()
    return (part + _null_component(-scale * part, param_index, start, nonce)).to(averaged.dtype)


def _null_component(values, param_index: int, start: int, nonce: str):
    from dtrain.sketch import WORK_SKETCH_K, project_out_sketch

    # the claims' sketch width: the projection must be of the very sketch the checks compute
    return project_out_sketch(values, param_index, start, nonce, k=WORK_SKETCH_K)
