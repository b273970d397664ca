"""The local trainer: micro-batches, gradient accumulation, optimizer step, and the seam the
swarm uses (``accumulate``, ``gradients``, ``set_gradients``, ``step``, ``zero_grad``).

Gradients are *summed over samples*; ``step()`` divides by ``accumulated_samples`` before
clipping, so the update is the per-sample mean however the batch was split, and the swarm
weights peers by the samples they processed. docs/training.md ("Trainer") has the API.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

import torch

from dtrain.procmem import trim_heap
from dtrain.sketch import DEFAULT_K, gradient_sketch
from dtrain.training.errors import TrainerStateError
from dtrain.training.fingerprint import Fingerprint
from dtrain.training.optimizers import OPTIMIZERS, build_optimizer, lr_factor
from dtrain.training.precision import PRECISIONS, autocast_context, resolve_precision

log = logging.getLogger(__name__)


@dataclass
class TrainerConfig:
    micro_batch_size: int = 4
    local_batch_size: int = 16  # samples to accumulate before a local step (see Trainer.local_batch_full)
    optimizer: str = "adamw"
    lr: float = 3e-4
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    warmup_steps: int = 100
    total_steps: int = 10_000  # cosine reaches min_lr at this inner step
    min_lr_ratio: float = 0.1
    grad_clip: float | None = 1.0  # max global L2 norm; None disables clipping
    precision: str = "auto"  # auto: bf16 autocast on CUDA when supported, else fp32
    device: str = "cpu"
    # None: torch's fused AdamW on CUDA, the plain one elsewhere. Replicas that differ here
    # drift apart by rounding only; docs/scoring.md gives the measured drift and tolerance.
    fused: bool | None = None
    # Only for optimizer "nesterov" (DiLoCo's outer step: SGD with Nesterov momentum).
    momentum: float = 0.9

    def validate(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.micro_batch_size < 1 or self.local_batch_size < 1:
            raise ValueError("micro_batch_size and local_batch_size must be >= 1")
        if self.warmup_steps < 0 or self.total_steps < 1:
            raise ValueError("warmup_steps must be >= 0 and total_steps >= 1")


@dataclass
class Counters:
    samples: int = 0  # samples accumulated (locally computed) since the start of the run
    tokens: int = 0
    inner_step: int = 0  # optimizer steps taken
    epoch: int = 0  # set by the caller (the swarm's global epoch)


@dataclass(frozen=True)
class MicroBatchResult:
    loss: float
    samples: int
    fingerprint: Fingerprint | None = None


@dataclass(frozen=True)
class StepMetrics:
    loss: float  # mean micro-batch loss of the accumulation (nan if gradients were set externally only)
    grad_norm: float  # before clipping
    lr: float
    tokens_per_s: float
    samples: int
    inner_step: int
    epoch: int
    tokens: int


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Parameters in the stable order used for gradients, flat vectors and fingerprints."""
    return [p for _, p in model.named_parameters() if p.requires_grad]


def microbatch_loss(model, input_ids: torch.Tensor, precision: str) -> torch.Tensor:
    """Mean next-token loss of one micro-batch (labels = inputs; the model shifts)."""
    with autocast_context(precision, input_ids.device):
        out = model(input_ids=input_ids, labels=input_ids, use_cache=False)
    return out.loss.float()


def microbatch_gradients(model, params, input_ids: torch.Tensor, precision: str):
    """(loss, grads) of one micro-batch without touching ``.grad``; grads are sample-summed.

    Shared by the miner's fingerprinted path and the validator's recomputation so
    both run the very same computation.
    """
    loss = microbatch_loss(model, input_ids, precision)
    grads = torch.autograd.grad(loss * input_ids.shape[0], params, allow_unused=True)
    return loss.detach(), grads


