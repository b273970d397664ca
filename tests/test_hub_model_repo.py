"""A pushed checkpoint is a complete Hugging Face model repo (dtrain.neurons.publish).

Real transformers, real tokenizers, real files: each repo written here is loaded back with
the Auto classes and pipeline("text-generation") from the folder alone.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import warnings
from pathlib import Path

import pytest

from dtrain.config import Config
from dtrain.hub.model_card import CardFacts
from dtrain.neurons.publish import card_facts, export_checkpoint, export_for_push, write_model_repo
from dtrain.training.checkpoint import (
    PUBLISH, load_checkpoint, read_publish_info, save_checkpoint, save_publish_info,
)

SENTENCE = "The quick brown fox jumps over the lazy dog."


def _config() -> Config:
    cfg = Config()
    cfg.model.preset, cfg.model.seq_len, cfg.model.run_id = "tiny", 64, "run1"
    cfg.data.source, cfg.data.tokenizer = "local", "shipped"
    cfg.training.device, cfg.training.micro_batch_size, cfg.training.local_batch_size = "cpu", 4, 4
    return cfg


@pytest.fixture(scope="module")
def shipped_tokenizer():
    from dtrain.training.tokenizer import load_fallback_tokenizer

    return load_fallback_tokenizer()


@pytest.fixture(scope="module")
def gpt2_style_tokenizer(tmp_path_factory):
    """A regular GPT2Tokenizer (what AutoTokenizer gives for distilgpt2), built offline from
    the shipped BPE's vocabulary and merges: no pad token, "unlimited" model_max_length."""
    from transformers import GPT2Tokenizer

    from dtrain.training.assets import FALLBACK_TOKENIZER

    bpe = json.loads(FALLBACK_TOKENIZER.read_text(encoding="utf-8"))["model"]
    d = tmp_path_factory.mktemp("gpt2tok")
    (d / "vocab.json").write_text(json.dumps(bpe["vocab"]), encoding="utf-8")
    merges = [" ".join(m) if isinstance(m, list) else m for m in bpe["merges"]]
    (d / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    eos = "<|endoftext|>"
    tok = GPT2Tokenizer(str(d / "vocab.json"), str(d / "merges.txt"), unk_token=eos, bos_token=eos, eos_token=eos)
    assert tok.pad_token is None
    return tok


def _model(tokenizer, n_positions=64):
    from dtrain.training.models import create_model

    return create_model("tiny", vocab_size=len(tokenizer), n_positions=n_positions,
                        eos_token_id=tokenizer.eos_token_id, seed=1)


def _facts(tag="run1.3.7", **kw) -> CardFacts:
    return CardFacts(tag=tag, run_id="run1", epoch=3, inner_step=7, local_path="/store/tags/" + tag, **kw)


def _load_and_generate(folder: Path, expected_class: str | None = None):
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    assert len(tok) > 1000, "empty vocabulary: the tokenizer files are missing"
    if expected_class:
        assert type(tok).__name__ == expected_class
    assert tok.decode(tok(SENTENCE)["input_ids"]) == SENTENCE
    assert tok.model_max_length == 64 and tok.pad_token == tok.eos_token == "<|endoftext|>"
    model = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True)
    assert model.generation_config.eos_token_id == tok.eos_token_id
    assert model.generation_config.pad_token_id == tok.pad_token_id
    with generation_complaints() as complaints:
        gen = pipeline("text-generation", model=str(folder), tokenizer=str(folder))
        out = gen("The history of", max_new_tokens=4, do_sample=False)
    assert complaints == []  # generation did not have to guess a pad id or a length
    assert out[0]["generated_text"].startswith("The history of")
    return tok, model


@contextlib.contextmanager
def generation_complaints():
    """Warnings (either channel: the warnings module or transformers' loggers) about pad or
    end-of-text ids or lengths, which a complete repo's configs must make unnecessary."""
    words = ("pad", "eos", "max_length", "maximum length", "attention mask")
    found: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            found.append(record.getMessage())

    handler = Collect(logging.WARNING)
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            complaints: list[str] = []
            yield complaints
        found += [str(w.message) for w in caught]
    finally:
        logger.removeHandler(handler)
    complaints += [m for m in found if any(w in m.lower() for w in words)]


