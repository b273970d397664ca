"""What a checkpoint holds of a training loop, and a resumable offline loop.

``training_state`` / ``restore_training_state`` / ``resume_or_start`` are what the miner and
the validator checkpoint and resume with. ``run_local_training`` trains on a miner's assigned
pages with no swarm (benchmarks and tests); it saves its page counter with every checkpoint, so
a resume is exact. How a neuron's resume differs: docs/training.md ("Checkpoints").
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import torch

from dtrain.training.checkpoint import load_checkpoint, read_manifest, save_checkpoint
from dtrain.training.data import MAX_UIDS, PageReader, assign_pages
from dtrain.training.errors import CheckpointError
from dtrain.training.models import model_fingerprint
from dtrain.training.trainer import StepMetrics, Trainer


@dataclass
class LoopState:
    run_id: str
    uid: int
    epoch: int = 0
    page_counter: int = 0  # the next page counter to train (dtrain.training.data.assign_pages)
    max_uids: int = MAX_UIDS


def training_state(trainer: Trainer, loop: LoopState) -> dict[str, Any]:
    """Everything a checkpoint holds."""
    state = trainer.state_dict()
    state.update(
        run_id=loop.run_id,
        uid=loop.uid,
        epoch=loop.epoch,
        page_counter=loop.page_counter,
        max_uids=loop.max_uids,
        model_fingerprint=model_fingerprint(trainer.model),
        rng={"torch": torch.get_rng_state()},
    )
    if torch.cuda.is_available():
        state["rng"]["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_training_state(trainer: Trainer, state: dict[str, Any], *, run_id: str | None = None) -> LoopState:
    """Load a checkpoint state into ``trainer``; check model and run; return the loop state."""
    fp = model_fingerprint(trainer.model)
    if state.get("model_fingerprint") != fp:
        raise CheckpointError(
            f"checkpoint is for another model (fingerprint {str(state.get('model_fingerprint'))[:12]}, "
            f"this model {fp[:12]}); use the matching model preset or a different checkpoint directory"
        )
    if run_id is not None and state.get("run_id") != run_id:
        raise CheckpointError(
            f"checkpoint belongs to run {state.get('run_id')!r}, not {run_id!r}; use another checkpoint directory"
        )
    trainer.load_state_dict(state)
    rng = state.get("rng") or {}
    if "torch" in rng:
        torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    trainer.counters.epoch = int(state["epoch"])
    # Checkpoints of the first release named the page counter "data_cursor"; they still load.
    page_counter = state["page_counter"] if "page_counter" in state else state["data_cursor"]
    return LoopState(run_id=state["run_id"], uid=int(state["uid"]), epoch=int(state["epoch"]),
                     page_counter=int(page_counter), max_uids=int(state.get("max_uids", MAX_UIDS)))


def resume_or_start(trainer: Trainer, checkpoint_dir: str | os.PathLike | None, fresh: LoopState) -> LoopState:
    """Resume from ``checkpoint_dir`` when it holds a checkpoint, else return ``fresh``."""
    if checkpoint_dir is None or read_manifest(checkpoint_dir) is None:
        return fresh
    return restore_training_state(trainer, load_checkpoint(checkpoint_dir), run_id=fresh.run_id)


def run_local_training(
    trainer: Trainer,
    reader: PageReader,
    loop: LoopState,
    *,
    steps: int,
    pages_per_step: int,
    checkpoint_dir: str | os.PathLike | None = None,
    checkpoint_every: int = 0,
    on_step: Callable[[StepMetrics, LoopState], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    checkpoint_on_write: Callable[[int], None] | None = None,
) -> LoopState:
    """Train ``steps`` local optimizer steps on the miner's assigned pages.

    Saves a checkpoint every ``checkpoint_every`` inner steps (0: never);
    ``checkpoint_on_write(bytes)`` reports checkpoint write progress.
    """
    num_pages = reader.num_pages
    for _ in range(steps):
        if should_stop is not None and should_stop():
            break
        pages = assign_pages(run_id=loop.run_id, uid=loop.uid, epoch=loop.epoch, page_counter=loop.page_counter,
                             num_pages=num_pages, count=pages_per_step, max_uids=loop.max_uids)
        metrics = trainer.train_step(reader.read_pages(pages))
        loop.page_counter += pages_per_step
        if on_step is not None:
            on_step(metrics, loop)
        if checkpoint_dir is not None and checkpoint_every and trainer.counters.inner_step % checkpoint_every == 0:
            save_checkpoint(checkpoint_dir, training_state(trainer, loop), on_write=checkpoint_on_write)
    return loop
