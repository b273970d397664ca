"""What this peer sent in its last committed round, and the questions it answers about it.

The averager process keeps one copy of what it sent, replaced by the next round's (memory stays
flat). The other members of that round ask it for its parts' sketches under the round's result
seed (result_check.py) and for parts' wire bytes, to re-reduce a refused reducer's share
(re_reduction.py); the caller's process asks the same for the validators' round audit
(audit.py). The codec is deterministic, so sketches and bytes computed from the copy are of the
very bytes that went on the wire. Question and answer formats: docs/protocol.md, "Result check".
"""

from __future__ import annotations

import asyncio
import logging
import os
import struct
import tempfile
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch

from dtrain.sketch import WORK_SKETCH_K
from dtrain.swarm.averaging.contribution import PartLayout, claims_of
from dtrain.swarm.wire import wire_form

logger = logging.getLogger(__name__)

SEED_BYTES = 32
# Parts per question: an answer of 8192 sketches is 2 MiB, within p2pd's 4 MiB message.
MAX_ASK_PARTS = 8192
# Bytes of wire form per answer to a question for bytes: within p2pd's 4 MiB message.
MAX_ANSWER_BYTES = 3 << 20
# Seeds a sender answers per round: honest receivers derive one (the same), so a bound keeps a
# member from making a sender sketch its contribution again and again.
MAX_SEEDS_PER_ROUND = 4
# The two questions (the first byte of one)
ASK_SKETCHES = b"S"  # the sketches of parts under a result seed
ASK_BYTES = b"B"  # the wire bytes of parts


@dataclass(frozen=True)
class CallerQuestion:
    """The caller process's question about round ``round_id``: the sketches of all our parts under
    ``nonce``, or part ``part``'s wire bytes (dtrain.swarm.averaging.swarm asks it)."""

    round_id: str
    nonce: Optional[str] = None
    part: Optional[int] = None


class KeptFile:
    """Float32 tensors in an unlinked file under ``directory``, read back a range at a time: what
    a peer sent stays on disk (the page cache), not in the averager's memory, between the round
    and the next one (4 bytes per parameter; docs/operators.md, "Memory")."""

    def __init__(self, directory: str, tensors: Sequence[torch.Tensor]):
        os.makedirs(directory, exist_ok=True)
        self._file = tempfile.TemporaryFile(dir=directory)  # gone with the object, or the process
        self.offsets: list[int] = []
        at = 0
        for t in tensors:
            self.offsets.append(at)
            flat = t.detach().to("cpu", torch.float32).contiguous().reshape(-1)
            self._file.write(memoryview(flat.numpy()).cast("B"))
            at += 4 * flat.numel()
        self._file.flush()

    def read(self, i: int, start: int, length: int) -> torch.Tensor:
        """Values ``start:start + length`` of tensor ``i`` (pread: safe from several threads)."""
        data = os.pread(self._file.fileno(), 4 * length, self.offsets[i] + 4 * start)
        if len(data) != 4 * length:
            raise OSError(f"kept contribution file ends early ({len(data)} of {4 * length} bytes)")
        return torch.frombuffer(bytearray(data), dtype=torch.float32)


