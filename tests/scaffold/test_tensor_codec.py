"""Tensor codec: round trips for every dtype and codec, and rejection of malformed tensors."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from pipeshard.errors import InvalidArgument
from pipeshard.tensor_codec import MAX_RAW_BYTES, Codec, Dtype, MalformedTensor, decode, encode

CODECS = [Codec.CODEC_NONE, Codec.CODEC_ZSTD, Codec.CODEC_BYTE_SPLIT_ZSTD, Codec.CODEC_LANE_BLOCKS_ZSTD]
DTYPES = [np.float32, np.float16, np.int64, np.int32, np.uint8, np.int8, np.bool_]
shapes = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=7)


@settings(max_examples=60, deadline=None)
@given(
    array=st.sampled_from(DTYPES).flatmap(lambda dt: hnp.arrays(dt, shapes)),
    codec=st.sampled_from(CODECS),
)
def test_round_trip_is_bit_exact(array, codec):
    wire = encode(array, codec)
    back = decode(type(wire).FromString(wire.SerializeToString()))
    assert back.shape == array.shape
    assert back.dtype == array.dtype.newbyteorder("<")
    assert back.tobytes() == np.ascontiguousarray(array).tobytes()


@settings(max_examples=40, deadline=None)
@given(
    array=hnp.arrays(
        np.float32, shapes, elements=st.floats(-(2.0**100), 2.0**100, width=32, allow_subnormal=False)
    ),
    codec=st.sampled_from(CODECS),
)
def test_bf16_round_trip_keeps_upper_half(array, codec):
    back = decode(encode(array, codec, as_bf16=True))
    assert back.dtype == np.float32
    assert back.shape == array.shape
    # bf16 keeps 8 significant bits: relative error at most 2^-8.
    np.testing.assert_allclose(back, array, rtol=2**-8, atol=0)
    # Decoding is exact on values that are already bf16.
    assert decode(encode(back, codec, as_bf16=True)).tobytes() == back.tobytes()


def test_non_contiguous_and_big_endian_inputs_are_normalised():
    base = np.arange(24, dtype=">f4").reshape(4, 6)
    view = base[:, ::2]
    back = decode(encode(view))
    np.testing.assert_array_equal(back, view)
    assert back.dtype == np.dtype("<f4")


def test_compressed_hidden_state_is_no_larger_than_raw():
    rng = np.random.default_rng(0)
    hidden = (rng.standard_normal((1, 32, 576)) * 4).astype(np.float32)
    plain = encode(hidden, Codec.CODEC_ZSTD)
    lanes = encode(hidden, Codec.CODEC_BYTE_SPLIT_ZSTD)
    assert lanes.raw_size == hidden.nbytes
    assert len(lanes.data) <= hidden.nbytes and len(plain.data) <= hidden.nbytes


@pytest.mark.parametrize("codec", CODECS)
def test_truncated_data_is_rejected_with_field_name(codec):
    wire = encode(np.ones((2, 3), np.float32), codec)
    wire.data = wire.data[:-1]
    with pytest.raises(MalformedTensor, match="`hidden_states`"):
        decode(wire, field="hidden_states")


def test_shape_mismatch_is_rejected():
    wire = encode(np.ones((2, 3), np.float32))
    wire.shape[:] = [2, 4]
    wire.raw_size = 0
    with pytest.raises(MalformedTensor, match=r"needs 32"):
        decode(wire)


def test_raw_size_mismatch_is_rejected():
    wire = encode(np.ones((2, 3), np.float32))
    wire.raw_size = 99
    with pytest.raises(MalformedTensor, match="raw_size 99"):
        decode(wire)


def test_unspecified_dtype_is_rejected():
    wire = encode(np.ones(3, np.float32))
    wire.dtype = Dtype.DTYPE_UNSPECIFIED
    with pytest.raises(MalformedTensor, match="unsupported dtype DTYPE_UNSPECIFIED"):
        decode(wire)


def test_decompression_bomb_is_rejected():
    wire = encode(np.zeros(1 << 20, np.uint8), Codec.CODEC_ZSTD)
    wire.shape[:] = [16]
    wire.raw_size = 16
    with pytest.raises(MalformedTensor):
        decode(wire)


def test_garbage_zstd_is_rejected():
    wire = encode(np.ones(4, np.float32), Codec.CODEC_ZSTD)
    wire.data = b"not zstd at all"
    with pytest.raises(MalformedTensor, match="CODEC_ZSTD"):
        decode(wire)


def test_unsupported_numpy_dtype_names_field():
    with pytest.raises(InvalidArgument, match="`x`"):
        encode(np.ones(3, np.complex64), field="x")


def test_malformed_tensor_maps_to_invalid_argument():
    assert MalformedTensor("t", "bad").code == "INVALID_ARGUMENT"


def _zstd_frame_declaring(size: int) -> bytes:
    """A zstd frame header that declares ``size`` content bytes, then one tiny RLE block."""
    header = struct.pack("<IB", 0xFD2FB528, 0xE0) + struct.pack("<Q", size)  # 8-byte size, one segment
    return header + bytes([0b011, 0, 0]) + b"\0"  # last block, RLE, 0 bytes of a zero


def test_crafted_frame_declaring_a_huge_size_is_refused_before_decompressing():
    wire = encode(np.ones(4, np.float32), Codec.CODEC_ZSTD)
    wire.data = _zstd_frame_declaring(1 << 40)
    assert zstandard.frame_content_size(wire.data) == 1 << 40
    with pytest.raises(MalformedTensor, match=r"`hidden_states`.*declaring 1099511627776 bytes"):
        decode(wire, field="hidden_states")


def test_frame_without_content_size_is_refused():
    raw = np.ones(4, np.float32).tobytes()
    stream = zstandard.ZstdCompressor(write_content_size=False).compressobj()
    wire = encode(np.ones(4, np.float32), Codec.CODEC_ZSTD)
    wire.data = stream.compress(raw) + stream.flush()
    with pytest.raises(MalformedTensor, match="no content size"):
        decode(wire)


def test_shape_over_the_cap_is_refused_unread():
    wire = encode(np.ones(4, np.float32), Codec.CODEC_ZSTD)
    wire.shape[:] = [MAX_RAW_BYTES // 4 + 1]
    wire.raw_size = 0
    with pytest.raises(MalformedTensor, match="over the"):
        decode(wire)


@pytest.mark.parametrize("codec", CODECS)
def test_checksum_mismatch_is_rejected(codec):
    array = np.arange(12, dtype=np.float32)
    wire = encode(array, codec)
    other = encode(array[::-1].copy(), codec)  # same sizes, other bytes
    wire.data = other.data
    with pytest.raises(MalformedTensor, match="`x` fails its crc32 check"):
        decode(wire, field="x")


def test_tensor_without_checksum_still_decodes():
    wire = encode(np.arange(6, dtype=np.int64), Codec.CODEC_LANE_BLOCKS_ZSTD)
    assert wire.HasField("crc32")
    wire.ClearField("crc32")
    np.testing.assert_array_equal(decode(wire), np.arange(6))


def test_unknown_codec_is_rejected_with_field_name():
    wire = encode(np.ones(3, np.float32))
    wire.codec = 99
    with pytest.raises(MalformedTensor, match="`h` has unknown codec 99"):
        decode(wire, field="h")


def test_lane_blocks_is_one_frame_with_a_block_per_lane():
    array = np.arange(64, dtype=np.float32)
    wire = encode(array, Codec.CODEC_LANE_BLOCKS_ZSTD)
    assert zstandard.frame_content_size(wire.data) == array.nbytes
    # Same decompressed layout as BYTE_SPLIT: either label decodes the other's bytes.
    wire.codec = Codec.CODEC_BYTE_SPLIT_ZSTD
    assert decode(wire).tobytes() == array.tobytes()


def test_fp16_wire_is_lossy_and_saturates():
    array = np.array([1.0, 1 / 3, 24800.0, 1e6, -1e6], np.float32)
    back = decode(encode(array, Codec.CODEC_LANE_BLOCKS_ZSTD, as_fp16=True))
    assert back.dtype == np.float16
    np.testing.assert_allclose(back[:3].astype(np.float32), array[:3], rtol=2**-11)
    assert float(back[1]) != float(array[1])  # 1/3 is not exact in fp16: lossy
    assert back[3] == 65504 and back[4] == -65504
    with pytest.raises(InvalidArgument, match="`t`"):
        encode(array, as_fp16=True, as_bf16=True, field="t")
