"""Page assignment (pure, disjoint, reproducible) and real `datasets` streaming from local files."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dtrain.training.data import DataSource, PageReader, PageSpec, assign_pages
from dtrain.training.errors import DataSourceError
from dtrain.training.permutation import permute


@pytest.fixture(scope="module")
def tokenizer():
    from dtrain.training.tokenizer import load_tokenizer

    tok, info = load_tokenizer(allow_fallback=True, local_files_only=True)
    return tok


def test_assignment_is_deterministic_and_depends_on_every_input():
    base = dict(run_id="run-a", uid=3, epoch=2, page_counter=10, num_pages=1_000_003, count=4)
    first = assign_pages(**base)
    assert first == assign_pages(**base)
    assert len(first) == 4 and all(0 <= p < base["num_pages"] for p in first)
    for change in ({"run_id": "run-b"}, {"uid": 4}, {"epoch": 3}, {"page_counter": 11}, {"nonce": "abc"}):
        assert assign_pages(**{**base, **change}) != first, change
    # consecutive counters are a sliding window of the same sequence
    assert assign_pages(**{**base, "page_counter": 11, "count": 3}) == first[1:]


def test_assignment_disjoint_across_miners_within_an_epoch():
    num_pages = 500_000
    seen: dict[int, tuple[int, int]] = {}
    for uid in range(64):
        for page_i, page in enumerate(assign_pages(run_id="r", uid=uid, epoch=7, page_counter=0,
                                                    num_pages=num_pages, count=100)):
            assert page not in seen, f"uid {uid} counter {page_i} collides with {seen[page]}"
            seen[page] = (uid, page_i)
    assert len(seen) == 6400


def test_small_page_space_is_shared_out_evenly():
    # sandbox: 4 miners, 488 pages, max_uids = number of miners -> a full cover, no overlap
    pages = [p for uid in range(4)
             for p in assign_pages(run_id="s", uid=uid, epoch=0, page_counter=0, num_pages=488, count=122, max_uids=4)]
    assert sorted(pages) == list(range(488))


def test_permutation_is_a_bijection():
    key = b"k" * 32
    for domain in (1, 2, 7, 1000, 4097):
        assert sorted(permute(i, domain, key) for i in range(domain)) == list(range(domain))
    assert [permute(i, 1000, key) for i in range(20)] != list(range(20))


def test_assignment_rejects_bad_arguments():
    with pytest.raises(ValueError):
        assign_pages(run_id="r", uid=256, epoch=0, page_counter=0, num_pages=10)
    with pytest.raises(ValueError):
        assign_pages(run_id="r", uid=0, epoch=0, page_counter=-1, num_pages=10)


def _write_shards(tmp_path, n_files=3, lines=40):
    files = []
    for f in range(n_files):
        p = tmp_path / f"shard{f}.txt"
        p.write_text("".join(f"file {f} line {i} says hello to the reader.\n" for i in range(lines)))
        files.append(str(p))
    return files


def test_local_text_files_stream_through_datasets(tmp_path, tokenizer):
    files = _write_shards(tmp_path)
    spec = PageSpec(seq_len=16, page_sequences=2, docs_per_page=5)
    reader = PageReader(DataSource.local_text(files), tokenizer, spec)
    assert reader.num_shards == 3
    assert reader.windows_per_shard == 8  # 40 lines / 5 docs per window
    assert reader.num_pages == 24
    page = 7  # shard 1, window 2 -> lines 10..14 of shard1.txt
    assert reader.page_location(page) == (1, 2)
    x = reader.read_page(page)
    assert x.shape == (2, 16) and x.dtype.is_floating_point is False
    text = tokenizer.decode(x.reshape(-1).tolist())
    assert text.startswith("file 1 line 10 says hello")
    assert "file 1 line 11" in text and "file 0" not in text and "line 9 " not in text
    # documents are separated by the EOS token
    assert tokenizer.eos_token_id in x.reshape(-1).tolist()
    # reading again gives the same tensor
    assert x.equal(reader.read_page(page))
    batch = reader.read_pages([0, page])
    assert batch.shape == (4, 16) and batch[2:].equal(x)


def test_remote_source_never_counts_its_shards(tokenizer):
    from dtrain.training.data import REMOTE_WINDOWS_PER_SHARD

    # counting FineWeb's shards would stream the whole dataset; the default is fixed instead
    reader = PageReader(DataSource.fineweb(), tokenizer, PageSpec())
    assert reader.windows_per_shard == REMOTE_WINDOWS_PER_SHARD
    assert reader._ds is None  # nothing was opened
    assert PageReader(DataSource.fineweb(), tokenizer, PageSpec(windows_per_shard=7)).windows_per_shard == 7


def test_short_window_is_repeated_to_fill_the_page(tmp_path, tokenizer):
    p = tmp_path / "one.txt"
    p.write_text("alpha beta\n")
    reader = PageReader(DataSource.local_text([str(p)]), tokenizer, PageSpec(seq_len=8, page_sequences=2, docs_per_page=4))
    flat = reader.read_page(0).reshape(-1).tolist()
    one = tokenizer("alpha beta", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert flat == (one * 16)[:16]


def test_missing_files_and_wrong_field_are_clear_errors(tmp_path, tokenizer):
    with pytest.raises(DataSourceError, match="not found"):
        PageReader(DataSource.local_text([str(tmp_path / "nope.txt")]), tokenizer, PageSpec()).read_page(0)
    files = _write_shards(tmp_path, n_files=1, lines=10)
    src = DataSource(path="text", name=None, data_files=tuple(files), text_field="content")
    with pytest.raises(DataSourceError, match="no text field 'content'"):
        PageReader(src, tokenizer, PageSpec(seq_len=8, page_sequences=1, docs_per_page=2)).read_page(0)


@pytest.mark.parametrize("opener", ["open_stream(src)", "resolve_data_files(src)"])
def test_an_offline_hub_dataset_names_the_dataset_the_setting_and_the_local_way_out(opener):
    # HF_HUB_OFFLINE makes the real datasets path fail at once instead of retrying
    code = (
        "from dtrain.training.data import DataSource\n"
        "from dtrain.training.sources import open_stream, resolve_data_files\n"
        "from dtrain.training.errors import DataSourceError\n"
        "src = DataSource(path='no-such-org/no-such-dataset', name='x')\n"
        f"try:\n    {opener}\n"
        "except DataSourceError as e:\n    print('ERR', e.transient, e)\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "ERR False could not open the dataset data.dataset = 'no-such-org/no-such-dataset' (config 'x')" \
        in out.stdout, out.stdout + out.stderr
    assert "HF_HUB_OFFLINE" in out.stdout and 'data.source = "local"' in out.stdout


_REBUILD = """
import json, sys
from dtrain.training.data import DataSource, PageReader, PageSpec, assign_pages
from dtrain.training.tokenizer import load_tokenizer
tok, _ = load_tokenizer(allow_fallback=True, local_files_only=True)
reader = PageReader(DataSource.shipped(), tok, PageSpec(seq_len=32, page_sequences=2, docs_per_page=16))
pages = assign_pages(run_id="run-x", uid=5, epoch=1, page_counter=3, num_pages=reader.num_pages, count=2, nonce="n0")
print(json.dumps({"pages": pages, "tokens": reader.read_pages(pages).tolist()}))
"""


def test_second_process_rebuilds_the_same_batch(tokenizer):
    reader = PageReader(DataSource.shipped(), tokenizer, PageSpec(seq_len=32, page_sequences=2, docs_per_page=16))
    pages = assign_pages(run_id="run-x", uid=5, epoch=1, page_counter=3, num_pages=reader.num_pages, count=2, nonce="n0")
    mine = reader.read_pages(pages).tolist()
    out = subprocess.run([sys.executable, "-c", _REBUILD], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    theirs = json.loads(out.stdout.strip().splitlines()[-1])
    assert theirs["pages"] == pages
    assert theirs["tokens"] == mine
