"""Every codec is bit-exact on real SmolLM2 hidden states (INT4 and fp32 shards, prefill and
decode, as fp32 and as the fp16/bf16 wire formats), lane blocks beat BloomBee's lanes, and the
fp32-only quantum codec is exact and beats lane blocks on decode frames."""

from __future__ import annotations

import numpy as np
import pytest

from bench.compress import capture, frames_by_kind
from pipeshard.shard.prompting import Prompter
from pipeshard.tensor_codec import Codec, decode, encode

pytestmark = pytest.mark.slow
CODECS = [Codec.CODEC_NONE, Codec.CODEC_ZSTD, Codec.CODEC_BYTE_SPLIT_ZSTD, Codec.CODEC_LANE_BLOCKS_ZSTD]


@pytest.fixture(scope="module", params=["int4", "fp32"])
def frames(request, smollm2_export) -> dict[str, list[np.ndarray]]:
    export = smollm2_export(3, request.param)
    prompter = Prompter.from_dir(export)
    prompts = [
        prompter.encode("", [("user", p)]) for p in ("List five fruits that are red.", "Why is the sky blue?")
    ]
    return frames_by_kind(capture(export, prompts, decode_steps=3), batch=2)


def _wire(frame: np.ndarray, codec: int, dtype: str):
    wire = encode(frame, codec, as_fp16=dtype == "fp16", as_bf16=dtype == "bf16")
    return type(wire).FromString(wire.SerializeToString())


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_round_trip_is_bit_exact_on_real_activations(frames, dtype):
    assert set(frames) == {"prefill_b1", "prefill_b2", "decode_b1", "decode_b2"}
    for kind, fs in frames.items():
        for f in fs:
            # the reference: what the (lossy for fp16/bf16) narrowing itself gives, uncompressed
            expected = decode(_wire(f, Codec.CODEC_NONE, dtype)).tobytes()
            for codec in CODECS[1:]:
                assert decode(_wire(f, codec, dtype)).tobytes() == expected, (kind, Codec.Name(codec))


def test_lane_blocks_are_smaller_than_lanes_on_every_kind(frames):
    for kind, fs in frames.items():
        for dtype in ("fp32", "fp16"):
            size = {c: sum(len(_wire(f, c, dtype).data) for f in fs) for c in CODECS}
            assert size[Codec.CODEC_LANE_BLOCKS_ZSTD] < size[Codec.CODEC_BYTE_SPLIT_ZSTD], (kind, dtype, size)
            assert size[Codec.CODEC_LANE_BLOCKS_ZSTD] < size[Codec.CODEC_NONE], (kind, dtype, size)


def test_quantum_codec_is_exact_on_real_activations_and_smaller_on_decode(frames):
    for kind, fs in frames.items():
        for f in fs:
            assert decode(_wire(f, Codec.CODEC_QUANTUM_ZSTD, "fp32")).tobytes() == f.tobytes(), kind
    decode_frames = frames["decode_b1"] + frames["decode_b2"]
    size = {
        c: sum(len(_wire(f, c, "fp32").data) for f in decode_frames)
        for c in (Codec.CODEC_QUANTUM_ZSTD, Codec.CODEC_LANE_BLOCKS_ZSTD)
    }
    # Sums of bf16-computed terms: the mantissa bits below about 2**-19 are zero (make bench-compress).
    assert size[Codec.CODEC_QUANTUM_ZSTD] < size[Codec.CODEC_LANE_BLOCKS_ZSTD], size
