"""A peer's state for peers catching up, over dtrain's own ``state`` protocol (no hivemind averager).

A peer that shares its state announces it on the DHT under ``<prefix>_state`` (subkey: its peer
id, value: its priority, the neurons' epoch), refreshed while it runs. A peer catching up reads
that key and asks the peers in order of priority, highest first, until one serves it.

Frames of ``state`` (dtrain.swarm.transport): the asker sends ``ASK`` (empty); the server answers
``META`` (msgpack ``{"meta": metadata, "tensors": [[dtype, shape], ...]}``), then the tensors'
bytes, little-endian, in order, in ``CHUNK`` frames of at most ``CHUNK_BYTES``, then ``END``; or
``UNAVAILABLE`` (a reason). The asker refuses a stream whose bytes do not add up to the shapes it
was told, so a server cannot make it allocate more than it announced.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from dtrain.swarm.transport import Transport, TransportError, read_frame, write_frame

logger = logging.getLogger(__name__)

PROTOCOL = "state"
ASK, META, CHUNK, END, UNAVAILABLE = 1, 2, 3, 4, 5
CHUNK_BYTES = 4 * 1024 * 1024
MAX_STATE_BYTES = 64 * 1024 ** 3  # a 1B model's parameters and AdamW moments, with room
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
           "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8, "bool": torch.bool}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}

StateProvider = Callable[[], tuple[Any, Sequence[torch.Tensor]]]


def state_key(prefix: str) -> str:
    return f"{prefix}_state"


class StateServer:
    """Serves ``provider()``'s ``(metadata, tensors)`` to peers that ask, and announces it on the
    DHT with :meth:`announce` (the caller calls it at start and whenever its priority changes)."""

    def __init__(self, transport: Transport, provider: StateProvider, *, announce_ttl_s: float = 60.0):
        self.transport, self.provider = transport, provider
        self.announce_ttl_s = float(announce_ttl_s)
        self.priority = 0.0
        transport.handle(PROTOCOL, self._serve)

    def announce(self, priority: Optional[float] = None) -> None:
        """Store our entry under the state key (best effort: the DHT may be slow or gone)."""
        from hivemind.utils.timed_storage import get_dht_time

        if priority is not None:
            self.priority = float(priority)
        try:
            self.transport.dht.store(state_key(self.transport.prefix), subkey=self.transport.peer_id,
                                     value=self.priority, expiration_time=get_dht_time() + self.announce_ttl_s)
        except Exception as exc:
            logger.debug("state sharing: could not announce: %r", exc)

    async def _serve(self, peer: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        import msgpack

        frame = await asyncio.wait_for(read_frame(reader), 30.0)
        if frame.kind != ASK:
            return
        loop = asyncio.get_running_loop()
        try:
            metadata, tensors = await loop.run_in_executor(None, self.provider)
            tensors = [t.detach().cpu().contiguous() for t in tensors]
            specs = [[_NAMES[t.dtype], list(t.shape)] for t in tensors]
            head = msgpack.packb({"meta": metadata, "tensors": specs}, use_bin_type=True)
        except Exception as exc:  # no state to give right now: say so, never crash the service
            logger.warning("state sharing: could not serve %s: %r", peer, exc)
            await write_frame(writer, UNAVAILABLE, f"no state to share: {exc!r}"[:300].encode())
            return
        await write_frame(writer, META, head)
        for tensor in tensors:
            data = memoryview(_tensor_bytes(tensor))
            for offset in range(0, len(data), CHUNK_BYTES):
                await write_frame(writer, CHUNK, data[offset:offset + CHUNK_BYTES])
        await write_frame(writer, END)


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16: its bits as 16-bit integers
        return tensor.view(torch.int16).numpy().astype("<i2").tobytes()
    return tensor.numpy().astype(tensor.numpy().dtype.newbyteorder("<")).tobytes()


def _tensor_from(data: bytes, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    if dtype == torch.bfloat16:
        return torch.from_numpy(np.frombuffer(data, dtype="<i2").copy()).view(torch.bfloat16).reshape(shape)
    np_dtype = torch.empty(0, dtype=dtype).numpy().dtype.newbyteorder("<")
    return torch.from_numpy(np.frombuffer(data, dtype=np_dtype).astype(np_dtype.newbyteorder("="))).reshape(shape)


def sharing_peers(transport: Transport) -> list[tuple[str, float]]:
    """``(peer id, priority)`` of every peer that announced its state, highest priority first."""
    found = transport.dht.get(state_key(transport.prefix), latest=True)
    entries = found.value if found is not None and isinstance(found.value, dict) else {}
    peers = []
    for peer, item in entries.items():
        try:
            peers.append((str(peer), float(item.value)))
        except (TypeError, ValueError, AttributeError):
            continue  # somebody's malformed entry: not a peer to ask
    return sorted((p for p in peers if p[0] != transport.peer_id), key=lambda p: (-p[1], p[0]))


async def download_from(transport: Transport, peer: str, timeout_s: float) -> tuple[Any, list[torch.Tensor]]:
    """``(metadata, tensors)`` from one peer; TransportError when it refuses, breaks the rules or
    does not finish within ``timeout_s``."""
    import msgpack

    deadline = time.monotonic() + timeout_s

    def left() -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TransportError(f"{peer} did not send its state within {timeout_s:g} s")
        return remaining

    reader, writer = await asyncio.wait_for(transport.open(peer, PROTOCOL), left())
    try:
        await write_frame(writer, ASK)
        frame = await asyncio.wait_for(read_frame(reader), left())
        if frame.kind == UNAVAILABLE:
            raise TransportError(f"{peer} shares no state: {frame.payload.decode(errors='replace')[:200]}")
        if frame.kind != META:
            raise TransportError(f"{peer} answered something else than its state")
        try:
            head = msgpack.unpackb(frame.payload, raw=False)
            metadata = head["meta"]
            specs = [(_DTYPES[str(d)], tuple(int(x) for x in shape)) for d, shape in head["tensors"]]
        except Exception as exc:
            raise TransportError(f"{peer} sent a malformed state header ({exc!r})"[:200]) from None
        sizes = [int(np.prod(shape, dtype=np.int64)) * torch.empty(0, dtype=dtype).element_size()
                 for dtype, shape in specs]
        if any(shape_dim < 0 for _, shape in specs for shape_dim in shape) or sum(sizes) > MAX_STATE_BYTES:
            raise TransportError(f"{peer} announced a state of {sum(sizes)} bytes (the limit is {MAX_STATE_BYTES})")
        tensors, buffer, index = [], bytearray(), 0
        while index < len(specs):
            if len(buffer) >= sizes[index]:
                dtype, shape = specs[index]
                tensors.append(_tensor_from(bytes(buffer[:sizes[index]]), dtype, shape))
                del buffer[:sizes[index]]
                index += 1
                continue
            frame = await asyncio.wait_for(read_frame(reader), left())
            if frame.kind != CHUNK or len(buffer) + len(frame.payload) > sum(sizes[index:]):
                raise TransportError(f"{peer}'s state does not add up to the tensors it announced")
            buffer += frame.payload
        frame = await asyncio.wait_for(read_frame(reader), left())
        if frame.kind != END or buffer:
            raise TransportError(f"{peer}'s state does not end where its tensors do")
        return metadata, tensors
    finally:
        writer.close()


async def load_state(transport: Transport, timeout_s: float,
                     peers: Optional[Sequence[str]] = None) -> Optional[tuple[Any, list[torch.Tensor]]]:
    """The state of the highest-priority peer that serves it within ``timeout_s`` in all, or None.
    ``peers``: whom to ask, in order (default: the peers announced on the DHT)."""
    deadline = time.monotonic() + timeout_s
    loop = asyncio.get_running_loop()
    if peers is None:
        peers = [p for p, _ in await loop.run_in_executor(None, sharing_peers, transport)]
    for peer in peers:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            return await download_from(transport, peer, remaining)
        except (TransportError, ConnectionError, asyncio.TimeoutError) as exc:
            logger.warning("state sharing: %s could not give its state: %s", peer, exc)
    return None
