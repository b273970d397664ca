"""Pages of training text: where the text comes from (``DataSource``), what a page is
(``PageSpec``), how pages are read and tokenised (``PageReader``), and which pages a miner
trains (``assign_pages``).

A page is a window of documents of one shard, tokenised and packed into a
[page_sequences, seq_len] tensor that any process rebuilds identically. docs/training.md
("Data", "Pages", "Assignment") defines pages, the page count, the two readers and their caches.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

from dtrain.training.sources import DataSource, open_stream, resolve_data_files
from dtrain.training.errors import DataSourceError, describe_error, is_transient
from dtrain.training.permutation import permute

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

ASSIGNMENT_VERSION = "dtrain/pages/v1"
# Windows per shard assumed for remote (Hub) sources when PageSpec leaves it unset:
# 1024 windows x 32 docs = the first ~32k documents of each FineWeb parquet shard.
# It fixes the page space without reading any footer (docs/training.md, "Pages").
REMOTE_WINDOWS_PER_SHARD = 1024
# Page token lists a PageReader keeps (LRU): at 8k tokens a page, 256 pages are ~16 MB.
DEFAULT_CACHE_PAGES = 256
# Uids a subnet can hold (bittensor's default max_allowed_uids): the stride of the page
# slots. Every peer must use the same value, or they would assign different pages; it is
# part of the swarm fingerprint (dtrain.neurons.runtime.swarm_fingerprint).
MAX_UIDS = 256


# ----------------------------------------------------------------------- assignment


def _key(*parts: Any) -> bytes:
    h = hashlib.sha256()
    for p in parts:
        b = p if isinstance(p, bytes) else str(p).encode("utf-8")
        h.update(len(b).to_bytes(8, "big"))  # length-prefixed: no ambiguity between parts
        h.update(b)
    return h.digest()


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
    (FineWeb with S shards x 1024 windows and 256 uids: 4·S pages per miner per epoch).
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
    # None: the smallest local shard sets it (parquet footers, or one streaming pass over
    # text files); for Hub datasets (FineWeb: hundreds of multi-GB shards) None means
    # REMOTE_WINDOWS_PER_SHARD, read from nothing (docs/training.md, "Pages").
    windows_per_shard: int | None = None

    @property
    def tokens_per_page(self) -> int:
        return self.seq_len * self.page_sequences


@dataclass
class PageReader:
    """Materialises pages of a DataSource into token tensors.

    ``read_page(p)`` returns int64 input_ids of shape [page_sequences, seq_len]; a
    validator process with the same source, tokenizer and spec rebuilds the exact tensor.

    ``backend``: "auto" reads parquet files by row group and everything else by
    streaming; "streaming" forces the ``datasets`` streaming path (the reference the
    parquet reader is tested and benchmarked against). ``open_file`` opens a parquet
    shard for pyarrow (default: dtrain.training.parquet_pages.default_open_file).
    Safe to share between threads.
    """

    source: DataSource
    tokenizer: Any
    spec: PageSpec
    backend: str = "auto"
    cache_pages: int = DEFAULT_CACHE_PAGES
    open_file: Callable[[str], Any] | None = field(default=None, repr=False)
    _ds: Any = field(default=None, init=False, repr=False)
    _parquet: Any = field(default=None, init=False, repr=False)
    _files: list | None = field(default=None, init=False, repr=False)
    _shard_windows: dict[int, int] = field(default_factory=dict, init=False, repr=False)
    _windows_per_shard: int | None = field(default=None, init=False, repr=False)
    _cache: OrderedDict = field(default_factory=OrderedDict, init=False, repr=False)
    _lock: Any = field(default_factory=threading.RLock, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.backend not in ("auto", "streaming"):
            raise ValueError(f"backend must be 'auto' or 'streaming', got {self.backend!r}")

    # ------------------------------------------------------------------ backends

    def _parquet_shards(self):
        """The row-group reader when the source is parquet, else None (streaming)."""
        if self.backend == "streaming":
            return None
        with self._lock:
            if self._files is None:
                if self.source.data_files is not None and not self.source.is_parquet_files:
                    self._files = []  # local text (or other non-parquet) files: streaming
                else:
                    files = resolve_data_files(self.source)
                    parquet = bool(files) and all(f.lower().split("?")[0].endswith(".parquet") for f in files)
                    if parquet:
                        from dtrain.training.parquet_pages import ParquetShards

                        self._parquet = ParquetShards(files, self.source.text_field, describe=self.source.describe(),
                                                      open_file=self.open_file)
                    self._files = files
            return self._parquet

    def _stream(self):
        if self._ds is None:
            self._ds = open_stream(self.source)
        return self._ds

    def open(self) -> "PageReader":
        """Touch the source once: list its files, count its pages, check its text field.

        Neurons call this at start-up (through ``dtrain.neurons.runtime.retry_data``) so a
        wrong dataset fails before anything is announced and a transient one is retried.
        """
        self.num_pages  # noqa: B018 - lists files and reads what the page count needs
        pq = self._parquet_shards()
        if pq is not None:
            pq.check()
        else:
            features = getattr(self._stream(), "features", None)
            if features is not None and self.source.text_field not in features:
                raise DataSourceError(f"{self.source.describe()} has no text field {self.source.text_field!r}; "
                                      f"fields are {sorted(features)}")
        return self

    def close(self) -> None:
        if self._parquet is not None:
            self._parquet.close()

    # ------------------------------------------------------------------ page space

    @property
    def num_shards(self) -> int:
        pq = self._parquet_shards()
        if pq is not None:
            return pq.n_shards
        return int(self._stream().n_shards)

    def _shard(self, s: int):
        ds = self._stream()
        return ds.shard(num_shards=ds.n_shards, index=s) if ds.n_shards > 1 else ds

    def _count_windows(self, s: int) -> int:
        if s not in self._shard_windows:
            pq = self._parquet_shards()
            n = pq.num_rows(s) if pq is not None else sum(1 for _ in self._shard(s))
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
            try:
                counts = [self._count_windows(s) for s in range(self.num_shards)]
            except DataSourceError:
                raise
            except Exception as exc:
                raise DataSourceError(f"counting the documents of {self.source.describe()} failed: "
                                      f"{describe_error(exc)}", transient=is_transient(exc)) from exc
            self._windows_per_shard = min(counts)
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

    # ------------------------------------------------------------------ reading

    def _window_texts(self, shard: int, window: int) -> list[str]:
        pq = self._parquet_shards()
        if pq is not None:
            # errors come out as DataSourceError, classified transient or not
            return pq.window(shard, window, self.spec.docs_per_page)
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
                f"reading shard {shard} of {self.source.describe()} failed: {describe_error(exc)}",
                transient=is_transient(exc),
            ) from exc
        try:
            return [r[field_name] for r in rows]
        except KeyError:
            raise DataSourceError(
                f"{self.source.describe()} has no text field {field_name!r}; fields are "
                f"{sorted(rows[0]) if rows else []}"
            ) from None

    def _build_page(self, page: int) -> list[int]:
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

    def page_tokens(self, page: int) -> list[int]:
        """The page's flat token list (length page_sequences * seq_len).

        The last ``cache_pages`` pages are kept (as int64 arrays, 8 bytes a token): a
        validator recomputing a Train challenge or auditing work reads pages again.
        """
        with self._lock:
            hit = self._cache.get(page)
            if hit is not None:
                self._cache.move_to_end(page)
                return hit.tolist()
            tokens = self._build_page(page)
            if self.cache_pages > 0:
                self._cache[page] = array("q", tokens)
                while len(self._cache) > self.cache_pages:
                    self._cache.popitem(last=False)
            return tokens

    def read_page(self, page: int) -> "torch.Tensor":
        import torch

        return torch.tensor(self.page_tokens(page), dtype=torch.long).view(
            self.spec.page_sequences, self.spec.seq_len
        )

    def read_pages(self, pages: Sequence[int]) -> "torch.Tensor":
        """Pages stacked along the batch dim: [len(pages) * page_sequences, seq_len]."""
        import torch

        return torch.cat([self.read_page(p) for p in pages], dim=0)
