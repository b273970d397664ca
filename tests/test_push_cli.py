"""`dtrain push` end to end: a real checkpoint, the real huggingface_hub client, a loopback Hub."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_dtrain
from tests.test_hub_hf import FakeHub


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from dtrain.neurons.runtime import build_workbench
    from dtrain.training.checkpoint import save_checkpoint
    from dtrain.training.loop import LoopState, training_state

    cfg = _config(tmp_path_factory.mktemp("cfg"))
    bench = build_workbench(cfg)
    bench.trainer.train_step(bench.reader.read_pages([0, 1]))
    directory = tmp_path_factory.mktemp("ckpt")
    save_checkpoint(directory, training_state(bench.trainer, LoopState(run_id="run1", uid=3, epoch=4)))
    return directory


def _config(root):
    from dtrain.config import Config

    cfg = Config()
    cfg.model.preset, cfg.model.seq_len, cfg.model.run_id = "tiny", 128, "run1"
    cfg.data.source, cfg.data.tokenizer = "local", "shipped"
    cfg.training.device, cfg.training.micro_batch_size, cfg.training.local_batch_size = "cpu", 8, 16
    return cfg


def _write_config(path):
    from dtrain.config import save_config

    cfg = _config(path.parent)
    cfg.hub.repo, cfg.hub.push_retries, cfg.hub.backoff_s = "hf://alice/sn38", 4, 0.05
    save_config(cfg, path)
    return path


def test_push_to_loopback_hub_survives_failures(checkpoint, tmp_path):
    with FakeHub(token="good-token") as hub:
        hub.faults["create"] = ["503"]
        hub.faults["tag"] = ["500"]
        config = _write_config(tmp_path / "c.toml")
        env = {"HF_ENDPOINT": hub.url, "HF_TOKEN": "good-token", "HF_HOME": str(tmp_path / "hf"),
               "HF_HUB_OFFLINE": "0"}
        result = run_dtrain("push", "--config", str(config), "--checkpoint", str(checkpoint), "--json", env=env)
        assert result.returncode == 0, result.stderr[-2000:]
        doc = json.loads(result.stdout)
        assert doc["tag"] == "run1.4.1"
        assert doc["attempts"] >= 6  # the injected failures were retried, not fatal
        repo = hub.repos["alice/sn38"]
        assert "run1.4.1" in repo["tags"]
        assert "config.json" in repo["files"] and any(f.endswith(".safetensors") for f in repo["files"])
        # a complete Hugging Face repo: the tokenizer (rebuilt from the config: this checkpoint
        # has no publishing info) and a card that says what it does not know
        assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json", "README.md"} <= set(repo["files"])
        from huggingface_hub import ModelCard

        card = ModelCard(repo["files"]["README.md"].decode())
        assert card.data.to_dict()["dtrain"]["tag"] == "run1.4.1"
        assert card.data.to_dict()["dtrain"]["contributors"] is None
        assert "| Contributing miners in the last round | unknown |" in card.text
        assert 'repo, revision = "alice/sn38", "run1.4.1"' in card.text


def test_push_with_a_bad_token_fails_clearly(checkpoint, tmp_path):
    with FakeHub(token="good-token") as hub:
        config = _write_config(tmp_path / "c.toml")
        env = {"HF_ENDPOINT": hub.url, "HF_TOKEN": "wrong", "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "0"}
        result = run_dtrain("push", "--config", str(config), "--checkpoint", str(checkpoint), env=env)
        assert result.returncode == 1
        assert "HF_TOKEN" in result.stderr and "Traceback" not in result.stderr
        assert hub.calls["create"] == 1  # an auth failure is not retried


def test_push_without_a_store_names_the_setting(checkpoint, tmp_path):
    result = run_dtrain("push", "--checkpoint", str(checkpoint), env={"HOME": str(tmp_path)})
    assert result.returncode == 1 and "hub.repo" in result.stderr


def test_push_of_a_missing_checkpoint_says_what_to_do(tmp_path):
    result = run_dtrain("push", "--repo", str(tmp_path / "store"), "--data-dir", str(tmp_path / "empty"),
                        env={"HOME": str(tmp_path)})
    assert result.returncode == 1 and "dtrain mine" in result.stderr
