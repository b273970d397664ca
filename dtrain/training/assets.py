"""Paths of the files dtrain ships for offline use (corpus and fallback tokenizer)."""

from __future__ import annotations

from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets"
CORPUS_DIR = ASSETS_DIR / "corpus"
FALLBACK_TOKENIZER = ASSETS_DIR / "tokenizer" / "dtrain-bpe.json"
FALLBACK_TOKENIZER_NAME = "dtrain-bpe (shipped)"


def shipped_corpus_files() -> list[str]:
    """The shipped text files, sorted (their order defines shard indices)."""
    files = sorted(str(p) for p in CORPUS_DIR.glob("*.txt"))
    if not files:
        raise FileNotFoundError(
            f"no shipped corpus in {CORPUS_DIR}; reinstall dtrain or run scripts/build_corpus.py"
        )
    return files
