"""Windows of documents read straight from parquet files, by row group.

A parquet footer records the rows of every row group, so a window maps to the one or two row
groups holding it and only their text column is read: a page costs the same wherever it lies
in its shard, local or remote (``hf://`` through HfFileSystem, any fsspec URL). It returns
exactly the documents the streaming path does (tests/test_training_parquet.py). Open files,
footers and decoded row groups are kept in bounded LRUs; docs/training.md ("Data") has the
details. pyarrow is imported lazily: ``dtrain --help`` must not pay for it.
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections import OrderedDict
from typing import Any, Callable, Sequence

from dtrain.training.errors import DataSourceError, describe_error, is_transient

log = logging.getLogger(__name__)

# Read-ahead of remote file objects. pyarrow asks for whole column chunks in one read,
# so a large block only adds waste at the end of each request; the footer is read in
# two small requests.
REMOTE_BLOCK_SIZE = 1 << 20


def default_open_file(url: str) -> Any:
    """What pyarrow reads a shard from: a local path as is (native, memory-mapped-free
    reads of the needed ranges), ``hf://`` through HfFileSystem (honours HF_ENDPOINT and
    the token), any other URL through fsspec."""
    if "://" not in url:
        return url
    if url.startswith("hf://"):
        from huggingface_hub import HfFileSystem

        return HfFileSystem().open(url[len("hf://"):], "rb", block_size=REMOTE_BLOCK_SIZE)
    import fsspec

    return fsspec.open(url, "rb", block_size=REMOTE_BLOCK_SIZE).open()


class ParquetShards:
    """Random access to windows of documents of parquet shards (one shard per file)."""

    def __init__(self, files: Sequence[str], text_field: str, *, describe: str = "",
                 open_file: Callable[[str], Any] | None = None, max_open_files: int = 16,
                 cached_row_groups: int = 4):
        if not files:
            raise DataSourceError(f"{describe or 'parquet source'} has no data files")
        self.files = list(files)
        self.text_field = text_field
        self.describe = describe or f"{len(self.files)} parquet file(s)"
        self._open_file = open_file or default_open_file
        self._max_open = max(1, max_open_files)
        self._max_groups = max(1, cached_row_groups)
        self._handles: OrderedDict[int, Any] = OrderedDict()  # shard -> pq.ParquetFile
        self._starts: dict[int, list[int]] = {}  # shard -> first row of each row group, then the total
        self._groups: OrderedDict[tuple[int, int], Any] = OrderedDict()  # (shard, group) -> pa.ChunkedArray
        self._checked_field = False
        # pyarrow must not read one file object from two threads at once (a Train job and
        # the training loop can both want pages); one lock also keeps the LRUs consistent.
        self._lock = threading.RLock()

    @property
    def n_shards(self) -> int:
        return len(self.files)

    # ------------------------------------------------------------------ files

    def _fail(self, shard: int, exc: BaseException, doing: str) -> DataSourceError:
        # A failed handle may be half-read (a dropped connection): reopen it next time.
        self._close(shard)
        return DataSourceError(
            f"{doing} shard {shard} ({self.files[shard]}) of {self.describe} failed: "
            f"{describe_error(exc)}", transient=is_transient(exc))

    def _close(self, shard: int) -> None:
        pf = self._handles.pop(shard, None)
        if pf is not None:
            try:
                pf.close(force=True)  # force: also close a file object we opened for it
            except Exception:  # closing a broken remote handle can raise again; nothing to keep
                pass

    def _handle(self, shard: int):
        pf = self._handles.get(shard)
        if pf is not None:
            self._handles.move_to_end(shard)
            return pf
        import pyarrow.parquet as pq

        src = None
        try:
            src = self._open_file(self.files[shard])
            pf = pq.ParquetFile(src)
        except Exception as exc:
            if hasattr(src, "close"):
                src.close()
            raise self._fail(shard, exc, "opening") from exc
        if shard not in self._starts:
            md = pf.metadata
            starts = [0]
            for i in range(md.num_row_groups):
                starts.append(starts[-1] + md.row_group(i).num_rows)
            self._starts[shard] = starts
        if not self._checked_field:
            names = pf.schema_arrow.names
            if self.text_field not in names:
                pf.close(force=True)
                raise DataSourceError(f"{self.describe} has no text field {self.text_field!r}; fields are "
                                      f"{sorted(names)} (shard {shard}: {self.files[shard]})")
            self._checked_field = True
        self._handles[shard] = pf
        while len(self._handles) > self._max_open:
            self._close(next(iter(self._handles)))
        return pf

    def num_rows(self, shard: int) -> int:
        """Rows of a shard, from its footer (read once, then remembered)."""
        with self._lock:
            if shard not in self._starts:
                self._handle(shard)
            return self._starts[shard][-1]

    def check(self) -> None:
        """Open the first shard: the file exists, is parquet and has the text field."""
        with self._lock:
            self._handle(0)

    # ------------------------------------------------------------------ rows

    def _row_group(self, shard: int, group: int):
        key = (shard, group)
        col = self._groups.get(key)
        if col is not None:
            self._groups.move_to_end(key)
            return col
        pf = self._handle(shard)
        try:
            col = pf.read_row_group(group, columns=[self.text_field], use_threads=False).column(0)
        except Exception as exc:
            raise self._fail(shard, exc, "reading") from exc
        self._groups[key] = col
        while len(self._groups) > self._max_groups:
            self._groups.popitem(last=False)
        return col

    def rows(self, shard: int, start: int, stop: int) -> list:
        """Text of rows [start, stop) of a shard (clipped to its end)."""
        with self._lock:
            self.num_rows(shard)
            starts = self._starts[shard]
            stop = min(stop, starts[-1])
            out: list = []
            row = start
            while row < stop:
                # the row group holding `row`: the last one that starts at or before it
                group = bisect.bisect_right(starts, row) - 1
                col = self._row_group(shard, group)
                lo, hi = row - starts[group], min(stop, starts[group + 1]) - starts[group]
                out.extend(col.slice(lo, hi - lo).to_pylist())
                row = starts[group] + hi
            return out

    def window(self, shard: int, window: int, docs: int) -> list:
        """The documents of window ``window`` of a shard, as the streaming path defines it:
        rows ``[window * docs, (window + 1) * docs)``, the partial tail as it is, and a window
        that starts past the end wrapped around the shard's complete windows."""
        n = self.num_rows(shard)
        if window * docs >= n and window > 0:
            complete = max(1, n // docs) if n else 0
            if complete == 0:
                raise DataSourceError(f"shard {shard} of {self.describe} is empty")
            log.debug("window %d beyond shard %d (%d windows); wrapping", window, shard, complete)
            window %= complete
        return self.rows(shard, window * docs, (window + 1) * docs)

    def close(self) -> None:
        with self._lock:
            for shard in list(self._handles):
                self._close(shard)
            self._groups.clear()


class CountingFile:
    """A read-only file that records every read as (offset, bytes): what pyarrow really
    fetched. The benchmark reports bytes per page with it; tests check that a cached page
    reads nothing and that only the text column's byte ranges are read."""

    def __init__(self, path: str, reads: list | None = None):
        self._f = open(path, "rb")
        self.reads: list[tuple[int, int]] = reads if reads is not None else []

    def read(self, n: int = -1) -> bytes:
        pos = self._f.tell()
        data = self._f.read(n)
        self.reads.append((pos, len(data)))
        return data

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()

    def close(self) -> None:
        self._f.close()

    @property
    def closed(self) -> bool:
        return self._f.closed

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def writable(self) -> bool:
        return False
