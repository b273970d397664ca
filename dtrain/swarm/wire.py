"""A part on the wire: the hivemind codec of a compression setting, and a part's wire bytes.

The codecs' names and arithmetic are dtrain/swarm/codecs.py (no hivemind); hivemind's
serializer, with dtrain's codec registered in the wall, turns a part into the bytes a
reducer receives. Every check that holds a peer to its bytes (claims, digests, the round
audit) goes through these functions, so all of them see what the wire carries. Each takes a
hivemind compression object, or a dtrain PartCodec for a round on dtrain's own butterfly.
"""

from __future__ import annotations

import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import runtime_pb2

from dtrain.swarm import hivemind_internals
from dtrain.swarm.codecs import PartCodec, canonical_compression


def make_compression(name: str):
    """The hivemind compression object of a config string.

    ``8bit`` is dtrain's :class:`BlockwiseAbsmax8Bit` (bounded error for any gradient);
    ``8bit-uniform`` / ``8bit-quantile`` are hivemind's single-codebook quantizers, kept for
    experiments: their error has no bound (docs/swarm.md, "Wire compression").
    """
    return hivemind_internals.compression(canonical_compression(name))


def as_received(part: torch.Tensor, compression) -> torch.Tensor:
    """What a receiver decodes from ``part`` sent with ``compression`` (the lossy round trip;
    the part itself when there is no compression)."""
    if isinstance(compression, PartCodec):
        return compression.round_trip(part)
    if compression.compression_type == 0:  # NONE: exact, skip the copy
        return part
    return wire_form(part, compression)[1]


def wire_form(part: torch.Tensor, compression) -> tuple[bytes, torch.Tensor]:
    """(the part's wire bytes, what a receiver decodes of them): the codec is deterministic, so
    these are the bytes hivemind sends for the part."""
    if isinstance(compression, PartCodec):
        wire = compression.encode(part)
        return wire, part if compression.name == "none" else compression.decode(wire, part.numel())
    wire = serialize_torch_tensor(part.detach(), compression.compression_type)
    decoded = part if compression.compression_type == 0 else deserialize_torch_tensor(wire)
    return bytes(wire.buffer), decoded


def decode_wire(wire: bytes, length: int, compression) -> torch.Tensor:
    """The float32 part of ``length`` values that ``wire`` (a part's wire bytes, sent with
    ``compression``) decodes to; ValueError when the bytes are not such a part."""
    if isinstance(compression, PartCodec):
        return compression.decode(wire, length)
    message = runtime_pb2.Tensor(buffer=bytes(wire), size=[int(length)], dtype="float32",
                                 compression=compression.compression_type)
    try:
        part = deserialize_torch_tensor(message)
    except Exception as exc:  # the codecs raise several types on malformed buffers
        raise ValueError(f"{type(exc).__name__}: {exc}"[:200]) from None
    if part.numel() != length:
        raise ValueError(f"{part.numel()} values, expected {length}")
    return part.float()
