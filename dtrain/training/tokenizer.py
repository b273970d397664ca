"""Tokenizer loading: the configured one (``distilgpt2``), or the shipped BPE when allowed."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from dtrain.training.assets import FALLBACK_TOKENIZER, FALLBACK_TOKENIZER_NAME
from dtrain.training.errors import TokenizerLoadError

log = logging.getLogger(__name__)

DEFAULT_TOKENIZER = "distilgpt2"
EOS_TOKEN = "<|endoftext|>"


@dataclass(frozen=True)
class TokenizerInfo:
    """Which tokenizer is in use and why; callers log or display it."""

    name: str  # the id/path actually loaded
    requested: str
    is_fallback: bool
    vocab_size: int
    eos_token_id: int
    reason: str = ""  # why the fallback was taken (empty when not)


def load_fallback_tokenizer():
    from transformers import PreTrainedTokenizerFast

    if not FALLBACK_TOKENIZER.is_file():
        raise TokenizerLoadError(
            f"shipped tokenizer {FALLBACK_TOKENIZER} is missing; reinstall dtrain or run "
            "scripts/build_tokenizer.py"
        )
    return PreTrainedTokenizerFast(
        tokenizer_file=str(FALLBACK_TOKENIZER),
        eos_token=EOS_TOKEN,
        bos_token=EOS_TOKEN,
        unk_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
    )


def load_tokenizer(
    name: str = DEFAULT_TOKENIZER,
    *,
    allow_fallback: bool = False,
    local_files_only: bool = False,
    revision: str | None = None,
):
    """Load ``name`` with transformers' AutoTokenizer; return (tokenizer, TokenizerInfo).

    When it cannot be loaded: with ``allow_fallback`` the shipped byte-level BPE is
    used and TokenizerInfo says so (and a warning is logged); without it a
    TokenizerLoadError names the id. ``local_files_only`` skips the network (the
    Hub client otherwise retries for ~45 s when offline).
    Note the fallback has a different vocabulary, so its models do not match
    distilgpt2 models (different model fingerprint): peers must agree.
    """
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(name, local_files_only=local_files_only, revision=revision)
        reason = ""
        used, fallback = name, False
    except Exception as exc:
        if not allow_fallback:
            raise TokenizerLoadError(
                f"could not load tokenizer {name!r}: {type(exc).__name__}: {exc}. Check the id and "
                "that the Hub is reachable, or allow the shipped offline tokenizer "
                "(allow_fallback / sandbox mode)."
            ) from exc
        reason = f"{name!r} unavailable ({type(exc).__name__})"
        log.warning("tokenizer %s; using %s", reason, FALLBACK_TOKENIZER_NAME)
        tok = load_fallback_tokenizer()
        used, fallback = FALLBACK_TOKENIZER_NAME, True
    if tok.eos_token_id is None:
        raise TokenizerLoadError(f"tokenizer {used!r} has no end-of-text token; packing needs one")
    info = TokenizerInfo(
        name=used,
        requested=name,
        is_fallback=fallback,
        vocab_size=len(tok),
        eos_token_id=int(tok.eos_token_id),
        reason=reason,
    )
    return tok, info
