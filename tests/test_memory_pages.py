"""What a neuron gives back (dtrain/swarm/memory_pages.py, docs/operators.md "Memory"): a forked
hivemind process drops the neuron's tensors it inherited, the round buffers' pages are freed
between rounds, and the averager keeps what it sent on disk, answering the same questions.

Measured on real processes: a real fork, a child's own /proc Pss, a shared-memory tensor's
RssShmem. Linux only (madvise and /proc)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from dtrain.procmem import process_sample
from dtrain.swarm import memory_pages
from dtrain.swarm.averaging.contribution import PartLayout, compute_claims
from dtrain.swarm.averaging.kept import SentContribution
from dtrain.swarm.wire import make_compression

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and /proc are Linux's")

MB = 1 << 20


def _child_pss_after_parent_writes(release: bool) -> int:
    """Fork with a 64 MiB private tensor noted, let the parent rewrite it (as training does),
    and return the child's Pss (bytes) once the child released (or not) what it inherited."""
    big = torch.ones(64 * MB // 4)
    memory_pages.note_private_tensors()
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: release, say so, then wait to be measured
        if release:
            memory_pages.release_inherited_tensors()
        os.write(ready_w, b"x")
        os.read(go_r, 1)
        os._exit(0)
    try:
        os.read(ready_r, 1)
        big.mul_(2.0)  # every page written: copy-on-write leaves the child the old ones
        return process_sample(pid)["pss"]
    finally:
        os.write(go_w, b"x")
        os.waitpid(pid, 0)
        for fd in (ready_r, ready_w, go_r, go_w):
            os.close(fd)


def test_a_forked_child_drops_the_tensors_it_inherited():
    kept = _child_pss_after_parent_writes(release=False)
    dropped = _child_pss_after_parent_writes(release=True)
    # without the release the child holds the parent's old 64 MiB; with it, not
    assert kept - dropped > 48 * MB, (kept, dropped)


def test_only_large_private_cpu_tensors_are_noted():
    small = torch.ones(1024)  # noqa: F841 - alive while noting
    big = torch.ones(4 * MB // 4)
    shared = torch.ones(4 * MB // 4).share_memory_()
    memory_pages.note_private_tensors()
    starts = [start for start, _ in memory_pages._noted]
    ptr = big.untyped_storage().data_ptr()
    assert any(ptr <= s < ptr + big.untyped_storage().nbytes() for s in starts)
    sptr = shared.untyped_storage().data_ptr()
    assert not any(sptr <= s < sptr + shared.untyped_storage().nbytes() for s in starts)
    assert all(length % memory_pages.mmap.PAGESIZE == 0 and start % memory_pages.mmap.PAGESIZE == 0
               for start, length in memory_pages._noted)


def _rss_shmem() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("RssShmem:"):
            return int(line.split()[1]) * 1024
    return 0


def test_freeing_round_buffers_gives_their_memory_back_and_they_refill():
    buf = torch.ones(32 * MB // 4).share_memory_()
    private = torch.ones(8)
    before = _rss_shmem()
    assert 32 * MB - 2 * memory_pages.mmap.PAGESIZE <= memory_pages.free_shared_tensors([buf, private]) <= 32 * MB
    assert before - _rss_shmem() >= 30 * MB
    # shared: zeros now (all but a partial first and last page); private: untouched
    assert not bool(buf[2048:-2048].any()) and bool(private.all())
    buf.fill_(3.0)  # the next contribution brings the pages back
    assert float(buf[-1]) == 3.0 and _rss_shmem() >= before - MB


@pytest.mark.parametrize("codec", ["none", "8bit"])
def test_a_contribution_kept_on_disk_answers_as_the_one_in_memory(tmp_path, codec):
    torch.manual_seed(1)
    tensors = [torch.randn(300, 70), torch.randn(5000)]
    compression = make_compression(codec)
    layout = PartLayout.of(tensors, compression, 4096)
    on_disk = SentContribution.keep(tensors, layout, compression, directory=str(tmp_path / "kept"), round_id="ab")
    in_memory = SentContribution.keep(tensors, layout, compression)
    assert on_disk.file is not None and on_disk.tensors == [] and in_memory.file is None
    for t in tensors:
        t.mul_(0.0)  # averaged in place afterwards: the kept copies must not change
    nonce = "round-seed"
    assert (on_disk.sketches(nonce) == in_memory.sketches(nonce)).all()
    assert (on_disk.sketches(nonce) == compute_claims(in_memory.tensors, layout, nonce, compression)).all()
    assert all(on_disk.wire(g) == in_memory.wire(g) for g in range(len(layout)))
    assert os.listdir(tmp_path / "kept") == []  # an unlinked file: nothing is left behind


def test_a_contribution_that_cannot_go_to_disk_stays_in_memory(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    tensors = [torch.randn(100)]
    compression = make_compression("none")
    kept = SentContribution.keep(tensors, PartLayout.of(tensors, compression, 4096), compression,
                                 directory=str(blocker / "kept"))
    assert kept.file is None and torch.equal(kept.tensors[0], tensors[0])
