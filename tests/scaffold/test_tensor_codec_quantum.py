"""CODEC_QUANTUM_ZSTD: bit-exact on every fp32 bit pattern, smaller where values share a quantum,
and its decoder refuses frames whose parts do not add up before allocating for them."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from pipeshard.errors import InvalidArgument
from pipeshard.tensor_codec import Codec, MalformedTensor, decode, encode

Q = Codec.CODEC_QUANTUM_ZSTD


@settings(max_examples=80, deadline=None)
@given(bits=hnp.arrays(np.uint32, hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=40)))
def test_every_fp32_bit_pattern_round_trips(bits):
    """NaN payloads, infinities, subnormals, signed zeros and random mantissas included."""
    array = bits.view(np.float32)
    wire = encode(array, Q)
    back = decode(type(wire).FromString(wire.SerializeToString()))
    assert back.shape == array.shape and back.tobytes() == array.tobytes()


@settings(max_examples=40, deadline=None)
@given(
    scale=st.sampled_from([2.0**-19, 2.0**-12, 2.0**-3]),
    n=st.integers(1, 600),
    outliers=st.integers(0, 5),
)
def test_values_on_a_common_quantum_round_trip_and_shrink(scale, n, outliers):
    rng = np.random.default_rng(n)
    x = (np.round(rng.standard_normal(n) * 4 / scale) * scale).astype(np.float32)
    x[:outliers] = rng.standard_normal(min(outliers, n)).astype(np.float32)  # finer than the quantum
    wire = encode(x, Q)
    assert decode(wire).tobytes() == x.tobytes()
    if n >= 256 and scale >= 2.0**-12:  # small frames pay the 12-byte header and zstd framing
        assert len(wire.data) < 0.8 * x.nbytes  # 9+ of 23 mantissa bits are zero on most values


def test_only_float32_is_taken():
    with pytest.raises(InvalidArgument, match=r"`codec`.*float32"):
        encode(np.ones(4, np.float16), Q)
    wire = encode(np.ones(4, np.float32), Q)
    wire.dtype = 5  # DTYPE_INT32: same itemsize, wrong dtype for the codec
    with pytest.raises(MalformedTensor, match="not FP32"):
        decode(wire)


def _wire(values: np.ndarray):
    return encode(values.astype(np.float32), Q)


@pytest.mark.parametrize(
    ("mutate", "problem"),
    [
        (lambda d: d[:5], "shorter than the 12-byte header"),
        (lambda d: struct.pack("<I", 200) + d[4:], "quantum"),
        (lambda d: d[:4] + struct.pack("<I", 1 << 30) + d[8:], "exceptions for 64 values"),
        (lambda d: d[:8] + struct.pack("<I", 1 << 30) + d[12:], "beyond its end"),
        (lambda d: d + b"\0", "parts need"),
        (lambda d: d[:-1], "parts need"),
    ],
)
def test_inconsistent_frames_are_refused(mutate, problem):
    wire = _wire(np.arange(64) / 8)
    wire.data = mutate(wire.data)
    wire.ClearField("crc32")
    with pytest.raises(MalformedTensor, match=f"`h` is CODEC_QUANTUM_ZSTD data that .*{problem}"):
        decode(wire, field="h")


def test_an_exponent_frame_declaring_more_than_the_shape_is_refused_unread():
    wire = _wire(np.arange(64) / 8)
    q, n_exc, _ = struct.unpack("<III", wire.data[:12])
    bomb = zstandard.ZstdCompressor().compress(bytes(1 << 20))  # declares 1 MiB of exponents
    wire.data = struct.pack("<III", q, n_exc, len(bomb)) + wire.data[12 : 12 + 4 * n_exc] + bomb
    with pytest.raises(MalformedTensor, match="not declaring 64 bytes"):
        decode(wire, field="h")


def test_exception_indices_out_of_order_are_refused():
    x = np.arange(64, dtype=np.float32) / 8
    x[[3, 9]] = np.float32(1 / 3)  # finer than the rest: exceptions
    wire = _wire(x)
    _, n_exc, _ = struct.unpack("<III", wire.data[:12])
    assert n_exc == 2
    swapped = struct.pack("<II", *reversed(struct.unpack("<II", wire.data[12:20])))
    wire.data = wire.data[:12] + swapped + wire.data[20:]
    with pytest.raises(MalformedTensor, match="out of order"):
        decode(wire, field="h")


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=300), n=st.integers(0, 64), keep_header=st.booleans())
def test_arbitrary_bytes_only_ever_fail_as_malformed(data, n, keep_header):
    wire = _wire(np.arange(n) / 8)
    wire.data = wire.data[:12] + data if keep_header else data
    wire.ClearField("crc32")
    try:
        back = decode(wire, field="h")
    except MalformedTensor:
        return
    assert back.shape == (n,)
