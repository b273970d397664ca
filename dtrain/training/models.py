"""GPT-2 model presets, Hub loading, parameter counting and the model fingerprint.

All presets are plain ``transformers`` GPT2LMHeadModel configurations with dropout
off: the validator recomputes a miner's gradients and compares them, which only
works when the forward pass is deterministic.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from dtrain.training.errors import ModelLoadError

# torch and transformers are imported inside functions: importing this module
# (e.g. for PRESETS in the CLI's --help) must stay cheap.


GPT2_VOCAB_SIZE = 50257


@dataclass(frozen=True)
class ModelPreset:
    name: str
    n_layer: int
    n_embd: int
    n_head: int
    n_positions: int
    description: str = ""


# Sizes are chosen to land near the advertised parameter count with the 50257-token
# GPT-2 vocabulary (tied embeddings); docs/training.md lists the exact counts.
PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset("tiny", 2, 128, 4, 128, "a few million params; trains on 2 CPU cores"),
        ModelPreset("gpt2-124m", 12, 768, 12, 1024, "GPT-2 small"),
        ModelPreset("gpt2-250m", 16, 1024, 16, 1024, "sized like distributed/gpt2-250m"),
        ModelPreset("gpt2-500m", 22, 1280, 20, 1024, "~500M"),
        ModelPreset("gpt2-1b", 24, 1792, 28, 1024, "~1B"),
    )
}

# Config fields that change the computation or the parameter layout. Anything
# else (names, torch_dtype hints, generation defaults) must not change the fingerprint.
_ARCH_FIELDS = (
    "model_type",
    "vocab_size",
    "n_positions",
    "n_embd",
    "n_layer",
    "n_head",
    "n_inner",
    "activation_function",
    "layer_norm_epsilon",
    "tie_word_embeddings",
    "scale_attn_weights",
    "scale_attn_by_inverse_layer_idx",
    "reorder_and_upcast_attn",
    "resid_pdrop",
    "embd_pdrop",
    "attn_pdrop",
)

_NO_DROPOUT = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "summary_first_dropout": 0.0}


def get_preset(name: str) -> ModelPreset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ModelLoadError(
            f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)} "
            "or configure a Hub model id instead"
        ) from None


def preset_config(
    name: str,
    *,
    vocab_size: int = GPT2_VOCAB_SIZE,
    n_positions: int | None = None,
    eos_token_id: int | None = None,
):
    """The GPT2Config of a preset (dropout off, tied embeddings)."""
    from transformers import GPT2Config

    p = get_preset(name)
    return GPT2Config(
        vocab_size=vocab_size,
        n_positions=n_positions or p.n_positions,
        n_embd=p.n_embd,
        n_layer=p.n_layer,
        n_head=p.n_head,
        # GPT-2's <|endoftext|> is the last id; the shipped tokenizer puts it at 0
        bos_token_id=eos_token_id if eos_token_id is not None else vocab_size - 1,
        eos_token_id=eos_token_id if eos_token_id is not None else vocab_size - 1,
        tie_word_embeddings=True,
        **_NO_DROPOUT,
    )


def create_model(
    preset: str,
    *,
    vocab_size: int = GPT2_VOCAB_SIZE,
    n_positions: int | None = None,
    eos_token_id: int | None = None,
    seed: int = 0,
):
    """A freshly initialised GPT2LMHeadModel for ``preset``.

    Initialisation uses its own forked RNG seeded with ``seed`` so every miner that
    starts from scratch gets identical weights without disturbing the global RNG.
    """
    import torch
    from transformers import GPT2LMHeadModel

    config = preset_config(preset, vocab_size=vocab_size, n_positions=n_positions, eos_token_id=eos_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT2LMHeadModel(config)
    return _plain_causal_lm_loss(model)


def _plain_causal_lm_loss(model):
    # transformers cannot infer the loss from the class name "GPT2LMHeadModel" and
    # warns; name the standard shifted cross-entropy explicitly (same computation).
    model.loss_type = "ForCausalLM"
    return model


def load_pretrained_model(
    model_id: str,
    *,
    revision: str | None = None,
    local_files_only: bool = False,
    cache_dir: str | None = None,
    key: str | None = None,
    revision_key: str | None = None,
):
    """Load a GPT-2 family model from the Hub (or a local directory) with dropout off.

    Raises ModelLoadError saying what is missing and how to get it (not cached while
    offline, Hub unreachable, no such id or revision; dtrain.training.hub_access) when it
    cannot be loaded; there is no fallback to a preset, because training a different model
    than the swarm's would get every gradient rejected. ``key``/``revision_key`` name the
    config keys in that message.
    """
    import os

    from transformers import GPT2LMHeadModel

    from dtrain.training import hub_access

    revision = revision or None
    source = os.path.expanduser(model_id)  # from_pretrained does not expand "~"
    if os.path.isdir(source):
        revision = None  # a directory has no revisions
    try:
        model = GPT2LMHeadModel.from_pretrained(
            source,
            revision=revision,
            local_files_only=local_files_only,
            cache_dir=cache_dir,
            **_NO_DROPOUT,
        )
    except Exception as exc:  # transformers raises OSError/ValueError/HTTP errors
        raise ModelLoadError(
            hub_access.explain("model", model_id, exc, revision=revision,
                               offline=local_files_only or hub_access.offline_mode(), key=key,
                               revision_key=revision_key)
            + f" To start from a built-in preset ({', '.join(PRESETS)}) instead, leave {key or 'the model id'} "
            "empty (only if the whole swarm does).",
            transient=hub_access.is_outage(exc),
        ) from exc
    return _plain_causal_lm_loss(model)


def count_parameters(model, *, trainable_only: bool = False) -> int:
    """Number of distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def preset_parameter_count(preset: str, *, vocab_size: int = GPT2_VOCAB_SIZE, n_positions: int | None = None) -> int:
    """Parameter count of a preset without allocating it (meta device); ``n_positions`` as the
    neurons build it (the sequence length) when given."""
    import torch
    from transformers import GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(preset_config(preset, vocab_size=vocab_size, n_positions=n_positions))
    return count_parameters(model)


def architecture_dict(model) -> dict:
    """The config fields that define the computation, as plain JSON values."""
    cfg = model.config
    return {k: getattr(cfg, k, None) for k in _ARCH_FIELDS}


def model_fingerprint(model) -> str:
    """Stable sha256 hex of the architecture and parameter names, shapes and dtypes.

    Peers with different fingerprints cannot average gradients meaningfully; the
    swarm and the validator compare this string to detect a wrong-model peer. It
    does not depend on parameter values (those change every step) nor on the device.
    """
    params = [
        [name, list(p.shape), str(p.dtype).replace("torch.", "")]
        for name, p in model.named_parameters()
    ]
    doc = {"format": "dtrain-model-fingerprint/1", "arch": architecture_dict(model), "params": params}
    blob = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()