@dataclass(eq=False)
class SentContribution:
    """What this peer sent in one round: its float32 tensors on CPU (or ``file``, the same on
    disk: :meth:`keep`), their parts and wire codec."""

    tensors: list[torch.Tensor]
    layout: PartLayout
    compression: object  # the wire codec (hivemind CompressionBase)
    round_id: str = ""  # the group id, hex
    group_id: bytes = b""
    members: frozenset = frozenset()  # who may ask
    file: Optional[KeptFile] = None
    _by_seed: dict = field(default_factory=dict, repr=False)  # result seed -> future of its sketches
    _served: dict = field(default_factory=dict, repr=False)  # member -> parts whose bytes it was sent

    @classmethod
    def keep(cls, tensors: Sequence[torch.Tensor], layout: PartLayout, compression, *,
             directory: Optional[str] = None, **round_facts) -> "SentContribution":
        """A copy of ``tensors`` (about to be averaged in place): in a file under ``directory``,
        or in memory without one or when the file cannot be written (a full disk is logged)."""
        if directory is not None:
            try:
                return cls([], layout, compression, file=KeptFile(directory, tensors), **round_facts)
            except OSError as exc:
                logger.warning("swarm: kept this round's contribution in memory (%s: %r)", directory, exc)
        return cls([t.detach().clone() for t in tensors], layout, compression, **round_facts)

    def piece(self, i: int, start: int, length: int) -> torch.Tensor:
        """Values ``start:start + length`` of sent tensor ``i``."""
        if self.file is not None:
            return self.file.read(i, start, length)
        return self.tensors[i].reshape(-1)[start:start + length]

    def sketches(self, nonce: str, k: int = WORK_SKETCH_K) -> np.ndarray:
        """float32 [num_parts, k]: each part's sketch under ``nonce``, as a receiver decodes it."""
        return claims_of(self.piece, self.layout, nonce, self.compression, k)

    def wire(self, part: int) -> bytes:
        """The wire bytes of part ``part`` (IndexError when there is no such part)."""
        return wire_form(self.piece(*self.layout.parts[part]), self.compression)[0]

    def wires(self, parts: Sequence[int]):
        """An awaitable of the wire bytes of ``parts`` (serialised off the event loop)."""
        return asyncio.get_event_loop().run_in_executor(None, lambda: [self.wire(g) for g in parts])

    def sketches_for_seed(self, seed: bytes, nonce: str) -> Optional[asyncio.Future]:
        """Start (once per seed) sketching what we sent under ``nonce`` (the seed's); its future,
        or None past MAX_SEEDS_PER_ROUND."""
        future = self._by_seed.get(seed)
        if future is None:
            if len(self._by_seed) >= MAX_SEEDS_PER_ROUND:
                return None
            future = self._by_seed[seed] = asyncio.get_event_loop().run_in_executor(None, self.sketches, nonce)
        return future

    async def answer_member(self, payload: bytes, asker: str, nonce_of) -> Optional[bytes]:
        """A member's question (``nonce_of(seed)``: a result seed's sketch nonce); None refuses it."""
        if asker not in self.members:
            return None
        kind, seed, parts = decode_ask(payload, len(self.layout))
        if kind == ASK_SKETCHES:
            future = self.sketches_for_seed(seed, nonce_of(seed))
            return None if future is None else encode_answer((await asyncio.shield(future))[parts])
        served = self._served.setdefault(asker, set())
        if served & set(parts):
            return None  # each member gets each part's bytes at most once
        served.update(parts)
        return encode_wires(await self.wires(parts))

    async def answer_caller(self, question: CallerQuestion):
        """The caller's question, answered off the loop; None when it is about another round."""
        if question.round_id != self.round_id:
            return None
        loop = asyncio.get_event_loop()
        if question.part is not None:
            return await loop.run_in_executor(None, self.wire, question.part)
        return await loop.run_in_executor(None, self.sketches, question.nonce)


# -- the questions on the wire ------------------------------------------------------------------


def encode_ask(seed: bytes, parts: Sequence[int]) -> bytes:
    """A question for sketches: the kind, the seed, then the global part indices wanted (u32, ascending)."""
    if len(seed) != SEED_BYTES or not 0 < len(parts) <= MAX_ASK_PARTS:
        raise ValueError("a question names one 32-byte seed and 1 to MAX_ASK_PARTS parts")
    return ASK_SKETCHES + bytes(seed) + np.asarray(parts, dtype="<u4").tobytes()


def encode_fetch(parts: Sequence[int]) -> bytes:
    """A question for the wire bytes of the given global parts (u32, ascending)."""
    if not 0 < len(parts) <= MAX_ASK_PARTS:
        raise ValueError("a question names 1 to MAX_ASK_PARTS parts")
    return ASK_BYTES + np.asarray(parts, dtype="<u4").tobytes()


