"""Pages read from parquet by row group: the same documents as the `datasets` streaming
path, only the text column read, cached re-reads, pinned revisions, and start-up retries
against a real failing-then-recovering HTTP source (a loopback server).

Real pyarrow, `datasets` and fsspec on local files; nothing here is timed.
"""

from __future__ import annotations

import http.server
import json
import os
import random
import re
import threading
import time

import pytest

from dtrain.training.data import DataSource, PageReader, PageSpec
from dtrain.training.errors import DataSourceError, is_transient
from dtrain.training.parquet_pages import CountingFile, ParquetShards

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

ROWS = (230, 171, 305)  # documents per shard; none a multiple of the row group size
ROW_GROUP = 40


@pytest.fixture(scope="module")
def tokenizer():
    from dtrain.training.tokenizer import load_tokenizer

    tok, _ = load_tokenizer(allow_fallback=True, local_files_only=True)
    return tok


def _doc(rng: random.Random, shard: int, i: int):
    if i % 37 == 5:
        return None  # FineWeb has no nulls, but a reader must treat them as the streaming path does
    if i % 41 == 7:
        return ""
    words = " ".join(rng.choice(("alpha", "beta", "gamma", "delta", "page", "row")) for _ in range(rng.randint(3, 30)))
    return f"shard {shard} doc {i}: {words}."


def write_shard(path, shard: int, rows: int, row_group: int = ROW_GROUP, wide: int = 0) -> None:
    """A FineWeb-shaped parquet file: text plus the metadata columns FineWeb carries."""
    rng = random.Random(shard)
    table = pa.table({
        "text": [_doc(rng, shard, i) for i in range(rows)],
        "id": [f"<urn:uuid:{shard}-{i}>" for i in range(rows)],
        "dump": ["CC-MAIN-2024-10"] * rows,
        # `wide` random hex digits per url: a column that does not compress away
        "url": [f"https://example.org/{shard}/{i}/" + (f"{rng.getrandbits(4 * wide):x}" if wide else "")
                for i in range(rows)],
        "language_score": [0.9 + (i % 10) / 100 for i in range(rows)],
        "token_count": list(range(rows)),
    })
    pq.write_table(table, str(path), row_group_size=row_group)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("parquet")
    files = []
    for s, n in enumerate(ROWS):
        p = root / f"{s:03d}_00000.parquet"
        write_shard(p, s, n)
        files.append(str(p))
    return files


def _texts(files, shard: int, start: int, stop: int):
    return pq.read_table(files[shard], columns=["text"]).column(0).to_pylist()[start:stop]


# ------------------------------------------------------------------ same pages as streaming


@pytest.mark.parametrize("spec", [
    PageSpec(seq_len=16, page_sequences=2, docs_per_page=7),      # windows straddle row groups
    PageSpec(seq_len=32, page_sequences=3, docs_per_page=40),     # window == row group size
    PageSpec(seq_len=8, page_sequences=2, docs_per_page=9, windows_per_shard=40),  # wraps around
])
def test_parquet_pages_equal_the_streaming_pages(shards, tokenizer, spec):
    src = DataSource.local_parquet(shards)
    fast = PageReader(src, tokenizer, spec)
    slow = PageReader(src, tokenizer, spec, backend="streaming")
    assert fast._parquet_shards() is not None and slow._parquet_shards() is None
    assert fast.num_shards == slow.num_shards == 3
    assert fast.num_pages == slow.num_pages
    for page in range(fast.num_pages):
        assert fast.page_tokens(page) == slow.page_tokens(page), page


def test_local_parquet_page_count_comes_from_the_footers(shards, tokenizer):
    reader = PageReader(DataSource.local_parquet(shards), tokenizer, PageSpec(seq_len=8, page_sequences=1,
                                                                           docs_per_page=10))
    assert reader.windows_per_shard == min(ROWS) // 10
    assert reader._ds is None  # no `datasets` stream was opened to count