@pytest.mark.parametrize("which", ["shipped", "gpt2_style"])
def test_written_repo_loads_with_auto_classes_and_pipeline(which, shipped_tokenizer, gpt2_style_tokenizer, tmp_path):
    tokenizer = shipped_tokenizer if which == "shipped" else gpt2_style_tokenizer
    before = (tokenizer.model_max_length, tokenizer.pad_token)
    model = _model(tokenizer)
    dest = write_model_repo(tmp_path / "repo", model, tokenizer, _facts())
    names = set(os.listdir(dest))
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", "README.md"} <= names
    _load_and_generate(dest, "GPT2Tokenizer" if which == "gpt2_style" else None)
    # the live tokenizer the miner keeps training with is left as it was
    assert (tokenizer.model_max_length, tokenizer.pad_token) == before
    tok_cfg = json.loads((dest / "tokenizer_config.json").read_text())
    assert tok_cfg["tokenizer_class"] != "TokenizersBackend"  # transformers 4 could not resolve it


def test_a_short_context_caps_the_default_generation_length(shipped_tokenizer, tmp_path):
    dest = write_model_repo(tmp_path / "repo", _model(shipped_tokenizer, n_positions=16), shipped_tokenizer, _facts())
    assert json.loads((dest / "generation_config.json").read_text())["max_length"] == 16


def test_export_folders_are_per_tag_complete_and_pruned(shipped_tokenizer, tmp_path):
    model = _model(shipped_tokenizer)
    root = tmp_path / "export"
    (root / ".tmp-run1.0.1-999").mkdir(parents=True)  # a killed writer's leftovers
    (root / "notes").mkdir()  # not ours
    paths = [export_for_push(root, f"run1.{e}.{e}", model, shipped_tokenizer, _facts(f"run1.{e}.{e}"))
             for e in (1, 2, 3, 10)]
    assert [p.name for p in paths] == ["run1.1.1", "run1.2.2", "run1.3.3", "run1.10.10"]
    # the newest EXPORTS_KEPT (3) stay, ordered by tag, not by name
    assert sorted(p.name for p in root.iterdir()) == ["notes", "run1.10.10", "run1.2.2", "run1.3.3"]
    assert "run1.10.10" in (root / "run1.10.10" / "README.md").read_text()
    # a tag's folder is never rewritten (the pusher may be copying it)
    mtime = (root / "run1.10.10" / "model.safetensors").stat().st_mtime_ns
    export_for_push(root, "run1.10.10", model, shipped_tokenizer, _facts("run1.10.10"))
    assert (root / "run1.10.10" / "model.safetensors").stat().st_mtime_ns == mtime


# ---------------------------------------------------------------------------- publishing info with checkpoints


@pytest.fixture(scope="module")
def bench():  # read-only in the tests below
    from dtrain.neurons.runtime import build_workbench

    b = build_workbench(_config())
    b.trainer.train_step(b.reader.read_pages([0]))
    return b


def _save(bench, directory, epoch):
    from dtrain.training.loop import LoopState, training_state

    return save_checkpoint(directory, training_state(bench.trainer, LoopState(run_id="run1", uid=1, epoch=epoch)))


def test_publish_info_belongs_to_one_checkpoint(bench, tmp_path):
    d = tmp_path / "ckpt"
    _save(bench, d, 1)
    assert read_publish_info(d) is None
    save_publish_info(d, tokenizer=bench.reader.tokenizer, facts={"last_round": {"epoch": 1, "contributors": 3}})
    tok_dir, facts = read_publish_info(d)
    assert tok_dir.name.startswith("tokenizer-") and (tok_dir / "tokenizer.json").is_file()
    assert facts["last_round"]["contributors"] == 3
    # the same tokenizer again: the same folder, nothing piles up
    save_publish_info(d, tokenizer=bench.reader.tokenizer, facts={})
    assert read_publish_info(d)[0] == tok_dir
    assert len([p for p in d.iterdir() if p.name.startswith("tokenizer-")]) == 1
    # a newer checkpoint without its publishing info (killed in between): the old info is
    # not passed off as the new checkpoint's
    _save(bench, d, 2)
    assert read_publish_info(d) is None


def test_a_failed_publish_save_leaves_checkpoint_and_info_intact(bench, tmp_path):
    d = tmp_path / "ckpt"
    _save(bench, d, 1)
    save_publish_info(d, tokenizer=bench.reader.tokenizer, facts={"n": 1})
    before = (d / PUBLISH).read_bytes()

    class Dying:
        def save_pretrained(self, path):
            Path(path).mkdir(parents=True, exist_ok=True)  # as save_pretrained does
            Path(path, "tokenizer.json").write_text("{half")
            raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        save_publish_info(d, tokenizer=Dying(), facts={"n": 2})
    assert (d / PUBLISH).read_bytes() == before
    assert not [p for p in d.iterdir() if ".tmp-" in p.name]
    assert read_publish_info(d)[1] == {"n": 1}
    assert load_checkpoint(d)["epoch"] == 1


