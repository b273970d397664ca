"""Data sources, pages, and the pure page-assignment function.

One definition of a page serves the live subnet and the sandbox; two readers
materialise it:

- parquet shards (FineWeb on the Hub: ``HuggingFaceFW/fineweb``, ``sample-350BT``; local
  ``*.parquet`` files) are read by row group (dtrain.training.parquet_pages): a page
  read costs the same wherever the page lies in its shard;
- anything else (local text files through the ``text`` builder, a Hub dataset that is
  not parquet) is read with ``datasets.load_dataset(..., streaming=True)`` and
  ``.shard().skip().take()``, which costs O(position in the shard).

Both give the same documents for the same file and window (tests compare them).

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
the dataset files and the tokenizer, so any process can rebuild it.

Files and revisions
-------------------
A Hub dataset's files are listed by the ``datasets`` machinery
(``load_dataset_builder(path, name, revision=...)``, its ``config.data_files``): the
same list, in the same order, that ``load_dataset(..., streaming=True)`` shards by.
``DataSource.revision`` (config ``data.dataset_revision``, a branch, tag or commit)
pins it; empty means the Hub's default branch, which can move under a running swarm,
so a live run should pin a commit. Remote parquet files are opened through
huggingface_hub's HfFileSystem (it honours ``HF_ENDPOINT``), so pyarrow fetches only
the byte ranges it needs: the footer once, then the text column of one or two row
groups per page. Local files have no revision; their names and sizes enter the swarm
fingerprint instead (``DataSource.identity``).

Page count
----------
``num_pages = n_shards * windows_per_shard``, and every peer must compute the same
value. When ``PageSpec.windows_per_shard`` is not given:

- local files: the smallest shard sets it (so every page is a real window). Parquet
  row counts come from the footers (cheap); text files are counted by streaming them
  once;
- Hub datasets: REMOTE_WINDOWS_PER_SHARD, without reading anything. Reading the
  footer of each of FineWeb's hundreds of multi-GB shards at every start would cost
  hundreds of requests before the first page, and the value is also the page space
  peers already agree on; changing it changes every assignment, so it would need a
  new ASSIGNMENT_VERSION. Row-group reads make a larger value affordable later.

A window beyond the end of a shorter shard wraps around that shard's complete
windows.

Caching
-------
Validators re-read the pages they challenge and audit, so ``PageReader`` keeps the
token lists of the last ``cache_pages`` pages (a bounded LRU), and the parquet reader
keeps its open files, their footers and the last decoded row groups (bounded too).

Failures
--------
Every failure is a DataSourceError whose ``transient`` flag says whether retrying
can help (timeouts, connection errors, HTTP 5xx/429) or not (no such dataset, file
or text field). ``PageReader.open`` touches the source once at start-up; neurons
call it through ``dtrain.neurons.runtime.retry_data``, which retries
transient failures with backoff until they pass or the neuron is stopped.

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
import os
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

from dtrain.training.errors import DataSourceError, describe_error, is_transient

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

FINEWEB = "HuggingFaceFW/fineweb"
FINEWEB_CONFIG = "sample-350BT"
ASSIGNMENT_VERSION = "dtrain/pages/v1"
# Windows per shard assumed for remote (Hub) sources when PageSpec leaves it unset:
# 1024 windows x 32 docs = the first ~32k documents of each FineWeb parquet shard.
# It fixes the page space without reading any footer (see "Page count" above).
REMOTE_WINDOWS_PER_SHARD = 1024
# Page token lists a PageReader keeps (LRU): at 8k tokens a page, 256 pages are ~16 MB.
DEFAULT_CACHE_PAGES = 256
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
    def local_parquet(cls, files: Sequence[str], text_field: str = "text") -> "DataSource":
        """Parquet files (paths or fsspec URLs), one document per row. File order defines shard order."""
        return cls(path="parquet", name=None, data_files=tuple(str(f) for f in files), text_field=text_field)

    @property
    def is_parquet_files(self) -> bool:
        """Explicit data files that are all parquet (read by row group)."""
        return bool(self.data_files) and (self.path == "parquet" or all(
            f.lower().split("?")[0].endswith(".parquet") for f in self.data_files))

    def identity(self) -> list:
        """What tells local data apart cheaply: each file's name and size, in shard order.

        Local files have no revision to pin; two peers with other files (or the same names
        with other sizes) build other pages, and this makes their swarm fingerprints differ.
        Remote files and globs are named only (a revision pins those).
        """
        out: list = []
        for f in self.data_files or ():
            try:
                out.append([os.path.basename(f), os.path.getsize(f)])
            except OSError:
                out.append([f, None])
        return out

    @classmethod
    def shipped(cls) -> "DataSource":
        from dtrain.training.assets import shipped_corpus_files

        return cls.local_text(shipped_corpus_files())

    def describe(self) -> str:
        if self.data_files is not None:
            return f"{self.path} builder on {len(self.data_files)} file(s)"
        return (f"{self.path}" + (f" ({self.name})" if self.name else "")
                + (f" at revision {self.revision}" if self.revision else ""))


def _check_local_files(source: DataSource) -> None:
    if source.data_files is None:
        return
    missing = [f for f in source.data_files
               if "://" not in f and not any(c in f for c in "*?[") and not os.path.exists(f)]
    if missing:
        raise DataSourceError(
            f"data file(s) not found: {', '.join(missing[:5])}; check the data_files setting"
        )


def _hub_offline() -> bool:
    # With HF_HUB_OFFLINE (hub_access.offline_mode) or datasets' own HF_DATASETS_OFFLINE set,
    # waiting never brings the Hub back (datasets reports it as a plain ConnectionError): a
    # setting to change, not an outage.
    from dtrain.training.hub_access import offline_mode

    return offline_mode() or os.environ.get("HF_DATASETS_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _hub_dataset_problem(source: DataSource, exc: BaseException) -> str:
    """What went wrong opening a Hub dataset, and the fix, in an operator's terms.

    Unlike a tokenizer, a dataset like FineWeb is far too large to download whole, so the
    offline answer is a few parquet shards used as a local source, never "download it".
    """
    from dtrain.training.hub_access import NO_SUCH_REPO, NO_SUCH_REVISION, classify, endpoint, explain

    head = f"could not open the dataset data.dataset = {source.path!r}" + (
        f" (config {source.name!r})" if source.name else "") + (
        f" at data.dataset_revision = {source.revision!r}" if source.revision else "")
    shards = (f"`hf download {source.path} --repo-type dataset --include '<a few .parquet files>'`"
              + (f" --revision {source.revision}" if source.revision else ""))
    local = (f'download a few of its parquet shards ({shards}) and set data.source = "local" with '
             "data.local_path pointing at them")
    detail = describe_error(exc)
    if _hub_offline():
        return (f"{head}: HF_HUB_OFFLINE or HF_DATASETS_OFFLINE is set, and streaming a Hub dataset needs the "
                f"Hub. Unset it, or {local}. ({detail})")
    if classify(exc) in (NO_SUCH_REPO, NO_SUCH_REVISION):
        # worded like a missing tokenizer or model: no download advice applies to these
        return explain("dataset", source.path, exc, revision=source.revision or None, repo_type="dataset",
                       key="data.dataset", revision_key="data.dataset_revision") + f" ({detail})"
    return (f"{head}: {detail}. Check data.dataset, data.dataset_config and data.dataset_revision and that the "
            f"Hub ({endpoint()}) is reachable (network, proxy, or HF_ENDPOINT for a mirror); or {local}.")


def resolve_data_files(source: DataSource) -> list[str]:
    """The files of ``source``'s split, in shard order.

    Explicit ``data_files`` are returned as given. For a Hub dataset the ``datasets``
    builder lists them at ``source.revision`` (``hf://datasets/<id>@<commit>/...``), the
    list ``load_dataset(..., streaming=True)`` would shard.
    """
    _check_local_files(source)
    if source.data_files is not None:
        return list(source.data_files)
    import datasets

    try:
        builder = datasets.load_dataset_builder(source.path, source.name, revision=source.revision or None)
        files = builder.config.data_files
    except Exception as exc:
        raise DataSourceError(_hub_dataset_problem(source, exc),
                              transient=is_transient(exc) and not _hub_offline()) from exc
    if not files or source.split not in files:
        raise DataSourceError(f"dataset {source.describe()} has no data files for split {source.split!r}"
                              + (f" (splits: {sorted(files)})" if files else ""))
    return [str(f) for f in files[source.split]]


def open_stream(source: DataSource):
    """``datasets.load_dataset(..., streaming=True)`` for ``source``; clear errors on failure."""
    import datasets

    _check_local_files(source)
    try:
        ds = datasets.load_dataset(
            source.path,
            source.name,
            data_files=list(source.data_files) if source.data_files is not None else None,
            split=source.split,
            streaming=True,
            revision=source.revision or None,
        )
    except Exception as exc:
        if source.data_files is None:
            raise DataSourceError(_hub_dataset_problem(source, exc),
                                  transient=is_transient(exc) and not _hub_offline()) from exc
        raise DataSourceError(
            f"could not open dataset {source.describe()} split {source.split!r}: "
            f"{describe_error(exc)}. Check the data files.",
            transient=is_transient(exc) and not _hub_offline(),
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
    # None: the smallest local shard sets it (parquet footers, or one streaming pass over
    # text files); for Hub datasets (FineWeb: hundreds of multi-GB shards) None means
    # REMOTE_WINDOWS_PER_SHARD, read from nothing (module docstring, "Page count").
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
