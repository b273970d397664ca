#!/usr/bin/env python3
"""Page reads from a FineWeb-shaped parquet shard: first page vs last page, row-group reader vs streaming.

Builds one local parquet shard shaped like a FineWeb file (columns text, id, dump, url,
date, file_path, language, language_score, token_count; ``--rows`` documents of 2-3 KB of
deterministic synthetic text; row groups of ``--row-group`` rows; pyarrow's default snappy
compression) in a temporary directory, then reads the shard's first page (window 0) and
its last page (the last complete window) with the production page shape (32 documents
tokenised into 8 x 1024 tokens, shipped tokenizer):

- ``parquet``: dtrain's row-group reader (PageReader, backend "auto") as a neuron keeps it:
  one reader, files open, the page cache off and one cached row group, first and last
  pages alternating, so every timed read decodes its row group again;
- ``parquet_cold``: a new reader for every read (open the file, read the footer, read the page);
- ``streaming`` (the baseline, same run): the ``datasets`` streaming path
  (``.shard().skip().take()``) that PageReader used before, with its stream kept open.

Each is timed ``--repeats`` times; prints medians, spread (min-max), ``ratio`` = last ÷
first for each (target for the row-group reader <= 2) and the bytes each read takes from
the file: measured through a counting file object for the row-group reader, and for the
baseline the compressed size of the column chunks it decodes (all columns of every row
group up to the window, from the footer). The shard sits in the OS page cache, so these
timings are CPU-bound: they measure decoding, not disk or network.

    python benchmarks/data_pages.py --json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time


class _Prose:
    """Deterministic word salad: a 20k-word vocabulary of pseudo-words drawn with Zipf-like
    frequencies, so the text repeats words the way prose does (snappy finds matches, a BPE
    tokenizer splits the rare words) without any text shipped with the benchmark."""

    def __init__(self, seed: int):
        import numpy as np

        self.np = np
        self.rng = np.random.default_rng(seed)
        letters = np.frombuffer(b"etaoinshrdlucmfwypvbgkjqxz", dtype=np.uint8)
        p = 1.0 / np.arange(1, 27) ** 0.9
        lengths = self.rng.integers(1, 11, size=20_000)
        self.words = np.array([bytes(self.rng.choice(letters, size=n, p=p / p.sum())).decode() for n in lengths],
                              dtype=object)
        w = 1.0 / (np.arange(len(self.words)) + 8.0)
        self.p = w / w.sum()

    def docs(self, n: int) -> list[str]:
        # ~6.3 characters a word with its space: 330-480 words make a 2-3 KB document
        counts = self.rng.integers(330, 480, size=n)
        ids = self.rng.choice(len(self.words), size=int(counts.sum()), p=self.p)
        out, at = [], 0
        for c in counts:
            out.append(" ".join(self.words[ids[at:at + c]]) + ".")
            at += c
        return out


def build_shard(path: str, rows: int, row_group: int, seed: int = 0) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(seed)
    prose = _Prose(seed)
    schema = pa.schema([("text", pa.string()), ("id", pa.string()), ("dump", pa.string()), ("url", pa.string()),
                        ("date", pa.string()), ("file_path", pa.string()), ("language", pa.string()),
                        ("language_score", pa.float64()), ("token_count", pa.int64())])
    text_bytes = 0
    with pq.ParquetWriter(path, schema) as writer:
        for start in range(0, rows, row_group):
            n = min(row_group, rows - start)
            texts = prose.docs(n)
            text_bytes += sum(len(t) for t in texts)
            ids = range(start, start + n)
            writer.write_table(pa.table({
                "text": texts,
                "id": [f"<urn:uuid:{rng.getrandbits(128):032x}>" for _ in ids],
                "dump": ["CC-MAIN-2024-10"] * n,
                "url": [f"https://www.example-{i % 9973}.com/articles/{rng.getrandbits(40):x}.html" for i in ids],
                "date": [f"2024-02-{1 + i % 28:02d}T{i % 24:02d}:00:00Z" for i in ids],
                "file_path": [f"s3://commoncrawl/crawl-data/CC-MAIN-2024-10/segments/{i // 1000}/warc/"
                              f"CC-MAIN-{i:08d}.warc.gz" for i in ids],
                "language": ["en"] * n,
                "language_score": [0.65 + (rng.random() * 0.35) for _ in ids],
                "token_count": [len(t) // 4 for t in texts],
            }, schema=schema), row_group_size=row_group)
    return {"rows": rows, "row_group": row_group, "file_bytes": os.path.getsize(path), "text_bytes": text_bytes}


def _streaming_bytes(path: str, window: int, docs: int) -> int:
    """Compressed bytes of every column chunk the streaming path decodes to reach ``window``."""
    import pyarrow.parquet as pq

    md = pq.ParquetFile(path).metadata
    last_row, seen, total = (window + 1) * docs, 0, 0
    for i in range(md.num_row_groups):
        rg = md.row_group(i)
        total += sum(rg.column(j).total_compressed_size for j in range(rg.num_columns))
        seen += rg.num_rows
        if seen >= last_row:
            break
    return total


def _summary(first: list[float], last: list[float]) -> dict:
    mf, ml = statistics.median(first), statistics.median(last)
    return {"first_s": mf, "first_min_s": min(first), "first_max_s": max(first),
            "last_s": ml, "last_min_s": min(last), "last_max_s": max(last), "ratio": ml / mf}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--row-group", type=int, default=1000,
                    help="rows per row group (1000: datatrove's write batch, which FineWeb's files are "
                         "assumed to follow)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--baseline-repeats", type=int, default=3, help="repeats of the (slow) streaming baseline")
    ap.add_argument("--dir", default="", help="where to write the shard (default: a temporary directory)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    from dtrain.training.data import DataSource, PageReader, PageSpec
    from dtrain.training.parquet_pages import CountingFile
    from dtrain.training.tokenizer import load_fallback_tokenizer

    tok = load_fallback_tokenizer()
    spec = PageSpec()  # production shape: 32 documents -> 8 x 1024 tokens
    with tempfile.TemporaryDirectory(dir=args.dir or None) as tmp:
        path = os.path.join(tmp, "000_00000.parquet")
        t0 = time.perf_counter()
        shard = build_shard(path, args.rows, args.row_group)
        build_s = time.perf_counter() - t0
        src = DataSource.local_parquet([path])

        warm_log: list = []
        reader = PageReader(src, tok, spec, cache_pages=0, open_file=lambda f: CountingFile(f, warm_log))
        reader._parquet_shards()._max_groups = 1  # every alternating read decodes its row group again
        first_page, last_page = 0, reader.num_pages - 1
        last_window = args.rows // spec.docs_per_page - 1
        assert reader.page_location(last_page) == (0, last_window)
        reader.open()  # footer read once, as a neuron does at start-up

        def timed(fn, *a) -> float:
            t = time.perf_counter()
            fn(*a)
            return time.perf_counter() - t

        pages = (("first", first_page, 0), ("last", last_page, last_window))
        warm: dict[str, list] = {"first": [], "last": []}
        docs: dict[str, list] = {"first": [], "last": []}
        cold: dict[str, list] = {"first": [], "last": []}
        warm_bytes: dict[str, int] = {}
        cold_bytes: dict[str, int] = {}
        for _ in range(args.repeats):
            for name, page, window in pages:
                before = sum(n for _, n in warm_log)
                warm[name].append(timed(reader.page_tokens, page))
                warm_bytes[name] = sum(n for _, n in warm_log) - before
            for name, page, window in pages:  # the documents alone, without tokenising them
                docs[name].append(timed(reader._window_texts, 0, window))
            for name, page, window in pages:
                log: list = []
                fresh = PageReader(src, tok, spec, cache_pages=0, open_file=lambda f, log=log: CountingFile(f, log))
                cold[name].append(timed(fresh.page_tokens, page))
                fresh.close()
                cold_bytes[name] = sum(n for _, n in log)
        cached = PageReader(src, tok, spec)
        cached.page_tokens(last_page)
        hit_s = statistics.median(timed(cached.page_tokens, last_page) for _ in range(args.repeats))

        baseline = PageReader(src, tok, spec, backend="streaming", cache_pages=0)
        baseline.num_pages  # open the stream and count the shard once, as the old reader did; untimed
        slow = {"first": [], "last": []}
        for _ in range(args.baseline_repeats):
            for name, page, _ in pages:
                slow[name].append(timed(baseline.page_tokens, page))
        # the same documents either way (the tests check every page; here the two timed ones)
        assert baseline.page_tokens(last_page) == reader.page_tokens(last_page)
        streaming_bytes = {"first": _streaming_bytes(path, 0, spec.docs_per_page),
                           "last": _streaming_bytes(path, last_window, spec.docs_per_page)}

    out = {
        "shard": {**shard, "build_s": round(build_s, 1)},
        "page": {"docs": spec.docs_per_page, "tokens": spec.tokens_per_page},
        "parquet": _summary(warm["first"], warm["last"]),
        "parquet_documents_only": _summary(docs["first"], docs["last"]),
        "parquet_cold": _summary(cold["first"], cold["last"]),
        "streaming": _summary(slow["first"], slow["last"]),
        "parquet_bytes_per_page": warm_bytes,
        "parquet_cold_bytes_per_page": cold_bytes,
        "streaming_bytes_per_page": streaming_bytes,
        "cached_page_s": hit_s,
        "speedup_last_page": statistics.median(slow["last"]) / statistics.median(warm["last"]),
        "target_ratio": 2.0,
        "repeats": args.repeats, "baseline_repeats": args.baseline_repeats,
        "cpus": os.cpu_count(),
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    mb = 1 / (1 << 20)
    print(f"shard: {shard['rows']:,} rows in row groups of {shard['row_group']:,}, "
          f"{shard['file_bytes'] * mb:.0f} MiB on disk ({shard['text_bytes'] * mb:.0f} MiB of text), "
          f"built in {build_s:.1f} s")
    for key, label in (("parquet", "row-group reader"),
                       ("parquet_documents_only", "row-group reader, documents only (no tokenising)"),
                       ("parquet_cold", "row-group reader, new reader per read"),
                       ("streaming", "streaming baseline (skip/take)")):
        r = out[key]
        print(f"{label}: first {r['first_s'] * 1e3:.1f} ms ({r['first_min_s'] * 1e3:.1f}-{r['first_max_s'] * 1e3:.1f}), "
              f"last {r['last_s'] * 1e3:.1f} ms ({r['last_min_s'] * 1e3:.1f}-{r['last_max_s'] * 1e3:.1f}), "
              f"last/first {r['ratio']:.2f}")
    print(f"bytes read per page, row-group reader: first {warm_bytes['first'] * mb:.2f} MiB, "
          f"last {warm_bytes['last'] * mb:.2f} MiB (new reader, footer included: first "
          f"{cold_bytes['first'] * mb:.2f} MiB, last {cold_bytes['last'] * mb:.2f} MiB)")
    print(f"bytes decoded per page, streaming baseline (compressed, all columns): "
          f"first {streaming_bytes['first'] * mb:.2f} MiB, last {streaming_bytes['last'] * mb:.1f} MiB")
    print(f"cached page re-read: {hit_s * 1e6:.0f} us; last page {out['speedup_last_page']:.0f}x faster than "
          f"the baseline; target last/first <= {out['target_ratio']:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