class Trainer:
    """Local training of one model replica. See the module docstring for the seam."""

    def __init__(
        self,
        model: torch.nn.Module,
        config: TrainerConfig,
        *,
        on_metrics: Callable[[StepMetrics], None] | None = None,
    ):
        config.validate()
        self.config = config
        self.device = torch.device(config.device)
        self.model = model.to(self.device)
        self.model.train()
        self.precision = resolve_precision(config.precision, self.device)
        self.params = trainable_parameters(self.model)
        self.optimizer = build_optimizer(self.params, config)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda s: lr_factor(s, warmup_steps=config.warmup_steps, total_steps=config.total_steps,
                                min_lr_ratio=config.min_lr_ratio),
        )
        self.counters = Counters()
        self.on_metrics = on_metrics
        self._acc_samples = 0
        self._acc_tokens = 0
        self._acc_loss_sum = 0.0
        self._acc_microbatches = 0
        self._t_start: float | None = None
        self._offloaded = None  # a dtrain.training.offload.Offload while state is on disk

    # ------------------------------------------------------------------ accumulate
    @property
    def accumulated_samples(self) -> int:
        return self._acc_samples

    @property
    def accumulated_tokens(self) -> int:
        return self._acc_tokens

    @property
    def local_batch_full(self) -> bool:
        """True once ``local_batch_size`` samples are accumulated: time to step or to average."""
        return self._acc_samples >= self.config.local_batch_size

    def accumulate(
        self,
        input_ids: torch.Tensor,
        *,
        fingerprint_nonce: str | bytes | int | None = None,
        fingerprint_k: int = DEFAULT_K,
    ) -> list[MicroBatchResult]:
        """Forward/backward ``input_ids`` [B, L] in micro-batches, adding to the gradients.

        With ``fingerprint_nonce`` each micro-batch also gets a gradient Fingerprint
        (computed as the validator will: ``microbatch_gradients`` then the sketch).
        """
        self.resident()
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq_len], got shape {tuple(input_ids.shape)}")
        if self._t_start is None:
            self._t_start = time.perf_counter()
        x_all = input_ids.to(self.device, non_blocking=True)
        mb = self.config.micro_batch_size
        losses: list[torch.Tensor] = []
        prints: list[Fingerprint | None] = []
        for start in range(0, x_all.shape[0], mb):
            x = x_all[start : start + mb]
            if fingerprint_nonce is None:
                loss = microbatch_loss(self.model, x, self.precision)
                (loss * x.shape[0]).backward()
                loss = loss.detach()
                prints.append(None)
            else:
                loss, grads = microbatch_gradients(self.model, self.params, x, self.precision)
                sketch = gradient_sketch(grads, fingerprint_nonce, k=fingerprint_k)
                for p, g in zip(self.params, grads):
                    if g is None:
                        continue
                    if p.grad is None:
                        p.grad = g
                    else:
                        p.grad.add_(g)
                prints.append((sketch, x.shape[0]))
            losses.append(loss)
            self._acc_samples += x.shape[0]
            self._acc_tokens += x.numel()
            self.counters.samples += x.shape[0]
            self.counters.tokens += x.numel()
        # one host sync per call, not per micro-batch
        values = torch.stack(losses).tolist() if losses else []
        self._acc_loss_sum += sum(values)
        self._acc_microbatches += len(values)
        out = []
        for i, (v, fp) in enumerate(zip(values, prints)):
            n = min(mb, x_all.shape[0] - i * mb)
            if fp is not None:
                sketch, samples = fp
                nonce = fingerprint_nonce.hex() if isinstance(fingerprint_nonce, bytes) else str(fingerprint_nonce)
                fp = Fingerprint(loss=v, sketch=tuple(sketch.tolist()), samples=samples, nonce=nonce)
            out.append(MicroBatchResult(loss=v, samples=n, fingerprint=fp))
        return out

    # ------------------------------------------------------------- DiLoCo inner loop
    def reset_optimizer_state(self) -> None:
        """Forget the optimizer's moments and step counts (a fresh start, as at construction):
        DiLoCo's inner loop when it cannot carry its moments over (docs/protocol.md, "Carried
        moments"), and a validator's replay from a snapshot of fresh moments."""
        self.resident()
        from collections import defaultdict

        self.optimizer.state = defaultdict(dict)
        self.zero_grad()

    def set_schedule_position(self, step: int) -> None:
        """Put the learning-rate schedule at ``step`` (the next ``step()`` uses its rate)."""
        sched = self.scheduler
        sched.last_epoch = int(step)
        for group, base, fn in zip(self.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas):
            group["lr"] = base * fn(sched.last_epoch)

    def load_moments(self, moments: Sequence[Sequence[torch.Tensor]] | None, opt_step: float, *,
                     copy: bool = True) -> None:
        """Give the optimizer these moments, per parameter in order (None: fresh, no state);
        ``copy=False``: float32 moments become the optimizer's own (the caller gives them up).

        AdamW takes ``(exp_avg, exp_avg_sq)`` per parameter; SGD (DiLoCo's outer optimizer)
        takes its momentum buffer from the first. Goes through ``optimizer.load_state_dict``
        rather than writing ``optimizer.state`` by hand, so torch puts every state tensor where
        this optimizer expects it: fused AdamW (the default on CUDA) needs ``step`` on the
        parameters' device.
        """
        self.resident()
        optimizer = self.optimizer
        index = {id(p): i for i, p in enumerate(q for group in optimizer.param_groups for q in group["params"])}
        state: dict[int, dict[str, torch.Tensor]] = {}
        sgd = isinstance(optimizer, torch.optim.SGD)

        def own(t: torch.Tensor) -> torch.Tensor:
            t = t.to(torch.float32)
            return t.clone() if copy else t

        for p, block in zip(self.params, moments or ()):
            if sgd:
                state[index[id(p)]] = {"momentum_buffer": own(block[0])}
            else:
                state[index[id(p)]] = {"step": torch.tensor(float(opt_step), dtype=torch.float32),
                                       "exp_avg": own(block[0]), "exp_avg_sq": own(block[1])}
        current = optimizer.state_dict()
        optimizer.load_state_dict({"state": state, "param_groups": current["param_groups"]})

    @torch.no_grad()
    def copy_parameters_from(self, params: Sequence[torch.Tensor]) -> None:
        """Overwrite this replica's parameters (same order and shapes) with ``params``."""
        self.resident()
        for p, src in zip(self.params, params, strict=True):
            p.copy_(src.to(p.device, p.dtype))

    # ------------------------------------------------------------- offloading
    def offload(self, directory: str, *, parameters: bool) -> int:
        """Move the optimizer state (with ``parameters``, the parameters too) to disk under
        ``directory`` until a method here needs them (each calls :meth:`resident` first); returns
        the bytes moved, 0 when already out. dtrain.training.offload says why and when."""
        from dtrain.training.offload import Offload

        if self._offloaded is not None:
            return 0
        moments = [t for state in self.optimizer.state.values() for t in state.values()
                   if isinstance(t, torch.Tensor) and t.dim() > 0]  # not AdamW's step counters
        try:
            self._offloaded = Offload(directory, (list(self.params) if parameters else []) + moments)
        except OSError as exc:  # a full disk: the state stays in memory, as it was
            log.warning("training state kept in memory, not offloaded to %s: %r", directory, exc)
            return 0
        trim_heap()  # tensors of a few MiB were freed to the heap: give their pages back
        return self._offloaded.nbytes

    def resident(self) -> None:
        """Bring back what :meth:`offload` moved out (nothing to do when nothing is out)."""
        offloaded, self._offloaded = self._offloaded, None
        if offloaded is not None:
            offloaded.restore()

    # ------------------------------------------------------------- gradient access
    def gradients(self) -> list[torch.Tensor]:
        """The live ``.grad`` tensors in stable parameter order (zeros where none yet).

        They hold the sample-summed gradient of ``accumulated_samples`` samples.
        """
        self.resident()
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return [p.grad for p in self.params]

    def set_gradients(self, grads: Sequence[torch.Tensor], *, num_samples: int, adopt: bool = False) -> None:
        """Replace the accumulated gradients (e.g. by the swarm's average).

        ``grads`` follow the same convention: summed over ``num_samples`` samples;
        pass an already-averaged gradient with ``num_samples=1``. With ``adopt``, ``g`` itself
        becomes the gradient when it fits (same device and dtype), instead of a copy into the one
        held (which is dropped): the caller gives ``g`` up, and :meth:`step` scales it in place.
        """
        self.resident()
        if len(grads) != len(self.params):
            raise ValueError(f"expected {len(self.params)} gradient tensors, got {len(grads)}")
        if num_samples < 1:
            raise ValueError("num_samples must be >= 1")
        for p, g in zip(self.params, grads):
            if g.shape != p.shape:
                raise ValueError(f"gradient shape {tuple(g.shape)} does not match parameter {tuple(p.shape)}")
            if adopt and g.device == p.device and g.dtype == p.dtype and g.is_contiguous():
                p.grad = g.detach()
                continue
            if p.grad is None:
                p.grad = torch.empty_like(p)
            p.grad.copy_(g)
        self._acc_samples = num_samples

    def zero_grad(self) -> None:
        """Drop the accumulation (gradients set to None; counters kept)."""
        self.optimizer.zero_grad(set_to_none=True)
        self._acc_samples = 0
        self._acc_tokens = 0
        self._acc_loss_sum = 0.0
        self._acc_microbatches = 0
        self._t_start = None

    # ------------------------------------------------------------------------ step
    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def step(self) -> StepMetrics:
        """Average the accumulated gradients per sample, clip, apply optimizer and schedule."""
        self.resident()
        if self._acc_samples <= 0:
            raise TrainerStateError("step() called with no accumulated samples; call accumulate() or set_gradients() first")
        grads = [p.grad for p in self.params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, 1.0 / self._acc_samples)
        max_norm = self.config.grad_clip if self.config.grad_clip is not None else math.inf
        norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm, foreach=True)
        lr = self.lr
        self.optimizer.step()
        self.scheduler.step()
        self.counters.inner_step += 1
        elapsed = time.perf_counter() - self._t_start if self._t_start is not None else 0.0
        loss = self._acc_loss_sum / self._acc_microbatches if self._acc_microbatches else float("nan")
        metrics = StepMetrics(
            loss=loss,
            grad_norm=float(norm),
            lr=lr,
            tokens_per_s=self._acc_tokens / elapsed if elapsed > 0 else 0.0,
            samples=self.counters.samples,
            inner_step=self.counters.inner_step,
            epoch=self.counters.epoch,
            tokens=self.counters.tokens,
        )
        self.zero_grad()
        if self.on_metrics is not None:
            self.on_metrics(metrics)
        return metrics

    def train_step(self, input_ids: torch.Tensor) -> StepMetrics:
        """accumulate(input_ids) then step(): one local optimizer step."""
        self.accumulate(input_ids)
        return self.step()

    # ------------------------------------------------------------ flat parameters
    def flat_parameters(self) -> torch.Tensor:
        """A detached 1-D copy of all trainable parameters (stable order)."""
        self.resident()
        return torch.cat([p.detach().reshape(-1) for p in self.params])

    @torch.no_grad()
    def set_flat_parameters(self, flat: torch.Tensor) -> None:
        self.resident()
        total = sum(p.numel() for p in self.params)
        if flat.dim() != 1 or flat.numel() != total:
            raise ValueError(f"flat parameters must be 1-D with {total} elements, got {tuple(flat.shape)}")
        offset = 0
        for p in self.params:
            n = p.numel()
            p.copy_(flat[offset : offset + n].view_as(p))
            offset += n

    # ----------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        self.resident()
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "counters": asdict(self.counters),
            "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self.config).items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.resident()
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.counters = Counters(**state["counters"])
        self.zero_grad()


