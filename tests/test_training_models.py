"""Presets, parameter counts, model fingerprint, Hub/tokenizer errors, shipped assets."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dtrain.training.errors import ModelLoadError, TokenizerLoadError
from dtrain.training.models import (
    PRESETS,
    count_parameters,
    create_model,
    get_preset,
    model_fingerprint,
    preset_parameter_count,
)

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "name,low,high",
    [("tiny", 1e6, 10e6), ("gpt2-124m", 120e6, 130e6), ("gpt2-250m", 230e6, 270e6),
     ("gpt2-500m", 450e6, 550e6), ("gpt2-1b", 0.95e9, 1.1e9)],
)
def test_preset_sizes(name, low, high):
    assert low <= preset_parameter_count(name) <= high


def test_tiny_model_counts_and_has_no_dropout():
    m = create_model("tiny", vocab_size=1000)
    # tied embeddings are counted once
    assert count_parameters(m) == sum(p.numel() for p in m.parameters())
    assert count_parameters(m) == preset_parameter_count("tiny", vocab_size=1000)
    assert m.config.resid_pdrop == m.config.embd_pdrop == m.config.attn_pdrop == 0.0


def test_unknown_preset_lists_the_choices():
    with pytest.raises(ModelLoadError, match="unknown model preset 'gpt5'.*tiny"):
        get_preset("gpt5")
    assert set(PRESETS) == {"tiny", "gpt2-124m", "gpt2-250m", "gpt2-500m", "gpt2-1b"}


def test_fingerprint_tracks_architecture_not_weights():
    a = create_model("tiny", vocab_size=1000, seed=1)
    b = create_model("tiny", vocab_size=1000, seed=2)
    assert not next(a.parameters()).equal(next(b.parameters()))
    assert model_fingerprint(a) == model_fingerprint(b)
    assert model_fingerprint(a) != model_fingerprint(create_model("tiny", vocab_size=1001))
    assert model_fingerprint(a) != model_fingerprint(create_model("tiny", vocab_size=1000, n_positions=64))
    assert model_fingerprint(a) != model_fingerprint(a.to(dtype=__import__("torch").bfloat16))


def test_same_seed_gives_identical_initial_weights():
    a, b = create_model("tiny", vocab_size=500, seed=7), create_model("tiny", vocab_size=500, seed=7)
    assert all(x.equal(y) for x, y in zip(a.parameters(), b.parameters()))


def test_unreachable_hub_model_names_the_id():
    from dtrain.training.models import load_pretrained_model

    with pytest.raises(ModelLoadError, match="could not load the model 'distributed/gpt2-250m'.*hf download"):
        load_pretrained_model("distributed/gpt2-250m", local_files_only=True)


def test_pretrained_directory_loads_through_the_same_path(tmp_path):
    from dtrain.training.models import load_pretrained_model

    m = create_model("tiny", vocab_size=300)
    m.save_pretrained(tmp_path / "m")
    loaded = load_pretrained_model(str(tmp_path / "m"), local_files_only=True)
    assert model_fingerprint(loaded) == model_fingerprint(m)
    assert all(x.equal(y) for x, y in zip(loaded.parameters(), m.parameters()))


def test_tokenizer_fallback_only_when_allowed():
    from dtrain.training.tokenizer import load_tokenizer

    with pytest.raises(TokenizerLoadError, match="could not load the tokenizer 'distilgpt2'.*hf download distilgpt2"):
        load_tokenizer("distilgpt2", local_files_only=True)
    tok, info = load_tokenizer("distilgpt2", allow_fallback=True, local_files_only=True)
    assert info.is_fallback and info.requested == "distilgpt2" and "shipped" in info.name
    assert info.vocab_size == len(tok) > 1000
    text = "Ada Baker visited the old mill in Ashford."
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    assert len(ids) < len(text) / 3  # BPE merges learned from the corpus, not bytes
    assert tok.convert_ids_to_tokens(info.eos_token_id) == "<|endoftext|>"


@pytest.mark.parametrize("script", ["scripts/build_corpus.py", "scripts/build_tokenizer.py"])
def test_shipped_assets_are_reproducible(script):
    out = subprocess.run([sys.executable, str(ROOT / script), "--check"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_configured_tokenizer_loads_without_fallback(tmp_path):
    # the AutoTokenizer path (the one distilgpt2 takes online), fed a local directory
    from dtrain.training.tokenizer import load_fallback_tokenizer, load_tokenizer

    load_fallback_tokenizer().save_pretrained(tmp_path / "tok")
    tok, info = load_tokenizer(str(tmp_path / "tok"), local_files_only=True)
    assert not info.is_fallback and info.name == str(tmp_path / "tok") and info.reason == ""
    assert tok("hello there")["input_ids"] == load_fallback_tokenizer()("hello there")["input_ids"]
