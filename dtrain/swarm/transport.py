"""dtrain's own P2P service, on hivemind's public ``P2P`` (a client of the node's p2pd, ``P2P.replicate``).

Every message dtrain's swarm exchanges outside the DHT travels here, under protocol names of its
own (``/dtrain/<prefix>/<name>/1``) and in frames of its own: one frame is hivemind's raw-data
framing (``P2P.send_raw_data``: an 8-byte big-endian length, then the bytes), whose first byte is
the frame's kind and the rest its payload. A frame's length is bounded (``MAX_FRAME``), so a
hostile peer cannot make a reader allocate without limit. The remote peer of a stream is the one
libp2p authenticated (its peer id), never a name it sends.

The service runs an event loop of its own in a daemon thread of the neuron's process, so the
caller's thread (training) never blocks on the network, and what the swarm averages is the
caller's memory, not a copy in another process.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Coroutine, Optional

logger = logging.getLogger(__name__)

# The largest frame a reader accepts: a part of the vector (512 KiB at the largest part size)
# with room to spare, and a membership list of 256 members.
MAX_FRAME = 32 * 1024 * 1024
PROTOCOL_VERSION = 1


class TransportError(Exception):
    """A frame that breaks the framing rules, a stream that ended early, or a peer that cannot be reached."""


@dataclass(frozen=True)
class Frame:
    kind: int  # 0-255: what the payload is (each protocol numbers its own)
    payload: bytes


async def write_frame(writer: asyncio.StreamWriter, kind: int, payload: bytes = b"") -> None:
    """Write one frame and wait until the stream took it (back-pressure: a slow link slows the writer)."""
    from hivemind.p2p import P2P

    if not 0 <= kind <= 255:
        raise ValueError(f"frame kind {kind} is not a byte")
    if len(payload) + 1 > MAX_FRAME:
        raise ValueError(f"a frame of {len(payload) + 1} bytes is over the {MAX_FRAME}-byte limit")
    await P2P.send_raw_data(bytes([kind]) + bytes(payload), writer)


async def read_frame(reader: asyncio.StreamReader) -> Frame:
    """The next frame; TransportError when the stream ends or the frame breaks the limits."""
    from hivemind.p2p import P2P

    try:
        header = await reader.readexactly(P2P.HEADER_LEN)
    except asyncio.IncompleteReadError:
        raise TransportError("the stream ended") from None
    length = int.from_bytes(header, P2P.BYTEORDER)
    if not 1 <= length <= MAX_FRAME:
        raise TransportError(f"a frame of {length} bytes (the limit is {MAX_FRAME})")
    try:
        data = await reader.readexactly(length)
    except asyncio.IncompleteReadError:
        raise TransportError("the stream ended inside a frame") from None
    return Frame(data[0], data[1:])


async def _daemon_address(_dht, node):
    """In the DHT's process: the multiaddr its p2pd listens on for clients."""
    return node.p2p.daemon_listen_maddr


# How long a served stream waits for its opener to hang up once the handler is done.
HANG_UP_WAIT_S = 30.0


async def _until_hung_up(reader: asyncio.StreamReader) -> None:
    """Read (and drop) until the peer closes its end, for at most HANG_UP_WAIT_S."""
    try:
        await asyncio.wait_for(_drain_to_eof(reader), HANG_UP_WAIT_S)
    except asyncio.TimeoutError:
        pass


async def _drain_to_eof(reader: asyncio.StreamReader) -> None:
    while await reader.read(65536):
        pass


