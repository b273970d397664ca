"""Streaming data, pages, and the pure page-assignment function.

One code path serves the live subnet and the sandbox: ``datasets.load_dataset(...,
streaming=True)`` opened on FineWeb (``HuggingFaceFW/fineweb``, ``sample-350BT``) or
on local text files (the ``text`` builder with ``data_files``). Only the DataSource
differs.

Pages
-----
A streaming dataset cannot be indexed, but it can be split into shards (one per
data file, ``IterableDataset.shard``) and read from a record offset within a
shard (``.skip``). A *page* is therefore a window of documents:

    page p  ->  shard  s = p mod n_shards,  window w = p div n_shards
    documents [w * docs_per_page, (w + 1) * docs_per_page) of shard s

The window's documents are tokenised (no special tokens), each followed by the
EOS token, concatenated, and the first ``page_sequences * seq_len`` tokens are cut
into a [page_sequences, seq_len] tensor. If a window holds fewer tokens, its token
stream is repeated (deterministically) to fill the page. A page depends only on
the dataset files (fixed, versioned) and the tokenizer, so any process can rebuild
it, and reading it costs at most ``windows_per_shard * docs_per_page`` skipped
records. ``num_pages = n_shards * windows_per_shard``. When ``windows_per_shard``
is not given it is counted by streaming every shard once for local files (the
smallest shard sets it) and is REMOTE_WINDOWS_PER_SHARD for Hub datasets. A
window beyond the end of a shorter shard wraps around that shard.

Assignment
----------
See ``assign_pages``: a keyed pseudo-random permutation (Feistel network with
cycle-walking, SHA-256 round function) of the page space, applied to the slot
``page_counter * max_uids + uid``. A miner's *page counter* is how many of its
pages it has trained this epoch; it restarts at 0 with every epoch.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from dtrain.training.errors import DataSourceError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

FINEWEB = "HuggingFaceFW/fineweb"
FINEWEB_CONFIG = "sample-350BT"
ASSIGNMENT_VERSION = "dtrain/pages/v1"
# Windows per shard assumed for remote (Hub) sources when PageSpec leaves it unset:
# 1024 windows x 32 docs = the first ~32k documents of each FineWeb parquet shard,
# which bounds a page read to skipping at most that many records.
REMOTE_WINDOWS_PER_SHARD = 1024
# Uids a subnet can hold (bittensor's default max_allowed_uids): the stride of the page
# slots. Every peer must use the same value, or they would assign different pages; it is
# part of the swarm fingerprint (dtrain.neurons.runtime.swarm_fingerprint).
MAX_UIDS = 256


# --------------------------------------------------------------------------- sources


@dataclass(frozen=True)
class DataSource:
    """Where the text comes from. ``path`` is a Hub dataset id or a builder name."""

    path: str = FINEWEB
    name: str | None = FINEWEB_CONFIG
    data_files: tuple[str, ...] | None = None
    split: str = "train"
    text_field: str = "text"
    revision: str | None = None

    @classmethod
    def fineweb(cls, config: str = FINEWEB_CONFIG, revision: str | None = None) -> "DataSource":
        return cls(path=FINEWEB, name=config, revision=revision)

    @classmethod
    def local_text(cls, files: Sequence[str]) -> "DataSource":
        """Plain text files, one document per line. File order defines shard order."""
        return cls(path="text", name=None, data_files=tuple(str(f) for f in files))

    @classmethod
    def shipped(cls) -> "DataSource":
        from dtrain.training.assets import shipped_corpus_files

        return cls.local_text(shipped_corpus_files())

    def describe(self) -> str:
        if self.data_files is not None:
            return f"{self.path} builder on {len(self.data_files)} file(s)"
        return f"{self.path}" + (f" ({self.name})" if self.name else "")


def open_stream(source: DataSource):
    """``datasets.load_dataset(..., streaming=True)`` for ``source``; clear errors on failure."""
    import datasets

    if source.data_files is not None:
        import os

        missing = [f for f in source.data_files if not any(c in f for c in "*?[") and not os.path.exists(f)]
        if missing:
            raise DataSourceError(
                f"data file(s) not found: {', '.join(missing[:5])}; check the data_files setting"
            )
    try:
        ds = datasets.load_dataset(
            source.path,
            source.name,
            data_files=list(source.data_files) if source.data_files is not None else None,
            split=source.split,
            streaming=True,
            revision=source.revision,
        )
    except Exception as exc:
        raise DataSourceError(
            f"could not open dataset {source.describe()} split {source.split!r}: "
            f"{type(exc).__name__}: {exc}. Check the dataset name/config and that the Hub is "
            "reachable (HF_ENDPOINT, network), or point the data source at local text files."
        ) from exc
    return ds


# ----------------------------------------------------------------------- assignment


def _key(*parts: Any) -> bytes:
    h = hashlib.sha256()
    for p in parts:
        b = p if isinstance(p, bytes) else str(p).encode("utf-8")
        h.update(len(b).to_bytes(8, "big"))  # length-prefixed: no ambiguity between parts
        h.update(b)
    return h.digest()


def _feistel(key: bytes, x: int, half_bits: int, rounds: int = 6) -> int:
    mask = (1 << half_bits) - 1
    left, right = x >> half_bits, x & mask
    nbytes = (half_bits + 7) // 8
    for r in range(rounds):
        f = hashlib.sha256(key + bytes([r]) + right.to_bytes(max(nbytes, 1), "big")).digest()
        left, right = right, left ^ (int.from_bytes(f[:8], "big") & mask)
    return (left << half_bits) | right


def permute(index: int, domain: int, key: bytes) -> int:
    """A keyed bijection of [0, domain): Feistel on the next even power of two, cycle-walked."""
    if not 0 <= index < domain:
        raise ValueError(f"index {index} outside [0, {domain})")
    half = max(1, ((domain - 1).bit_length() + 1) // 2)
    x = index
    while True:  # expected < 4 iterations: the Feistel domain is < 4 * domain
        x = _feistel(key, x, half)
        if x < domain:
            return x


def assign_pages(
    *,
    run_id: str,
    uid: int,
    epoch: int,
    page_counter: int,
    num_pages: int,
    count: int = 1,
    nonce: str | bytes | None = None,
    max_uids: int = MAX_UIDS,
) -> list[int]:
    """The pages miner ``uid`` must train on at ``epoch`` for page counters
    ``page_counter .. page_counter + count - 1``.

    Pure function (no I/O, no global state)::

        key   = SHA256(len-prefixed "dtrain/pages/v1", run_id, epoch, nonce or "")
        slot  = (page_counter * max_uids + uid) mod num_pages
        page  = P_key(slot)        # P: keyed pseudo-random permutation of [0, num_pages)

    Because P is a bijection, two (uid, page_counter) pairs of the same epoch get the same
    page only if their slots coincide, i.e. never while ``page_counter < num_pages / max_uids``
    (e.g. FineWeb at 8M pages with 256 uids: 32k pages per miner per epoch).
    Across epochs the key changes, so pages are fresh pseudo-random draws (a page may
    recur across epochs with probability ~ pages_used / num_pages). A validator
    ``nonce`` selects a separate permutation for Train challenges. ``max_uids`` must be
    the same for every peer: neurons always use :data:`MAX_UIDS`; tests and benchmarks
    may pass a smaller one to share a small corpus out evenly.
    """
    if num_pages <= 0:
        raise ValueError("num_pages must be positive")
    if not 0 <= uid < max_uids:
        raise ValueError(f"uid {uid} outside [0, {max_uids})")
    if page_counter < 0 or epoch < 0 or count < 0:
        raise ValueError("epoch, page_counter and count must be non-negative")
    key = _key(ASSIGNMENT_VERSION, run_id, epoch, nonce if nonce is not None else "")
    return [permute(((page_counter + i) * max_uids + uid) % num_pages, num_pages, key) for i in range(count)]


# ---------------------------------------------------------------------------- pages


@dataclass(frozen=True)
class PageSpec:
    """Shape of a page. Every peer of a run must use the same values."""

    seq_len: int = 1024
    page_sequences: int = 8
    docs_per_page: int = 32
    # None: count by streaming each shard once for local files; for Hub datasets
    # (FineWeb: hundreds of multi-GB shards) counting is impossible, so None means
    # REMOTE_WINDOWS_PER_SHARD there.
    windows_per_shard: int | None = None

    @property
    def tokens_per_page(self) -> int:
        return self.seq_len * self.page_sequences


@dataclass
class PageReader:
    """Materialises pages of a DataSource into token tensors.

    ``read_page(p)`` returns int64 input_ids of shape [page_sequences, seq_len]; a
    validator process with the same source, tokenizer and spec rebuilds the exact tensor.
    """

    source: DataSource
    tokenizer: Any
    spec: PageSpec
    _ds: Any = field(default=None, init=False, repr=False)
    _shard_windows: dict[int, int] = field(default_factory=dict, init=False, repr=False)
    _windows_per_shard: int | None = field(default=None, init=False, repr=False)

    def _stream(self):
        if self._ds is None:
            self._ds = open_stream(self.source)
        return self._ds

    @property
    def num_shards(self) -> int:
        return int(self._stream().n_shards)

    def _shard(self, s: int):
        ds = self._stream()
        return ds.shard(num_shards=ds.n_shards, index=s) if ds.n_shards > 1 else ds

    def _count_windows(self, s: int) -> int:
        if s not in self._shard_windows:
            n = sum(1 for _ in self._shard(s))
            # complete windows only (a trailing partial window is never a page), but a
            # shard shorter than one window still yields one (repeated) page
            self._shard_windows[s] = max(1, n // self.spec.docs_per_page) if n else 0
        return self._shard_windows[s]

    @property
    def windows_per_shard(self) -> int:
        if self.spec.windows_per_shard is not None:
            return self.spec.windows_per_shard
        if self.source.data_files is None:
            return REMOTE_WINDOWS_PER_SHARD
        if self._windows_per_shard is None:
            # The smallest shard bounds the uniform page grid, so every page is a real window.
            self._windows_per_shard = min(self._count_windows(s) for s in range(self.num_shards))
            if self._windows_per_shard == 0:
                raise DataSourceError(f"{self.source.describe()} has an empty shard; remove empty files")
        return self._windows_per_shard

    @property
    def num_pages(self) -> int:
        return self.num_shards * self.windows_per_shard

    def page_location(self, page: int) -> tuple[int, int]:
        """(shard, window) of a page."""
        if not 0 <= page < self.num_pages:
            raise ValueError(f"page {page} outside [0, {self.num_pages})")
        return page % self.num_shards, page // self.num_shards

    def _window_texts(self, shard: int, window: int) -> list[str]:
        d = self.spec.docs_per_page
        field_name = self.source.text_field
        try:
            rows = list(self._shard(shard).skip(window * d).take(d))
            if not rows and window > 0:
                # Shard shorter than windows_per_shard promised: wrap around it.
                n = self._count_windows(shard)
                if n == 0:
                    raise DataSourceError(f"shard {shard} of {self.source.describe()} is empty")
                log.debug("window %d beyond shard %d (%d windows); wrapping", window, shard, n)
                rows = list(self._shard(shard).skip((window % n) * d).take(d))
        except DataSourceError:
            raise
        except Exception as exc:
            raise DataSourceError(
                f"reading shard {shard} of {self.source.describe()} failed: {type(exc).__name__}: {exc}"
            ) from exc
        try:
            return [r[field_name] for r in rows]
        except KeyError:
            raise DataSourceError(
                f"{self.source.describe()} has no text field {field_name!r}; fields are "
                f"{sorted(rows[0]) if rows else []}"
            ) from None

    def page_tokens(self, page: int) -> list[int]:
        """The page's flat token list (length page_sequences * seq_len)."""
        shard, window = self.page_location(page)
        texts = [t for t in self._window_texts(shard, window) if t]
        if not texts:
            raise DataSourceError(f"page {page} (shard {shard}, window {window}) has no text")
        eos = self.tokenizer.eos_token_id
        enc = self.tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
        stream: list[int] = []
        for ids in enc:
            stream.extend(ids)
            stream.append(eos)
        need = self.spec.tokens_per_page
        if len(stream) < need:
            stream = (stream * (need // len(stream) + 1))
        return stream[:need]

    def read_page(self, page: int) -> "torch.Tensor":
        import torch

        return torch.tensor(self.page_tokens(page), dtype=torch.long).view(
            self.spec.page_sequences, self.spec.seq_len
        )

    def read_pages(self, pages: Sequence[int]) -> "torch.Tensor":
        """Pages stacked along the batch dim: [len(pages) * page_sequences, seq_len]."""
        import torch

        return torch.cat([self.read_page(p) for p in pages], dim=0)
