"""Tensors moved to disk while they are not used, and back before they are: their memory is free
meanwhile (the seeds' optimizer offloading; docs/operators.md, "Memory per parameter").

A DiLoCo miner holds two trainers: the anchor (the shared replica) with its outer momentum, used
once a round, and the inner copy with its AdamW moments, idle while the round averages. Each is
moved out while idle. The tensors keep their objects, shapes and dtypes; only their storage is
emptied (``resize_(0)``) and refilled from the file, bit for bit. A CPU-only mechanism: tensors
on an accelerator are left where they are (host memory is what runs short there).
"""

from __future__ import annotations

import ctypes
import os
import tempfile
from typing import Sequence

import torch


class Offload:
    """Tensors written to an unlinked file under ``directory`` and emptied (``set_`` to no
    storage, so their memory is freed whoever exported it); :meth:`restore` puts each back, the
    same object with the same bytes. Gone with the process (nothing to clean up after a crash)."""

    def __init__(self, directory: str, tensors: Sequence[torch.Tensor]):
        os.makedirs(directory, exist_ok=True)
        self._file = tempfile.TemporaryFile(dir=directory)
        # per storage: (file offset, bytes, [(tensor, storage offset, size, stride)])
        self._storages: dict[int, tuple[int, int, list]] = {}
        at = 0
        for t in tensors:
            storage = t.untyped_storage()
            if t.device.type != "cpu" or storage.nbytes() == 0:
                continue
            key = storage.data_ptr()
            if key not in self._storages:
                self._file.write(_raw(storage.data_ptr(), storage.nbytes()))
                self._storages[key] = (at, storage.nbytes(), [])
                at += storage.nbytes()
            views = self._storages[key][2]
            if not any(v[0] is t for v in views):
                views.append((t, t.storage_offset(), t.size(), t.stride()))
        self._file.flush()
        with torch.no_grad():  # only once all is on disk: a failed write leaves them as they were
            for _, _, views in self._storages.values():
                for t, _, _, _ in views:
                    t.set_(torch.empty(0, dtype=t.dtype))
        self.nbytes = at

    def restore(self) -> None:
        """Put every tensor back from the file (the same bytes); the file is closed."""
        fd = self._file.fileno()
        with torch.no_grad():
            for offset, nbytes, views in self._storages.values():
                storage = torch.empty(nbytes, dtype=torch.uint8).untyped_storage()
                got = os.preadv(fd, [_raw(storage.data_ptr(), nbytes)], offset)
                if got != nbytes:
                    raise OSError(f"offloaded tensor file ends early ({got} of {nbytes} bytes)")
                for t, storage_offset, size, stride in views:
                    t.set_(storage, storage_offset, size, stride)
        self._file.close()
        self._storages = {}


def _raw(address: int, nbytes: int) -> memoryview:
    """``nbytes`` of memory at ``address`` as a writable byte view."""
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")