# A handler gets the authenticated remote peer id (base58) and the stream's two ends.
StreamHandler = Callable[[str, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class Transport:
    """dtrain's service on the node's p2pd. ``start()`` once; ``handle(name, fn)`` registers a
    protocol; ``open(peer, name)`` opens a stream to a peer's; ``run(coro)`` runs a coroutine on
    the service's loop from any thread."""

    def __init__(self, dht, prefix: str):
        self.dht = dht
        self.prefix = str(prefix)
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._p2p = None
        self._handlers: dict[str, StreamHandler] = {}
        self.peer_id = str(dht.peer_id)

    def protocol(self, name: str) -> str:
        return f"/dtrain/{self.prefix}/{name}/{PROTOCOL_VERSION}"

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self, timeout_s: float = 60.0) -> "Transport":
        if self._thread is not None:
            return self
        ready: Future = Future()

        def serve() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            self._loop = loop
            try:
                from hivemind.p2p import P2P

                # a client of our own to the node's p2pd, bound to this loop: the DHT's cached
                # replica (replicate_p2p) belongs to whichever loop first asked for it
                self._p2p = loop.run_until_complete(P2P.replicate(self.dht.run_coroutine(_daemon_address)))
            except BaseException as exc:  # the DHT is gone: the caller hears why
                self._loop = None
                ready.set_exception(exc)
                loop.close()
                return
            ready.set_result(None)
            loop.run_forever()
            # what was still running (a stream waiting on a peer) ends here, not in a closed loop
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.close()

        self._thread = threading.Thread(target=serve, name="dtrain-transport", daemon=True)
        self._thread.start()
        try:
            ready.result(timeout=timeout_s)
        except BaseException:
            self._thread = None  # a later start() tries again
            raise
        return self

    def shutdown(self) -> None:
        loop, self._loop = self._loop, None
        if loop is None:
            return

        async def stop() -> None:
            for name in list(self._handlers):
                try:
                    await self._p2p.remove_binary_stream_handler(self.protocol(name))
                except Exception as exc:  # the daemon may already be gone
                    logger.debug("transport: could not remove handler %s: %r", name, exc)
            self._handlers.clear()
            try:
                await self._p2p.shutdown()  # our client only: the daemon is the DHT's
            except Exception as exc:
                logger.debug("transport: closing the p2pd client: %r", exc)

        try:
            asyncio.run_coroutine_threadsafe(stop(), loop).result(timeout=10)
        except Exception as exc:
            logger.debug("transport: shutdown: %r", exc)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._thread = None

    @property
    def running(self) -> bool:
        return self._loop is not None

    # -- running things on the loop ------------------------------------------------------------
    def submit(self, coro: Coroutine) -> Future:
        """Schedule ``coro`` on the service's loop; a concurrent.futures.Future of its result."""
        if self._loop is None:
            coro.close()
            raise TransportError("the transport is not running")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def run(self, coro: Coroutine, timeout_s: Optional[float] = None) -> Any:
        """``coro``'s result, from a thread other than the loop's (TimeoutError past ``timeout_s``)."""
        future = self.submit(coro)
        try:
            return future.result(timeout=timeout_s)
        except BaseException:
            future.cancel()
            raise

    # -- protocols ---------------------------------------------------------------------------
    def handle(self, name: str, handler: StreamHandler) -> None:
        """Serve protocol ``name``: each stream a peer opens runs ``handler(peer id, reader, writer)``.
        When the handler returns, the stream stays open until the peer hangs up (at most
        ``HANG_UP_WAIT_S``): the side that opened a stream closes it, since p2pd drops what is still
        in flight when the other side closes first. An exception in a handler is logged, not raised."""

        async def on_stream(info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            peer = info.peer_id.to_base58()
            try:
                await handler(peer, reader, writer)
                await _until_hung_up(reader)
            except (TransportError, ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError) as exc:
                logger.debug("transport: %s stream from %s ended: %r", name, peer, exc)
            except Exception:
                logger.exception("transport: %s handler failed for %s", name, peer)
            finally:
                writer.close()

        async def register() -> None:
            await self._p2p.add_binary_stream_handler(self.protocol(name), on_stream)
            self._handlers[name] = handler

        self.run(register(), timeout_s=30)

    async def open(self, peer: str, name: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A stream to ``peer``'s protocol ``name`` (on the service's loop); TransportError when the
        peer cannot be reached or does not serve it."""
        from hivemind.p2p import PeerID

        try:
            _, reader, writer = await self._p2p.call_binary_stream_handler(PeerID.from_base58(peer),
                                                                            self.protocol(name))
        except Exception as exc:  # p2pd's refusals come as several types
            raise TransportError(f"could not open {name} to {peer}: {exc!r}"[:300]) from None
        return reader, writer
