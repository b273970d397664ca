"""Tokenizer loading: the configured one (``distilgpt2``), or the shipped BPE when allowed.

Whether the shipped BPE may stand in for the configured tokenizer is the caller's
decision (``allow_fallback``): dtrain.neurons.runtime allows it on the sandbox network and
otherwise only when the operator opts in, because peers with different tokenizers train
different models.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass

from dtrain.training.assets import FALLBACK_TOKENIZER, FALLBACK_TOKENIZER_NAME
from dtrain.training.errors import TokenizerLoadError

log = logging.getLogger(__name__)

DEFAULT_TOKENIZER = "distilgpt2"
EOS_TOKEN = "<|endoftext|>"
# Files of a model repo a tokenizer needs (AutoTokenizer reads config.json to find the
# class); downloading only these avoids fetching the weights.
TOKENIZER_FILES = ("*.json", "*.txt", "*.model")
DIGEST_FORMAT = "dtrain-tokenizer/1"


@dataclass(frozen=True)
class TokenizerInfo:
    """Which tokenizer is in use and why; callers log or display it."""

    name: str  # the id/path actually loaded
    requested: str
    is_fallback: bool
    vocab_size: int
    eos_token_id: int
    reason: str = ""  # why the fallback was taken (empty when not)
    revision: str | None = None  # the Hub revision asked for (None: the default branch, or a local directory)
    # sha256 of what decides the token ids of a text (tokenizer_digest); peers whose
    # tokenizers differ in content, not only in size, are told apart by it
    digest: str = ""


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


def _canonical_merges(merges) -> list:
    # tokenizers writes merges as "a b" strings (older files) or [a, b] pairs (newer);
    # the same merges must hash the same whichever way a file spelled them.
    out = []
    for m in merges or []:
        out.append(list(m.split(" ", 1)) if isinstance(m, str) else list(m))
    return out


def tokenizer_digest(tok) -> str:
    """sha256 hex of the tokenizer's content: what decides the ids of a text.

    Hashed: the model (type, vocabulary, merges and its flags), the normalizer and
    pre-tokenizer, the added tokens (id, content, flags) and the end-of-text id (page
    packing uses it). Not hashed: file names, the class name, truncation/padding and the
    decoder, which differ between equivalent tokenizers or across a save_pretrained
    round trip without changing a single id. A tokenizer without a fast backend is hashed
    from its vocabulary (the only content it exposes uniformly).
    """
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        full = json.loads(backend.to_str())
        # "" and null mean the same for the model's optional strings (continuing_subword_prefix,
        # end_of_word_suffix); GPT2Tokenizer writes one, a tokenizer.json the other
        model = {k: (None if v == "" else v) for k, v in (full.get("model") or {}).items()}
        if "merges" in model:
            model["merges"] = _canonical_merges(model["merges"])
        added = sorted(
            ({k: t.get(k) for k in ("id", "content", "single_word", "lstrip", "rstrip", "normalized", "special")}
             for t in full.get("added_tokens") or []),
            key=lambda t: (t["id"], t["content"]))
        doc = {"model": model, "normalizer": full.get("normalizer"), "pre_tokenizer": full.get("pre_tokenizer"),
               "added_tokens": added}
    else:
        doc = {"vocab": tok.get_vocab()}
    doc["format"] = DIGEST_FORMAT
    doc["eos_token_id"] = tok.eos_token_id
    blob = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()


def tokenizer_info(tok, *, name: str, requested: str, is_fallback: bool = False, reason: str = "",
                   revision: str | None = None) -> TokenizerInfo:
    """TokenizerInfo of a loaded tokenizer; an error if it has no end-of-text token."""
    if tok.eos_token_id is None:
        raise TokenizerLoadError(f"tokenizer {name!r} has no end-of-text token; packing needs one")
    return TokenizerInfo(name=name, requested=requested, is_fallback=is_fallback, vocab_size=len(tok),
                         eos_token_id=int(tok.eos_token_id), reason=reason, revision=revision,
                         digest=tokenizer_digest(tok))


def load_shipped_tokenizer(requested: str = "shipped"):
    """The shipped BPE, chosen on purpose (not as a fallback): (tokenizer, TokenizerInfo)."""
    tok = load_fallback_tokenizer()
    return tok, tokenizer_info(tok, name=FALLBACK_TOKENIZER_NAME, requested=requested)


def load_tokenizer(
    name: str = DEFAULT_TOKENIZER,
    *,
    allow_fallback: bool = False,
    local_files_only: bool = False,
    revision: str | None = None,
    key: str | None = None,
    revision_key: str | None = None,
):
    """Load ``name`` with transformers' AutoTokenizer; return (tokenizer, TokenizerInfo).

    When it cannot be loaded: with ``allow_fallback`` the shipped byte-level BPE is
    used and TokenizerInfo says so (and a warning is logged); without it a
    TokenizerLoadError says what is missing and how to get it (dtrain.training.hub_access):
    not cached while offline, Hub unreachable, no such id or revision. ``local_files_only``
    skips the network (the Hub client otherwise retries for ~45 s when offline);
    ``key``/``revision_key`` name the config keys in that message.
    Note the fallback has a different vocabulary, so its models do not match
    distilgpt2 models (different model fingerprint): peers must agree.
    """
    from transformers import AutoTokenizer

    from dtrain.training import hub_access

    revision = revision or None
    source = os.path.expanduser(name)  # AutoTokenizer does not expand "~"
    if os.path.isdir(source):
        if revision:
            # a directory has no revisions; saying so beats silently reading whatever it holds
            log.warning("%s is a local directory: revision %r does not apply and is ignored", source, revision)
        revision = None
    try:
        tok = AutoTokenizer.from_pretrained(source, local_files_only=local_files_only, revision=revision)
    except Exception as exc:  # transformers wraps the Hub client's errors in OSError/ValueError
        message = hub_access.explain("tokenizer", name, exc, revision=revision,
                                     offline=local_files_only or hub_access.offline_mode(), key=key,
                                     revision_key=revision_key, include=TOKENIZER_FILES)
        if not allow_fallback:
            raise TokenizerLoadError(message, transient=hub_access.is_outage(exc)) from exc
        log.warning("%s Using %s instead.", message, FALLBACK_TOKENIZER_NAME)
        tok = load_fallback_tokenizer()
        return tok, tokenizer_info(tok, name=FALLBACK_TOKENIZER_NAME, requested=name, is_fallback=True,
                                   reason=f"{name!r} unavailable ({type(exc).__name__})", revision=revision)
    return tok, tokenizer_info(tok, name=name, requested=name, revision=revision)