def recompute_fingerprints(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    *,
    nonce: str | bytes | int,
    micro_batch_size: int,
    precision: str = "fp32",
    k: int = DEFAULT_K,
    device: str | torch.device | None = None,
) -> list[Fingerprint]:
    """The validator's side: per-micro-batch (loss, fingerprint) of ``input_ids``.

    Uses the same micro-batch split and computation as ``Trainer.accumulate``; never
    changes the model's parameters or its ``.grad`` (gradients come from autograd.grad).
    """
    dev = torch.device(device) if device is not None else next(model.parameters()).device
    params = trainable_parameters(model)
    was_training = model.training
    model.train()  # same mode as the miner (dropout is off in every preset)
    nonce_str = nonce.hex() if isinstance(nonce, bytes) else str(nonce)
    out = []
    try:
        x_all = input_ids.to(dev)
        for start in range(0, x_all.shape[0], micro_batch_size):
            x = x_all[start : start + micro_batch_size]
            loss, grads = microbatch_gradients(model, params, x, precision)
            sketch = gradient_sketch(grads, nonce, k=k)
            out.append(Fingerprint(loss=float(loss), sketch=tuple(sketch.tolist()), samples=x.shape[0], nonce=nonce_str))
            del grads
    finally:
        model.train(was_training)
    return out
