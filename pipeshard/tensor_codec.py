"""numpy <-> ``pipeshard.v1.Tensor``: the one place tensors are put on and taken off the wire.

Decoding never trusts the sender: the dtype must be on the allow-list, the decoded byte
length must equal product(shape) x itemsize (at most ``MAX_RAW_BYTES``), a compressed frame
must declare exactly that content size before anything is allocated, and the decoded bytes
must match the sender's CRC-32 when it gave one; so a malformed frame raises
:class:`MalformedTensor` (INVALID_ARGUMENT) instead of crashing a stage or allocating without
bound. bfloat16 travels as the upper half of a float32 and is widened back to float32 on
decode (numpy has no bfloat16); ``as_fp16``/``as_bf16`` are the opt-in LOSSY wire formats.

Codecs (all exactly lossless): zstd; byte lanes (byte 0 of every element, then byte 1, ...)
then zstd, as BloomBee does; and the same lanes with each lane its own zstd block
(CODEC_LANE_BLOCKS_ZSTD). zstd shares one entropy table per block, so BloomBee's single
stream mixes the nearly random mantissa lanes with the exponent lane; a block per lane codes
each with its own table and measured 7-10 points of raw smaller on SmolLM2 hidden states
(docs/BENCHMARKS.md, ``make bench-compress``). The wire layout of the decompressed bytes is
the same for both lane codecs, so one decoder serves both. CODEC_QUANTUM_ZSTD (fp32 only,
pipeshard/tensor_codec_quantum.py) leaves out the mantissa bits below a common quantum.
"""

from __future__ import annotations

import math
import threading
import zlib

import numpy as np
import zstandard

from pipeshard import tensor_codec_quantum as quantum
from pipeshard.errors import InvalidArgument
from pipeshard.v1 import tensor_pb2

Dtype = tensor_pb2.Dtype
Codec = tensor_pb2.Codec

_NUMPY_OF: dict[Dtype, np.dtype] = {
    Dtype.DTYPE_FP32: np.dtype("<f4"),
    Dtype.DTYPE_FP16: np.dtype("<f2"),
    Dtype.DTYPE_BF16: np.dtype("<u2"),
    Dtype.DTYPE_INT64: np.dtype("<i8"),
    Dtype.DTYPE_INT32: np.dtype("<i4"),
    Dtype.DTYPE_UINT8: np.dtype("u1"),
    Dtype.DTYPE_INT8: np.dtype("i1"),
    Dtype.DTYPE_BOOL: np.dtype("?"),
}
_DTYPE_OF: dict[np.dtype, Dtype] = {v: k for k, v in _NUMPY_OF.items() if k != Dtype.DTYPE_BF16}

_ZSTD_LEVEL = 1  # level 3 was never better on hidden states (measured for zstd and for lane blocks)
# The largest tensor any decoder materialises: 4x the gRPC message cap, far above a 4000-token
# prefill (9 MB) or a speculative step's logits; a shape that claims more is refused unread.
MAX_RAW_BYTES = 256 * 1024 * 1024
_LANE_CODECS = (Codec.CODEC_BYTE_SPLIT_ZSTD, Codec.CODEC_LANE_BLOCKS_ZSTD)
_ZSTD_CODECS = (Codec.CODEC_ZSTD, *_LANE_CODECS)
FP16_MAX = float(np.finfo(np.float16).max)
_local = threading.local()  # zstd contexts are reused (cheaper per frame) but not thread-safe


def _compressor() -> zstandard.ZstdCompressor:
    if not hasattr(_local, "compressor"):
        _local.compressor = zstandard.ZstdCompressor(level=_ZSTD_LEVEL)
    return _local.compressor


def _decompressor() -> zstandard.ZstdDecompressor:
    if not hasattr(_local, "decompressor"):
        _local.decompressor = zstandard.ZstdDecompressor()
    return _local.decompressor


