"""Checkpoints: atomic under SIGKILL mid-write, clear errors when corrupt, bit-exact resume."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dtrain.training.checkpoint import load_checkpoint, read_manifest, save_checkpoint
from dtrain.training.errors import CheckpointError

HERE = Path(__file__).resolve()
PAGES_PER_STEP = 2


def _build(seed: int = 0):
    from dtrain.training.data import DataSource, PageReader, PageSpec
    from dtrain.training.models import create_model
    from dtrain.training.tokenizer import load_tokenizer
    from dtrain.training.trainer import Trainer, TrainerConfig

    tok, _ = load_tokenizer(allow_fallback=True, local_files_only=True)
    reader = PageReader(DataSource.shipped(), tok, PageSpec(seq_len=64, page_sequences=4, docs_per_page=8))
    model = create_model("tiny", vocab_size=len(tok), n_positions=64, seed=seed)
    trainer = Trainer(model, TrainerConfig(micro_batch_size=4, lr=3e-3, warmup_steps=2, total_steps=20))
    return reader, trainer


def worker(ckpt_dir: str, steps: int, kill_at_step: int) -> None:
    """Train with a checkpoint every step, printing one JSON line per step.

    With kill_at_step, the process SIGKILLs itself halfway through writing that
    step's checkpoint (after the first 100 kB of the payload).
    """
    from dtrain.training.loop import LoopState, resume_or_start, run_local_training

    torch.set_num_threads(1)
    reader, trainer = _build()
    loop = resume_or_start(trainer, ckpt_dir, LoopState(run_id="ck-run", uid=2, max_uids=4))

    def on_write(nbytes: int) -> None:
        if kill_at_step and trainer.counters.inner_step == kill_at_step and nbytes > 100_000:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_step(m, lp) -> None:
        print(json.dumps({"step": m.inner_step, "loss": m.loss, "page_counter": lp.page_counter}), flush=True)

    run_local_training(trainer, reader, loop, steps=steps, pages_per_step=PAGES_PER_STEP,
                       checkpoint_dir=ckpt_dir, checkpoint_every=1, on_step=on_step,
                       checkpoint_on_write=on_write)
    digest = hashlib.sha256(trainer.flat_parameters().numpy().tobytes()).hexdigest()
    print(json.dumps({"params": digest}), flush=True)


def _run(ckpt_dir: Path, steps: int, kill_at_step: int = 0):
    out = subprocess.run([sys.executable, str(HERE), str(ckpt_dir), str(steps), str(kill_at_step)],
                         capture_output=True, text=True, timeout=300)
    lines = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    return out.returncode, [x for x in lines if "step" in x], next((x["params"] for x in lines if "params" in x), None), out.stderr


def test_sigkill_mid_write_then_bit_exact_resume(tmp_path):
    ref_dir, crash_dir = tmp_path / "ref", tmp_path / "crash"
    rc, ref_steps, ref_params, err = _run(ref_dir, 6)
    assert rc == 0, err
    assert [s["step"] for s in ref_steps] == [1, 2, 3, 4, 5, 6]

    rc, crashed_steps, params, err = _run(crash_dir, 6, kill_at_step=4)
    assert rc == -signal.SIGKILL and params is None
    assert [s["loss"] for s in crashed_steps] == [s["loss"] for s in ref_steps[:4]]
    # the partial payload is on disk, but LATEST still names checkpoint 3, which loads
    assert any(".tmp-" in p.name for p in crash_dir.iterdir())
    assert read_manifest(crash_dir)["seq"] == 3
    state = load_checkpoint(crash_dir)
    assert state["counters"]["inner_step"] == 3 and state["page_counter"] == 3 * PAGES_PER_STEP
    assert state["run_id"] == "ck-run"

    rc, resumed_steps, resumed_params, err = _run(crash_dir, 3)
    assert rc == 0, err
    # same next batch, same optimizer state: bit-identical losses and final weights
    assert resumed_steps == ref_steps[3:]
    assert resumed_params == ref_params
    names = sorted(p.name for p in crash_dir.iterdir())
    assert names == ["LATEST", "ckpt-00000005.pt", "ckpt-00000006.pt"]


def test_interrupted_save_keeps_the_last_good_checkpoint(tmp_path):
    save_checkpoint(tmp_path, {"value": torch.arange(10)})

    class Injected(Exception):
        pass

    def boom(nbytes: int) -> None:
        if nbytes > 64:
            raise Injected

    # torch.save's zip writer may replace our exception with its own RuntimeError on exit
    with pytest.raises((Injected, RuntimeError)):
        save_checkpoint(tmp_path, {"value": torch.zeros(100_000)}, on_write=boom)
    assert torch.equal(load_checkpoint(tmp_path)["value"], torch.arange(10))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", "ckpt-00000001.pt"]


def test_corrupt_checkpoint_names_the_file_and_the_remedy(tmp_path):
    save_checkpoint(tmp_path, {"value": torch.arange(10)})
    latest = save_checkpoint(tmp_path, {"value": torch.arange(20)})
    data = bytearray(latest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    latest.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"ckpt-00000002\.pt is corrupt \(SHA-256 mismatch\).*previous"):
        load_checkpoint(tmp_path)
    # no silent fallback, but the previous checkpoint is there on request
    assert torch.equal(load_checkpoint(tmp_path, which="previous")["value"], torch.arange(10))
    latest.write_bytes(bytes(data[:100]))
    with pytest.raises(CheckpointError, match="corrupt.*size"):
        load_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="cannot be read"):
        load_checkpoint(latest)  # a bare file: no manifest, torch.load fails
    (tmp_path / "LATEST").write_text("{not json")
    with pytest.raises(CheckpointError, match="LATEST is unreadable"):
        load_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        load_checkpoint(tmp_path / "empty")


def test_checkpoint_for_another_model_or_run_is_refused(tmp_path):
    from dtrain.training.loop import LoopState, restore_training_state, training_state

    _, trainer = _build()
    save_checkpoint(tmp_path, training_state(trainer, LoopState(run_id="a", uid=0)))
    with pytest.raises(CheckpointError, match="belongs to run 'a'"):
        restore_training_state(trainer, load_checkpoint(tmp_path), run_id="b")
    from dtrain.training.models import create_model
    from dtrain.training.trainer import Trainer, TrainerConfig

    other = Trainer(create_model("tiny", vocab_size=300, n_positions=64), TrainerConfig())
    with pytest.raises(CheckpointError, match="another model"):
        restore_training_state(other, load_checkpoint(tmp_path))


if __name__ == "__main__":
    worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