def test_window_spanning_two_row_groups_reads_both(shards):
    reads: list = []
    pages = ParquetShards(shards, "text", open_file=lambda f: CountingFile(f, reads))
    # rows 35..44 of shard 1: the last 5 of row group 0 and the first 5 of row group 1
    assert pages.window(1, 7, 5) + pages.window(1, 8, 5) == _texts(shards, 1, 35, 45)
    assert pages.rows(1, 35, 45) == _texts(shards, 1, 35, 45)
    assert set(pages._groups) == {(1, 0), (1, 1)}


def test_last_page_and_wrap_around(shards, tokenizer):
    d = 9
    spec = PageSpec(seq_len=8, page_sequences=2, docs_per_page=d, windows_per_shard=40)
    reader = PageReader(DataSource.local_parquet(shards), tokenizer, spec)
    pages = reader._parquet_shards()
    last = reader.num_pages - 1
    shard, window = reader.page_location(last)
    assert (shard, window) == (2, 39)
    # shard 2 has 305 rows = 33 complete windows of 9 and a partial one (rows 297..304)
    assert window * d >= ROWS[2]
    assert pages.window(shard, window, d) == _texts(shards, 2, (39 % 33) * d, (39 % 33 + 1) * d)
    assert pages.window(2, 33, d) == _texts(shards, 2, 297, 305)  # the partial tail, as it is
    assert reader.page_tokens(last) == reader.page_tokens((39 % 33) * 3 + 2)
    # the real last window of a shard needs no wrap
    assert pages.window(0, ROWS[0] // d - 1, d) == _texts(shards, 0, (ROWS[0] // d - 1) * d, (ROWS[0] // d) * d)


# ------------------------------------------------------------------ what is read


def test_only_the_text_column_of_the_needed_row_groups_is_read(tmp_path):
    path = tmp_path / "wide.parquet"
    write_shard(path, 0, 400, row_group=50, wide=2000)  # url column ~800 KB: most of the file
    size = os.path.getsize(path)
    md = pq.ParquetFile(str(path)).metadata
    text = md.schema.to_arrow_schema().get_field_index("text")

    def chunk(rg: int, col: int) -> tuple[int, int]:
        c = md.row_group(rg).column(col)
        start = min(o for o in (c.dictionary_page_offset, c.data_page_offset) if o is not None)
        return start, start + c.total_compressed_size

    reads: list = []
    pages = ParquetShards([str(path)], "text", open_file=lambda f: CountingFile(f, reads))
    assert pages.window(0, 5, 20) == _texts([str(path)], 0, 100, 120)  # row group 2 only
    footer_from = size - (64 << 10) - 8  # pyarrow's speculative footer read
    lo, hi = chunk(2, text)
    body = [(o, n) for o, n in reads if o + n <= footer_from]
    assert body, reads
    assert all(lo <= o and o + n <= hi for o, n in body), (reads, (lo, hi))
    assert sum(n for _, n in reads) < size / 4


def test_a_cached_page_does_not_touch_the_file(shards, tokenizer):
    reads: list = []
    opened: list = []

    def open_file(f):
        opened.append(f)
        return CountingFile(f, reads)

    spec = PageSpec(seq_len=16, page_sequences=2, docs_per_page=7)
    reader = PageReader(DataSource.local_parquet(shards), tokenizer, spec, open_file=open_file)
    first = reader.page_tokens(4)
    assert reads
    n_reads, n_opened = len(reads), len(opened)
    assert reader.page_tokens(4) == first
    assert len(reads) == n_reads  # the page LRU answered
    # another page of the same row group is served from the decoded row group
    reader.page_tokens(4 + reader.num_shards)
    assert len(reads) == n_reads
    assert len(opened) == n_opened  # the shard's file stays open between pages
    # without the page LRU the row-group cache still answers; without both, the file is read
    bare = PageReader(DataSource.local_parquet(shards), tokenizer, spec, open_file=open_file, cache_pages=0)
    bare.page_tokens(4)
    before = len(reads)
    assert bare.page_tokens(4) == first and len(reads) == before
    # the page cache is bounded
    small = PageReader(DataSource.local_parquet(shards), tokenizer, spec, cache_pages=2)
    for p in range(5):
        small.page_tokens(p)
    assert list(small._cache) == [3, 4]


def test_open_files_and_row_groups_are_bounded(shards):
    opened: list = []
    pages = ParquetShards(shards, "text", open_file=lambda f: opened.append(f) or f,
                          max_open_files=2, cached_row_groups=1)
    for s in range(3):
        pages.rows(s, 0, 3)
    assert len(pages._handles) == 2 and len(pages._groups) == 1
    pages.rows(0, 0, 3)  # evicted: opened again, its row counts were kept
    assert opened.count(shards[0]) == 2
    pages.close()
    assert not pages._handles


# ------------------------------------------------------------------ errors


def test_missing_text_column_names_the_columns(shards, tokenizer):
    src = DataSource.local_parquet(shards, text_field="content")
    reader = PageReader(src, tokenizer, PageSpec(seq_len=8, page_sequences=1, docs_per_page=4))
    with pytest.raises(DataSourceError, match=r"no text field 'content'; fields are \['dump', 'id', "
                                              r"'language_score', 'text', 'token_count', 'url'\]") as info:
        reader.open()
    assert info.value.transient is False
    with pytest.raises(DataSourceError, match="no text field 'content'"):
        reader.read_page(0)


def test_missing_and_corrupt_files_are_permanent_errors(tmp_path, tokenizer):
    spec = PageSpec(seq_len=8, page_sequences=1, docs_per_page=4)
    with pytest.raises(DataSourceError, match="not found") as info:
        PageReader(DataSource.local_parquet([str(tmp_path / "nope.parquet")]), tokenizer, spec).open()
    assert not info.value.transient
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not parquet at all" * 10)
    with pytest.raises(DataSourceError, match="opening shard 0") as info:
        PageReader(DataSource.local_parquet([str(bad)]), tokenizer, spec).open()
    assert not info.value.transient


def test_transient_classification():
    class ResponseError(Exception):
        def __init__(self, status):
            self.status = status

    assert is_transient(TimeoutError()) and is_transient(ConnectionResetError())
    assert not is_transient(FileNotFoundError()) and not is_transient(KeyError("text"))
    assert is_transient(ResponseError(503)) and is_transient(ResponseError(429))
    assert not is_transient(ResponseError(404))
    # fsspec raises FileNotFoundError *from* the HTTP error, whatever the status was
    try:
        try:
            raise ResponseError(502)
        except ResponseError as exc:
            raise FileNotFoundError("http://x/a.parquet") from exc
    except FileNotFoundError as outer:
        assert is_transient(outer)
    assert is_transient(type("ServerDisconnectedError", (Exception,), {})())
    assert DataSourceError("x", transient=True).transient and not DataSourceError("x").transient


# ------------------------------------------------------------------ revisions and identity


def test_dataset_revision_is_a_swarm_setting():
    from dtrain.config import Config, swarm_settings
    from dtrain.neurons.runtime import data_source_for, swarm_fingerprint

    cfg = Config()
    cfg.data.source = "fineweb"
    assert data_source_for(cfg).revision is None  # "" = the Hub's default branch
    cfg.data.dataset_revision = "v1.2.0"
    src = data_source_for(cfg)
    assert src.revision == "v1.2.0" and "at revision v1.2.0" in src.describe()
    assert swarm_settings(cfg)["data.dataset_revision"] == "v1.2.0"
    other = Config()
    other.data.source = "fineweb"
    assert swarm_fingerprint(cfg, "m") != swarm_fingerprint(other, "m")
    # for local data the Hub names are not read: a stale revision does not split a swarm
    local, local_other = Config(), Config()
    local.data.source = local_other.data.source = "local"
    local_other.data.dataset_revision = "v9"
    assert swarm_fingerprint(local, "m") == swarm_fingerprint(local_other, "m")


_SHA = {"v1": "1" * 40, "v2": "2" * 40}


class _LoopbackHub(http.server.BaseHTTPRequestHandler):
    """The few Hub endpoints `datasets` and HfFileSystem use to list and range-read a
    dataset repo's files, with two revisions: v1 holds three parquet shards, v2 two."""

    files: dict = {}  # sha -> {path in repo: bytes}
    log: list = []

    def log_message(self, *args):
        pass

    def _send(self, code, body=b"", headers=None):
        self.send_response(code)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD" and body:
            self.wfile.write(body)

    def _json(self, obj):
        self._send(200, json.dumps(obj).encode(), {"Content-Type": "application/json"})

    def _answer(self):
        type(self).log.append((self.command, self.path, self.headers.get("Range")))
        path = self.path.split("?")[0]
        m = re.match(r"^/api/datasets/([^/]+/[^/]+)/(revision|tree)/([^/]+)/?(.*)$", path)
        r = re.match(r"^/datasets/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path)
        rev = (m or r).group(2 if r else 3) if (m or r) else None
        sha = _SHA.get(rev, rev)
        files = self.files.get(sha)
        if files is None:
            return self._send(404, b'{"error": "Revision not found"}',
                              {"Content-Type": "application/json", "X-Error-Code": "RevisionNotFound"})
        if m and m.group(2) == "revision":
            return self._json({"id": m.group(1), "sha": sha, "siblings": [{"rfilename": f} for f in files]})
        if m:  # tree listing of one folder
            prefix = m.group(4).strip("/")
            entries = [{"type": "file", "path": f, "size": len(d), "oid": "0" * 40}
                       for f, d in files.items() if os.path.dirname(f) == prefix]
            if not prefix:
                entries += [{"type": "directory", "path": d, "oid": "0" * 40}
                            for d in sorted({f.split("/")[0] for f in files if "/" in f})]
            return self._json(entries)
        if r and r.group(3) in files:
            data = files[r.group(3)]
            headers = {"Accept-Ranges": "bytes", "X-Repo-Commit": sha, "ETag": '"0"'}
            rng = re.match(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
            if rng:
                a = int(rng.group(1))
                b = min(int(rng.group(2)) if rng.group(2) else len(data) - 1, len(data) - 1)
                headers["Content-Range"] = f"bytes {a}-{b}/{len(data)}"
                return self._send(206, data[a:b + 1], headers)
            return self._send(200, data, headers)
        self._send(404, b'{"error": "Entry not found"}',
                   {"Content-Type": "application/json", "X-Error-Code": "EntryNotFound"})

    do_GET = do_HEAD = do_POST = _answer


_HUB_CHILD = """
import json, sys
from dtrain.training.data import DataSource, PageReader, PageSpec
from dtrain.training.tokenizer import load_fallback_tokenizer
tok = load_fallback_tokenizer()
out = {}
for rev in ("v1", "v2"):
    reader = PageReader(DataSource(path="org/fineweb-like", name=None, revision=rev), tok,
                        PageSpec(seq_len=16, page_sequences=2, docs_per_page=7, windows_per_shard=30)).open()
    out[rev] = {"files": reader._parquet.files, "num_pages": reader.num_pages,
                "pages": {p: reader.page_tokens(p) for p in (0, 4, reader.num_pages - 1)}}
# the streaming path (load_dataset(..., revision=v1, streaming=True)) agrees with the row-group reader
slow = PageReader(DataSource(path="org/fineweb-like", name=None, revision="v1"), tok,
                  PageSpec(seq_len=16, page_sequences=2, docs_per_page=7, windows_per_shard=30), backend="streaming")
out["streaming_agrees"] = slow.num_shards == 3 and all(
    slow.page_tokens(int(p)) == t for p, t in out["v1"]["pages"].items())
print(json.dumps(out))
"""


def test_revision_pins_the_hub_files_and_pages_come_by_byte_range(shards, tmp_path):
    """A loopback Hub (HF_ENDPOINT): the revision reaches `datasets`' file listing, the
    listed hf:// files are read through HfFileSystem, and the pages equal the local ones."""
    import subprocess
    import sys

    from dtrain.training.tokenizer import load_fallback_tokenizer

    blobs = [open(f, "rb").read() for f in shards]
    handler = type("Hub", (_LoopbackHub,), {"log": [], "files": {
        _SHA["v1"]: {f"data/train-{i:05d}.parquet": b for i, b in enumerate(blobs)},
        _SHA["v2"]: {f"data/train-{i:05d}.parquet": b for i, b in enumerate(blobs[:2])},
    }})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env = {**os.environ, "HF_ENDPOINT": f"http://127.0.0.1:{server.server_address[1]}",
               "HF_HOME": str(tmp_path / "hf"), "HF_HUB_DISABLE_XET": "1", "HF_HUB_OFFLINE": "0",
               "HF_DATASETS_OFFLINE": "0", "HF_HUB_DISABLE_TELEMETRY": "1"}
        out = subprocess.run([sys.executable, "-c", _HUB_CHILD], env=env, capture_output=True, text=True,
                             timeout=300)
    finally:
        server.shutdown()
        server.server_close()
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["v1"]["files"] == [f"hf://datasets/org/fineweb-like@{_SHA['v1']}/data/train-{i:05d}.parquet"
                                  for i in range(3)]
    assert [f.split("@")[1][:40] for f in got["v2"]["files"]] == [_SHA["v2"]] * 2
    assert (got["v1"]["num_pages"], got["v2"]["num_pages"]) == (3 * 30, 2 * 30)
    assert got["streaming_agrees"]
    assert any(path.startswith("/api/datasets/org/fineweb-like/revision/v1") for _, path, _ in handler.log)
    # pages read by byte range from the loopback Hub equal the pages of the same local files
    tok = load_fallback_tokenizer()
    local = PageReader(DataSource.local_parquet(shards), tok,
                       PageSpec(seq_len=16, page_sequences=2, docs_per_page=7, windows_per_shard=30))
    for page, tokens in got["v1"]["pages"].items():
        assert tokens == local.page_tokens(int(page)), page
    # the parquet files were fetched by byte range only, never whole
    parquet_gets = [(p, rng) for m, p, rng in handler.log if m == "GET" and p.endswith(".parquet")]
    assert parquet_gets and all(rng for _, rng in parquet_gets), parquet_gets


def test_local_parquet_directory_and_its_identity(tmp_path):
    from dtrain.config import Config
    from dtrain.neurons.runtime import NeuronError, data_source_for, swarm_fingerprint

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    write_shard(a / "000.parquet", 0, 50)
    write_shard(b / "000.parquet", 0, 60)
    cfg_a, cfg_b = Config(), Config()
    cfg_a.data.source = cfg_b.data.source = "local"
    cfg_a.data.local_path, cfg_b.data.local_path = str(a), str(b)
    src = data_source_for(cfg_a)
    assert src.is_parquet_files and src.data_files == (str(a / "000.parquet"),)
    assert data_source_for(cfg_a).identity() == [["000.parquet", os.path.getsize(a / "000.parquet")]]
    # same config, other files: told apart; same files: the same swarm
    assert swarm_fingerprint(cfg_a, "m") != swarm_fingerprint(cfg_b, "m")
    assert swarm_fingerprint(cfg_a, "m") == swarm_fingerprint(cfg_a, "m")
    (a / "notes.txt").write_text("x\n")
    with pytest.raises(NeuronError, match="both"):
        data_source_for(cfg_a)


# ------------------------------------------------------------------ start-up retries over HTTP


class _FlakyServer(http.server.BaseHTTPRequestHandler):
    """Serves files with Range support; the first ``fail`` requests get ``status``."""

    root = "."
    fail = 0
    status = 503
    hits = 0

    def log_message(self, *args):  # keep pytest's output clean
        pass

    def _answer(self, body: bool) -> None:
        cls = type(self)
        cls.hits += 1
        if cls.hits <= cls.fail:
            self.send_response(cls.status)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        path = os.path.join(cls.root, self.path.lstrip("/"))
        if not os.path.isfile(path):
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        with open(path, "rb") as f:
            data = f.read()
        m = re.match(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        if m:
            a = int(m.group(1))
            b = min(int(m.group(2)) if m.group(2) else len(data) - 1, len(data) - 1)
            chunk = data[a:b + 1]
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {a}-{b}/{len(data)}")
        else:
            chunk = data
            self.send_response(200)
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(len(chunk)))
        self.end_headers()
        if body:
            self.wfile.write(chunk)

    def do_GET(self):
        self._answer(True)

    def do_HEAD(self):
        self._answer(False)


@pytest.fixture
def flaky(shards):
    handler = type("Handler", (_FlakyServer,), {"root": os.path.dirname(shards[0]), "fail": 0, "hits": 0})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield handler, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_startup_retries_a_failing_source_until_it_recovers(shards, tokenizer, flaky):
    from dtrain.neurons.runtime import retry_data

    handler, base = flaky
    handler.fail, handler.status = 5, 503
    urls = [f"{base}/{os.path.basename(f)}" for f in shards]
    spec = PageSpec(seq_len=16, page_sequences=2, docs_per_page=7)
    reader = PageReader(DataSource.local_parquet(urls), tokenizer, spec)
    retries = []
    ok, _ = retry_data(reader.open, stop=threading.Event(), on_retry=lambda e, n, w: retries.append((e, n)),
                       base_delay=0.01, max_delay=0.05)
    assert ok
    assert retries and all(isinstance(e, DataSourceError) and e.transient for e, _ in retries)
    assert handler.hits > handler.fail
    # what came over HTTP is what the local files hold
    local = PageReader(DataSource.local_parquet(shards), tokenizer, spec)
    assert reader.num_pages == local.num_pages
    assert reader.page_tokens(reader.num_pages - 1) == local.page_tokens(local.num_pages - 1)


def test_startup_fails_fast_on_a_permanent_error(tokenizer, flaky):
    from dtrain.neurons.runtime import retry_data

    handler, base = flaky
    reader = PageReader(DataSource.local_parquet([f"{base}/missing.parquet"]), tokenizer, PageSpec())
    retries = []
    with pytest.raises(DataSourceError) as info:
        retry_data(reader.open, stop=threading.Event(), on_retry=lambda *a: retries.append(a), base_delay=0.01)
    assert not info.value.transient and "missing.parquet" in str(info.value)
    assert retries == []


def test_startup_retry_honours_the_stop_event(shards, tokenizer, flaky):
    from dtrain.neurons.runtime import retry_data

    handler, base = flaky
    handler.fail, handler.status = 10**9, 502  # never recovers
    reader = PageReader(DataSource.local_parquet([f"{base}/{os.path.basename(shards[0])}"]), tokenizer, PageSpec())
    stop = threading.Event()
    threading.Timer(0.5, stop.set).start()
    started = time.monotonic()
    # every wait is at least 30 s (60 s, half of it jitter): returning well before that
    # shows the wait itself ends on stop, not only the next attempt
    assert retry_data(reader.open, stop=stop, base_delay=60.0, max_delay=60.0) == (False, None)
    assert time.monotonic() - started < 25


def test_a_neuron_waits_for_its_data_and_reports_each_retry(shards, tokenizer, flaky):
    from dtrain.config import Config
    from dtrain.neurons.base import NeuronBase
    from dtrain.telemetry import Telemetry

    handler, base = flaky
    handler.fail, handler.status = 3, 503
    reader = PageReader(DataSource.local_parquet([f"{base}/{os.path.basename(shards[1])}"]), tokenizer,
                        PageSpec(seq_len=16, page_sequences=2, docs_per_page=7))
    neuron = NeuronBase(Config(), Telemetry("miner"), threading.Event())
    ok, pages = neuron._with_input_retries(lambda: reader.open().num_pages, "opening the dataset", base_delay=0.01)
    assert ok and pages == ROWS[1] // 7
    events = neuron.tel.snapshot().events
    assert any("opening the dataset" in e and "retrying in" in e and "503" in e for e in events), events
    neuron.stop.set()  # stopped before the data came: (False, None), nothing raised
    assert neuron._with_input_retries(reader.open, "opening the dataset") == (False, None)
