"""Tensor codec: round trips for every dtype and codec, and rejection of malformed tensors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from pipeshard.errors import InvalidArgument
from pipeshard.tensor_codec import Codec, Dtype, MalformedTensor, decode, encode

CODECS = [Codec.CODEC_NONE, Codec.CODEC_ZSTD, Codec.CODEC_BYTE_SPLIT_ZSTD]
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