class MalformedTensor(InvalidArgument):
    """A tensor whose bytes do not match its declared dtype, shape or codec."""

    def __init__(self, field: str, problem: str):
        super().__init__(field, problem)


def encode(
    array: np.ndarray,
    codec: Codec = Codec.CODEC_NONE,
    *,
    as_bf16: bool = False,
    as_fp16: bool = False,
    field: str = "tensor",
) -> tensor_pb2.Tensor:
    """Encode an array with its CRC-32. LOSSY opt-ins: ``as_bf16`` narrows a float array to
    bfloat16 (round to nearest even); ``as_fp16`` to float16, saturating beyond +-65504."""
    if as_bf16 and as_fp16:
        raise InvalidArgument(field, "can narrow to bf16 or fp16, not both")
    dtype: Dtype | None
    if as_bf16:
        dtype = Dtype.DTYPE_BF16
        raw = _to_bf16_bits(array)
    elif as_fp16:
        dtype = Dtype.DTYPE_FP16
        raw = np.clip(np.asarray(array, dtype=np.float32), -FP16_MAX, FP16_MAX).astype("<f2")
    else:
        # The array's own dtype first: a native little-endian one hits at once (newbyteorder
        # costs about 8 us a call, and the coordinator encodes every row's token ids).
        dtype = _DTYPE_OF.get(array.dtype) or _DTYPE_OF.get(array.dtype.newbyteorder("<"))
        if dtype is None:
            raise InvalidArgument(field, f"has unsupported dtype {array.dtype}")
        raw = np.ascontiguousarray(array, dtype=_NUMPY_OF[dtype])
    raw = np.ascontiguousarray(raw)
    data = raw.tobytes() if codec in (Codec.CODEC_NONE, Codec.CODEC_UNSPECIFIED) else _compress(raw, codec)
    return tensor_pb2.Tensor(
        dtype=dtype,
        shape=array.shape,
        data=data,
        codec=codec or Codec.CODEC_NONE,
        raw_size=raw.nbytes,
        crc32=zlib.crc32(raw.data),
    )


def dtype_code(np_dtype: np.dtype) -> int:
    """The wire dtype of a numpy dtype (what :func:`encode` writes for it)."""
    d = np.dtype(np_dtype)
    return _DTYPE_OF.get(d) or _DTYPE_OF[d.newbyteorder("<")]


def decoded_bytes(tensor: tensor_pb2.Tensor, *, field: str = "tensor") -> int:
    """The bytes ``tensor`` decodes to, from its declared dtype and shape alone (nothing is
    decompressed), so a caller can hold it against its own limit first."""
    np_dtype = _NUMPY_OF.get(tensor.dtype)
    if np_dtype is None:
        name = Dtype.Name(tensor.dtype) if tensor.dtype in Dtype.values() else str(tensor.dtype)
        raise MalformedTensor(field, f"has unsupported dtype {name}")
    shape = tuple(tensor.shape)
    if any(d < 0 for d in shape):
        raise MalformedTensor(field, f"has a negative dimension in shape {list(shape)}")
    return math.prod(shape) * np_dtype.itemsize


def decode(
    tensor: tensor_pb2.Tensor,
    *,
    field: str = "tensor",
    max_bytes: int = MAX_RAW_BYTES,
    limit: str = "MAX_RAW_BYTES",
) -> np.ndarray:
    """Decode a tensor, validating it; bfloat16 comes back as float32. ``max_bytes`` is the most
    the caller can use (``limit`` names it in the error): a shape needing more is refused before
    anything is decompressed or allocated."""
    expected = decoded_bytes(tensor, field=field)
    np_dtype = _NUMPY_OF[tensor.dtype]
    shape = tuple(tensor.shape)
    cap = min(max_bytes, MAX_RAW_BYTES)
    if expected > cap:
        name = limit if max_bytes <= MAX_RAW_BYTES else "MAX_RAW_BYTES"
        raise MalformedTensor(
            field, f"shape {list(shape)} needs {expected} bytes, over the {cap}-byte {name}"
        )
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
    if tensor.HasField("crc32") and zlib.crc32(raw) != tensor.crc32:
        raise MalformedTensor(
            field, f"fails its crc32 check (sent {tensor.crc32:#010x}, got {zlib.crc32(raw):#010x})"
        )
    array = np.frombuffer(raw, dtype=np_dtype).reshape(shape)
    if tensor.dtype == Dtype.DTYPE_BF16:
        return (array.astype(np.uint32) << 16).view(np.float32)
    return array


