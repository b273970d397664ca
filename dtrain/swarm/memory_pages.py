"""Memory pages a neuron gives back: what hivemind's forked processes inherit, and the round
buffers between rounds.

hivemind's DHT and averager are forked from the neuron, so each starts with a copy-on-write view
of the neuron's whole heap: the model, its gradients and optimizer state. They never read those,
but every page the neuron writes afterwards (each training step) leaves the child holding the old
copy, and a tensor the neuron frees stays whole in the child. Measured at gpt2-124m in DiLoCo, the
DHT process grew to 1.08 GB and the averager to 2.0 GB this way (docs/operators.md, "Memory").

The rule: just before the fork, note where the neuron's large private tensors live; the child's
first act is to drop those pages (``madvise(MADV_DONTNEED)``). Dropped private anonymous memory
reads back as zeros if ever touched, so a child that did touch one would see zeros, not crash;
shared-memory tensors (the averaged buffers the averager does use) are never noted.

The round buffers (shared memory, 4 bytes per parameter) hold nothing once a round's average is
applied; their pages are removed until the next contribution is written (``free_shared_tensors``).
"""

from __future__ import annotations

import ctypes
import gc
import logging
import mmap
import sys

log = logging.getLogger(__name__)

# Tensors smaller than this are not worth a system call (and share pages with other objects).
MIN_TENSOR_BYTES = 1 << 20
MADV_DONTNEED = 4  # Linux: drop this process's pages (private memory reads back as zeros)
MADV_REMOVE = 9  # Linux: free a shared-memory range's backing pages (they read back as zeros)

# (start, length) page ranges noted before the last fork; a forked child inherits this list.
_noted: list[tuple[int, int]] = []


def note_private_tensors() -> int:
    """Note the page-aligned ranges of every large private CPU tensor storage (deduplicated);
    returns the bytes noted. Called in the parent just before it forks a hivemind process."""
    global _noted
    if not sys.platform.startswith("linux") or "torch" not in sys.modules:
        _noted = []
        return 0
    import torch

    ranges: dict[int, int] = {}
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.Tensor):  # type(): some module proxies warn on __class__
            continue
        for t in (obj, getattr(obj, "grad", None) if isinstance(obj, torch.nn.Parameter) else None):
            if t is None or t.device.type != "cpu" or t.is_shared():
                continue
            try:
                storage = t.untyped_storage()
                ptr, nbytes = storage.data_ptr(), storage.nbytes()
            except (RuntimeError, NotImplementedError):  # meta / sparse tensors have no plain storage
                continue
            if nbytes < MIN_TENSOR_BYTES or ptr == 0:
                continue
            start, length = _whole_pages(ptr, nbytes)
            if length:
                ranges[start] = max(ranges.get(start, 0), length)
    _noted = sorted(ranges.items())
    return sum(length for _, length in _noted)


def _whole_pages(ptr: int, nbytes: int) -> tuple[int, int]:
    """(start, length) of the whole pages inside ``[ptr, ptr + nbytes)``: a neighbour's bytes
    on a shared first or last page are never touched."""
    page = mmap.PAGESIZE
    start = (ptr + page - 1) // page * page
    end = (ptr + nbytes) // page * page
    return start, max(0, end - start)


def release_inherited_tensors() -> int:
    """In a forked child: drop the pages the parent noted; returns the bytes released. A failure
    is only logged: the child works with or without them."""
    return _advise(_noted, MADV_DONTNEED)


def free_shared_tensors(tensors) -> int:
    """Free the backing pages of shared-memory CPU tensors (their values become zeros, in every
    process that maps them); returns the bytes freed. The caller holds them, unused until it
    writes them again. Private tensors are left alone (MADV_REMOVE is for shared memory)."""
    if not sys.platform.startswith("linux"):
        return 0
    ranges = []
    for t in tensors:
        if t.device.type == "cpu" and t.is_shared():
            storage = t.untyped_storage()
            start, length = _whole_pages(storage.data_ptr(), storage.nbytes())
            if length:
                ranges.append((start, length))
    return _advise(ranges, MADV_REMOVE)


def _advise(ranges, advice: int) -> int:
    """madvise each (start, length); the bytes it succeeded for. Failures are only logged."""
    if not ranges:
        return 0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError as exc:
        log.debug("swarm: no libc for madvise: %r", exc)
        return 0
    done = 0
    for start, length in ranges:
        if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), ctypes.c_int(advice)) == 0:
            done += length
        else:
            log.debug("swarm: madvise(%d) failed (errno %d)", advice, ctypes.get_errno())
    return done