def decode_ask(payload: bytes, num_parts: int) -> tuple[bytes, Optional[bytes], list[int]]:
    """``(kind, seed or None, parts)`` of a question; ValueError naming what is wrong with it."""
    kind, payload = bytes(payload[:1]), bytes(payload[1:])
    if kind == ASK_SKETCHES:
        seed, body = payload[:SEED_BYTES], payload[SEED_BYTES:]
        if len(seed) < SEED_BYTES:
            raise ValueError("a question for sketches starts with a 32-byte seed")
    elif kind == ASK_BYTES:
        seed, body = None, payload
    else:
        raise ValueError("a question asks for sketches (S) or bytes (B)")
    if not body or len(body) % 4:
        raise ValueError("a question names whole u32 part indices")
    parts = np.frombuffer(body, dtype="<u4")
    if len(parts) > MAX_ASK_PARTS:
        raise ValueError(f"a question names at most {MAX_ASK_PARTS} parts")
    if (parts >= num_parts).any() or (np.diff(parts.astype(np.int64)) <= 0).any():
        raise ValueError(f"part indices must ascend and be below {num_parts}")
    return kind, seed, [int(g) for g in parts]


def encode_wires(wires: Sequence[bytes]) -> bytes:
    """An answer of wire bytes: per part, u32 length then the bytes."""
    return b"".join(struct.pack("<I", len(w)) + bytes(w) for w in wires)


def decode_wires(data: Optional[bytes], count: int) -> Optional[list[bytes]]:
    """The ``count`` wire forms of an answer, or None (no answer, or malformed)."""
    if data is None:
        return None
    out, at = [], 0
    for _ in range(count):
        if at + 4 > len(data):
            return None
        (n,) = struct.unpack_from("<I", data, at)
        at += 4
        if at + n > len(data):
            return None
        out.append(bytes(data[at:at + n]))
        at += n
    return out if at == len(data) else None


def encode_answer(sketches: np.ndarray) -> bytes:
    """An answer: the asked parts' sketches, float32 little-endian [parts, k]."""
    return np.ascontiguousarray(sketches, dtype="<f4").tobytes()


def decode_answer(data: Optional[bytes], num_parts: int, k: int = WORK_SKETCH_K) -> Optional[np.ndarray]:
    """The sketches of an answer, or None (no answer, the wrong size, or non-finite values: the
    sender is then treated as silent)."""
    if data is None or len(data) != num_parts * k * 4:
        return None
    sketches = np.frombuffer(data, dtype="<f4").reshape(num_parts, k)
    return sketches if np.isfinite(sketches).all() else None


# -- asking -----------------------------------------------------------------------------------


async def ask_sketches(io, peer: str, group_id: bytes, seed: bytes, parts: list[int],
                       timeout_s: float) -> Optional[dict[int, np.ndarray]]:
    """Member ``peer``'s sketches of ``parts`` under ``seed`` (``io``: the averager's ask_member),
    asked MAX_ASK_PARTS at a time; None when it does not answer all of them."""
    got: dict[int, np.ndarray] = {}
    for at in range(0, len(parts), MAX_ASK_PARTS):
        chunk = parts[at:at + MAX_ASK_PARTS]
        sketches = decode_answer(await io.ask_member(peer, group_id, encode_ask(seed, chunk), timeout_s), len(chunk))
        if sketches is None:
            return None
        got.update(zip(chunk, sketches))
    return got


async def fetch_wires(io, peer: str, group_id: bytes, parts: list[int], per_question: int,
                      timeout_s: float) -> dict[int, bytes]:
    """Member ``peer``'s wire bytes of ``parts``, ``per_question`` parts a question; the parts it
    answered before it stopped answering."""
    got: dict[int, bytes] = {}
    for at in range(0, len(parts), per_question):
        chunk = parts[at:at + per_question]
        wires = decode_wires(await io.ask_member(peer, group_id, encode_fetch(chunk), timeout_s), len(chunk))
        if wires is None:
            break
        got.update(zip(chunk, wires))
    return got