def test_push_export_uses_the_checkpoints_tokenizer_and_facts_offline(bench, tmp_path, monkeypatch):
    d = tmp_path / "ckpt"
    _save(bench, d, 4)
    round_info = {"epoch": 4, "round_id": "feed", "contributors": 2, "round_tokens": 512, "loss": 6.5}
    save_publish_info(d, tokenizer=bench.reader.tokenizer,
                      facts={"tokenizer": bench.tokenizer_info.name, "last_round": round_info})
    cfg = _config()
    # A tokenizer that cannot be loaded here: only the copy saved with the checkpoint can serve.
    cfg.data.tokenizer, cfg.data.allow_tokenizer_fallback = str(tmp_path / "no-such-tokenizer"), False
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    dest = tmp_path / "repo"
    tag = export_checkpoint(cfg, d, dest, target=str(tmp_path / "store"))
    assert tag == f"run1.4.{bench.trainer.counters.inner_step}"
    _load_and_generate(dest)
    from huggingface_hub import ModelCard

    meta = ModelCard((dest / "README.md").read_text()).data.to_dict()["dtrain"]
    assert (meta["tag"], meta["epoch"], meta["contributors"], meta["round_id"]) == (tag, 4, 2, "feed")
    assert meta["last_loss"] == pytest.approx(6.5) and meta["tokens_seen"] == bench.trainer.counters.tokens > 0
    assert meta["tokenizer"] == bench.tokenizer_info.name
    assert meta["parameters"] == bench.param_count


def test_push_export_without_round_info_says_unknown(bench, tmp_path):
    d = tmp_path / "ckpt"
    _save(bench, d, 4)
    dest = tmp_path / "repo"
    export_checkpoint(_config(), d, dest, target="hf://alice/sn38")
    _load_and_generate(dest)
    text = (dest / "README.md").read_text()
    assert "| Contributing miners in the last round | unknown |" in text
    assert "| Last training loss (pushing miner, before this step) | unknown |" in text
    assert 'repo, revision = "alice/sn38", "run1.4.' in text


def test_round_facts_count_only_for_the_epoch_they_produced(bench):
    cfg = _config()
    kw = dict(target="/store", run_id="run1", inner_step=5, tokens_seen=10, model=bench.model, param_count=1,
              tokenizer_name="t", last_round={"epoch": 5, "contributors": 3, "loss": 2.0, "round_id": "r"})
    assert card_facts(cfg, tag="run1.5.5", epoch=5, **kw).contributors == 3
    stale = card_facts(cfg, tag="run1.6.5", epoch=6, **kw)  # e.g. after a catch-up
    assert stale.contributors is None and stale.last_loss is None and stale.round_id is None


def test_card_names_the_configured_hub_dataset_and_revisions(bench):
    from huggingface_hub import ModelCard

    from dtrain.hub.model_card import render_model_card

    cfg = _config()
    cfg.data.source, cfg.data.dataset, cfg.data.dataset_config = "fineweb", "HuggingFaceFW/fineweb", "sample-10BT"
    cfg.data.dataset_revision = "v1.2.0"
    cfg.model.hub_id, cfg.model.revision = "/models/my-start", "main"
    f = card_facts(cfg, target="hf://alice/sn38", tag="run1.1.1", run_id="run1", epoch=1, inner_step=1,
                   tokens_seen=1, model=bench.model, param_count=1, tokenizer_name="distilgpt2")
    card = ModelCard(render_model_card(f))
    assert card.data.to_dict()["datasets"] == ["HuggingFaceFW/fineweb"]
    assert "config `sample-10BT`, revision `v1.2.0`" in card.text
    assert "initial weights from /models/my-start (revision main)" in card.text
    cfg.data.source, cfg.data.local_path = "local", "/home/op/secret-notes.txt"
    f = card_facts(cfg, target="/store", tag="run1.1.1", run_id="run1", epoch=1, inner_step=1,
                   tokens_seen=1, model=bench.model, param_count=1, tokenizer_name="t")
    assert f.dataset is None and "secret" not in render_model_card(f)  # the card is public
