#!/usr/bin/env python3
"""Build the shipped offline tokenizer (dtrain/assets/tokenizer/dtrain-bpe.json).

The vocabulary target is 4096; the small corpus saturates earlier (~2.4k tokens).

A byte-level BPE (the GPT-2 scheme: any byte sequence is encodable, no unknown
token) trained with the `tokenizers` library on dtrain's own shipped corpus. It is
used only when the configured tokenizer (``distilgpt2`` by default) cannot be
loaded and the caller allows the fallback.

Deterministic: the corpus files are read in sorted order and BPE training breaks
ties by a fixed order, so rebuilding gives the same file (``--check`` verifies).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "dtrain" / "assets" / "corpus"
OUT = ROOT / "dtrain" / "assets" / "tokenizer" / "dtrain-bpe.json"
EOS = "<|endoftext|>"


def build(corpus_dir: Path, vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS],  # id 0; doubles as bos/eos/pad like GPT-2's
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    files = sorted(str(p) for p in corpus_dir.glob("*.txt"))
    if not files:
        raise SystemExit(f"no corpus files in {corpus_dir}; run scripts/build_corpus.py first")
    tok.train(files, trainer)
    return tok.to_str(pretty=False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, default=CORPUS)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--check", action="store_true", help="compare with --out instead of writing")
    args = ap.parse_args(argv)
    text = build(args.corpus, args.vocab_size)
    if args.check:
        if not args.out.is_file() or args.out.read_text(encoding="utf-8") != text:
            print(f"{args.out} differs from a fresh build", file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8")
    print(f"wrote {args.out} ({len(text)} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
