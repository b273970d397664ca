"""Shims installed into hivemind at import of the wall (see the package docstring), and
hivemind's compression objects and serializer as dtrain uses them."""

from __future__ import annotations

import logging
import threading
from typing import Any, Optional, Sequence

import numpy as np
import torch
from hivemind.averaging import load_balancing
from hivemind.compression import (
    CompressionBase,
    NoCompression,
    deserialize_torch_tensor,
    quantization,
    serialization,
    serialize_torch_tensor,
)
from hivemind.compression.floating import Float16Compression
from hivemind.proto import runtime_pb2

from dtrain.swarm.codecs import BlockwiseAbsmax8Bit
from dtrain.swarm.load_balance import optimize_parts_highs
from dtrain.swarm.ternary import BlockwiseTernary

logger = logging.getLogger(__name__)

_shims_installed = False
_shim_lock = threading.Lock()


def _read_codebook_size(buffer: bytes) -> int:
    # np.frombuffer(..., count=1) is a 1-d array; index it instead of int() (numpy >= 2.4).
    return int(np.frombuffer(buffer, count=1, dtype=np.int64)[0])


def _fixed_quantizer(base: type) -> type:
    class _Fixed(base):  # type: ignore[misc, valid-type]
        """hivemind 8-bit quantizer with a numpy-2.4-safe decoder (wire format unchanged)."""

        _dtrain_fixed = True

        def extract(self, serialized_tensor):
            size = _read_codebook_size(serialized_tensor.buffer)
            codebook = np.frombuffer(serialized_tensor.buffer, offset=8, count=size, dtype=self.codebook_dtype)
            indices = np.frombuffer(serialized_tensor.buffer, offset=8 + codebook.nbytes, dtype=self.indices_dtype)
            indices_t = torch.as_tensor(indices, dtype=torch.int64).reshape(tuple(serialized_tensor.size))
            codebook_t = torch.as_tensor(codebook).to(dtype=getattr(torch, serialized_tensor.dtype))
            return codebook_t[indices_t].requires_grad_(serialized_tensor.requires_grad)

    _Fixed.__name__ = _Fixed.__qualname__ = f"Fixed{base.__name__}"
    return _Fixed


class _DtrainCodecCompression(CompressionBase):
    """One of dtrain's codecs (``codec``: encode, decode, compression_ratio) as a hivemind
    compression under the wire id ``compression_type``."""

    compression_type: int
    codec: type
    _dtrain_fixed = True

    def compress(self, tensor, info, allow_inplace: bool = False):
        buffer, shape, dtype_name = self.codec.encode(tensor)
        return runtime_pb2.Tensor(compression=self.compression_type, buffer=buffer, size=shape, dtype=dtype_name,
                                  requires_grad=tensor.requires_grad)

    def extract(self, serialized_tensor):
        values = self.codec.decode(serialized_tensor.buffer, serialized_tensor.size, serialized_tensor.dtype)
        return values.requires_grad_(serialized_tensor.requires_grad)

    def estimate_compression_ratio(self, info) -> float:
        return self.codec.compression_ratio(torch.finfo(info.descriptor.dtype).bits)


class BlockwiseAbsmax8BitCompression(_DtrainCodecCompression):
    """dtrain's :class:`~dtrain.swarm.codecs.BlockwiseAbsmax8Bit` as a hivemind compression."""

    compression_type = runtime_pb2.BLOCKWISE_8BIT
    codec = BlockwiseAbsmax8Bit


class BlockwiseTernaryCompression(_DtrainCodecCompression):
    """dtrain's :class:`~dtrain.swarm.ternary.BlockwiseTernary` as a hivemind compression, under
    the id of hivemind's mean-std 16-bit codec (its enum has no free value; dtrain never sends
    that codec, and peers agree on the codec at group formation before any part is sent)."""

    compression_type = runtime_pb2.MEANSTD_16BIT
    codec = BlockwiseTernary


def install_shims() -> None:
    """Install the three shims of the module docstring into hivemind (idempotent, thread-safe)."""
    global _shims_installed
    with _shim_lock:
        if _shims_installed:
            return
        registry = serialization._BASE_COMPRESSION_TYPES
        for key, base in (("UNIFORM_8BIT", quantization.Uniform8BitQuantization),
                          ("QUANTILE_8BIT", quantization.Quantile8BitQuantization)):
            if not getattr(type(registry[key]), "_dtrain_fixed", False):
                registry[key] = _fixed_quantizer(base)()
        for codec in (BlockwiseAbsmax8BitCompression, BlockwiseTernaryCompression):
            if type(registry[codec.codec.WIRE_ID]) is not codec:
                registry[codec.codec.WIRE_ID] = codec()
        # load_balance_peers looks optimize_parts_lp up as a module global at call time.
        load_balancing.optimize_parts_lp = optimize_parts_highs
        _shims_installed = True


def shims_installed() -> bool:
    return _shims_installed


def load_balance(vector_size: int, bandwidths: Sequence[Optional[float]], min_size: int = 0) -> tuple[int, ...]:
    """How many values of the vector each peer reduces (hivemind's load balancing, shimmed)."""
    install_shims()
    return tuple(int(x) for x in load_balancing.load_balance_peers(vector_size, list(bandwidths), min_size))


_REGISTERED = {"8bit": BlockwiseAbsmax8Bit.WIRE_ID, "ternary": BlockwiseTernary.WIRE_ID, "8bit-uniform": "UNIFORM_8BIT",
               "8bit-quantile": "QUANTILE_8BIT"}


def compression(key: str):
    """hivemind's compression object for a canonical setting (dtrain.swarm.wire.make_compression)."""
    install_shims()
    if key == "none":
        return NoCompression()
    if key == "fp16":
        return Float16Compression()
    return serialization._BASE_COMPRESSION_TYPES[_REGISTERED[key]]


def serialize_part(tensor: torch.Tensor, compression_type) -> Any:
    """A tensor as hivemind puts it on the wire (``compression_type``: a compression's id)."""
    return serialize_torch_tensor(tensor, compression_type)


def deserialize_part(message) -> torch.Tensor:
    return deserialize_torch_tensor(message)