def _to_bf16_bits(array: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(array, dtype=np.float32).view(np.uint32)
    rounding = ((bits >> 16) & 1) + 0x7FFF
    return ((bits + rounding) >> 16).astype("<u2")


def _lanes(raw: np.ndarray) -> np.ndarray:
    """[itemsize, n] view-copy: row k holds byte k of every element."""
    return np.ascontiguousarray(raw.reshape(-1).view(np.uint8).reshape(-1, raw.dtype.itemsize).T)


def _compress(raw: np.ndarray, codec: int) -> bytes:
    if codec == Codec.CODEC_ZSTD:
        return _compressor().compress(raw.tobytes())
    if codec == Codec.CODEC_BYTE_SPLIT_ZSTD:
        return _compressor().compress(_lanes(raw).tobytes())
    if codec == Codec.CODEC_LANE_BLOCKS_ZSTD:
        # One frame (its header declares the full size), a block boundary after every lane.
        stream = _compressor().compressobj(size=raw.nbytes)
        parts = []
        for lane in _lanes(raw):
            parts.append(stream.compress(lane.tobytes()))
            parts.append(stream.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK))
        parts.append(stream.flush(zstandard.COMPRESSOBJ_FLUSH_FINISH))
        return b"".join(parts)
    if codec == Codec.CODEC_QUANTUM_ZSTD:
        if raw.dtype != np.dtype("<f4"):
            raise InvalidArgument("codec", f"CODEC_QUANTUM_ZSTD takes float32 tensors, not {raw.dtype}")
        return quantum.encode_fp32(raw)
    raise InvalidArgument("codec", f"unknown codec {codec}")


def _decompress(tensor: tensor_pb2.Tensor, expected: int, field: str) -> bytes:
    codec = tensor.codec
    if codec in (Codec.CODEC_NONE, Codec.CODEC_UNSPECIFIED):
        return tensor.data
    if codec == Codec.CODEC_QUANTUM_ZSTD:
        if tensor.dtype != Dtype.DTYPE_FP32:
            raise MalformedTensor(
                field, f"is CODEC_QUANTUM_ZSTD data of dtype {Dtype.Name(tensor.dtype)}, not FP32"
            )
        try:
            return quantum.decode_fp32(tensor.data, expected // 4).tobytes()
        except quantum.QuantumFrameError as exc:
            raise MalformedTensor(field, f"is CODEC_QUANTUM_ZSTD data that {exc}") from None
    if codec not in _ZSTD_CODECS:
        raise MalformedTensor(field, f"has unknown codec {codec}")
    name = Codec.Name(codec)
    try:
        # Refuse before allocating: the frame must declare exactly the size the shape needs.
        declared = zstandard.frame_content_size(tensor.data)
        if declared != expected:
            said = "no content size" if declared < 0 else f"{declared} bytes"
            raise MalformedTensor(field, f"is {name} data declaring {said} but shape needs {expected}")
        raw = _decompressor().decompress(tensor.data, max_output_size=max(expected, 1))
    except zstandard.ZstdError as exc:
        raise MalformedTensor(field, f"is not valid {name} data ({exc})") from None
    if codec in _LANE_CODECS and len(raw) == expected:
        itemsize = _NUMPY_OF[tensor.dtype].itemsize
        lanes = np.frombuffer(raw, dtype=np.uint8).reshape(itemsize, -1)
        raw = np.ascontiguousarray(lanes.T).tobytes()
    return raw
