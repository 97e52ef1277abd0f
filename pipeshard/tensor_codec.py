"""numpy <-> ``pipeshard.v1.Tensor``: the one place tensors are put on and taken off the wire.

Decoding never trusts the sender: the dtype must be on the allow-list, the decoded byte
length must equal product(shape) x itemsize, and decompression is capped at that size, so
a malformed frame raises :class:`MalformedTensor` (INVALID_ARGUMENT) instead of crashing a
stage or allocating without bound. bfloat16 travels as the upper half of a float32 and is
widened back to float32 on decode (numpy has no bfloat16).
"""

from __future__ import annotations

import math

import numpy as np
import zstandard

from pipeshard.errors import InvalidArgument
from pipeshard.v1 import tensor_pb2

Dtype = tensor_pb2.Dtype
Codec = tensor_pb2.Codec

_NUMPY_OF: dict[int, np.dtype] = {
    Dtype.DTYPE_FP32: np.dtype("<f4"),
    Dtype.DTYPE_FP16: np.dtype("<f2"),
    Dtype.DTYPE_BF16: np.dtype("<u2"),
    Dtype.DTYPE_INT64: np.dtype("<i8"),
    Dtype.DTYPE_INT32: np.dtype("<i4"),
    Dtype.DTYPE_UINT8: np.dtype("u1"),
    Dtype.DTYPE_INT8: np.dtype("i1"),
    Dtype.DTYPE_BOOL: np.dtype("?"),
}
_DTYPE_OF: dict[np.dtype, int] = {v: k for k, v in _NUMPY_OF.items() if k != Dtype.DTYPE_BF16}

_ZSTD_LEVEL = 1  # level 3 was never better on hidden states (FACTS.md)


class MalformedTensor(InvalidArgument):
    """A tensor whose bytes do not match its declared dtype, shape or codec."""

    def __init__(self, field: str, problem: str):
        super().__init__(field, problem)


def encode(
    array: np.ndarray,
    codec: int = Codec.CODEC_NONE,
    *,
    as_bf16: bool = False,
    field: str = "tensor",
) -> tensor_pb2.Tensor:
    """Encode an array; ``as_bf16`` narrows a float32 array to bfloat16 (round to nearest even)."""
    if as_bf16:
        dtype = Dtype.DTYPE_BF16
        raw = _to_bf16_bits(array)
    else:
        dtype = _DTYPE_OF.get(array.dtype.newbyteorder("<"))
        if dtype is None:
            raise InvalidArgument(field, f"has unsupported dtype {array.dtype}")
        raw = np.ascontiguousarray(array, dtype=_NUMPY_OF[dtype])
    data = raw.tobytes() if codec in (Codec.CODEC_NONE, Codec.CODEC_UNSPECIFIED) else _compress(raw, codec)
    return tensor_pb2.Tensor(
        dtype=dtype, shape=array.shape, data=data, codec=codec or Codec.CODEC_NONE, raw_size=raw.nbytes
    )


def decode(tensor: tensor_pb2.Tensor, *, field: str = "tensor") -> np.ndarray:
    """Decode a tensor, validating it; bfloat16 comes back as float32."""
    np_dtype = _NUMPY_OF.get(tensor.dtype)
    if np_dtype is None:
        name = Dtype.Name(tensor.dtype) if tensor.dtype in Dtype.values() else str(tensor.dtype)
        raise MalformedTensor(field, f"has unsupported dtype {name}")
    shape = tuple(tensor.shape)
    if any(d < 0 for d in shape):
        raise MalformedTensor(field, f"has a negative dimension in shape {list(shape)}")
    expected = math.prod(shape) * np_dtype.itemsize
    if tensor.raw_size and tensor.raw_size != expected:
        raise MalformedTensor(
            field, f"declares raw_size {tensor.raw_size} but shape {list(shape)} needs {expected} bytes"
        )
    raw = _decompress(tensor, expected, field)
    if len(raw) != expected:
        raise MalformedTensor(
            field,
            f"has {len(raw)} data bytes but shape {list(shape)} x {np_dtype.itemsize} needs {expected}",
        )
    array = np.frombuffer(raw, dtype=np_dtype).reshape(shape)
    if tensor.dtype == Dtype.DTYPE_BF16:
        return (array.astype(np.uint32) << 16).view(np.float32)
    return array


def _to_bf16_bits(array: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(array, dtype=np.float32).view(np.uint32)
    rounding = ((bits >> 16) & 1) + 0x7FFF
    return ((bits + rounding) >> 16).astype("<u2")


def _compress(raw: np.ndarray, codec: int) -> bytes:
    if codec == Codec.CODEC_ZSTD:
        return zstandard.ZstdCompressor(level=_ZSTD_LEVEL).compress(raw.tobytes())
    if codec == Codec.CODEC_BYTE_SPLIT_ZSTD:
        lanes = raw.reshape(-1).view(np.uint8).reshape(-1, raw.dtype.itemsize).T
        return zstandard.ZstdCompressor(level=_ZSTD_LEVEL).compress(np.ascontiguousarray(lanes).tobytes())
    raise InvalidArgument("codec", f"unknown codec {codec}")


def _decompress(tensor: tensor_pb2.Tensor, expected: int, field: str) -> bytes:
    codec = tensor.codec
    if codec in (Codec.CODEC_NONE, Codec.CODEC_UNSPECIFIED):
        return tensor.data
    if codec not in (Codec.CODEC_ZSTD, Codec.CODEC_BYTE_SPLIT_ZSTD):
        raise MalformedTensor(field, f"has unknown codec {codec}")
    try:
        declared = zstandard.frame_content_size(tensor.data)
        if declared > expected:
            raise MalformedTensor(field, f"decompresses to {declared} bytes but shape needs {expected}")
        raw = zstandard.ZstdDecompressor().decompress(tensor.data, max_output_size=max(expected, 1))
    except zstandard.ZstdError as exc:
        raise MalformedTensor(field, f"is not valid {Codec.Name(codec)} data ({exc})") from None
    if codec == Codec.CODEC_BYTE_SPLIT_ZSTD and len(raw) == expected:
        itemsize = _NUMPY_OF[tensor.dtype].itemsize
        lanes = np.frombuffer(raw, dtype=np.uint8).reshape(itemsize, -1)
        raw = np.ascontiguousarray(lanes.T).tobytes()
    return raw
