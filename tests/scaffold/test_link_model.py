"""The per-link cost model: link estimates from timed acks, and the codec it picks."""

from __future__ import annotations

import numpy as np
import pytest

from pipeshard.errors import InvalidArgument
from pipeshard.link_model import (
    MIN_TIMED_BYTES,
    CodecChooser,
    CodecCost,
    LinkEstimate,
    best_codec,
    transfer_cost_s,
)
from pipeshard.tensor_codec import Codec

MBIT = 1e6 / 8  # bytes per second
# Lane blocks on a SmolLM2 decode frame (make bench-compress): about 80% of raw, ~60 MB/s
# compress and ~200 MB/s decompress; zstd about 90%.
LANES = CodecCost(ratio=0.80, encode_s_per_byte=1 / 60e6, decode_s_per_byte=1 / 200e6, samples=1)
ZSTD = CodecCost(ratio=0.90, encode_s_per_byte=1 / 200e6, decode_s_per_byte=1 / 600e6, samples=1)
COSTS = {Codec.CODEC_LANE_BLOCKS_ZSTD: LANES, Codec.CODEC_ZSTD: ZSTD}
DECODE_FRAME = 2304  # one fp32 hidden state of 576


def test_link_estimate_takes_min_rtt_and_max_rate():
    link = LinkEstimate("hop")
    link.observe(0, 0.010)
    link.observe(100, 0.012)
    assert link.rtt_s == pytest.approx(0.010)
    assert link.bandwidth_bytes_s is None  # no frame large enough to time yet
    link.observe(1_000_000, 0.010 + 0.1)  # 1 MB in 100 ms
    link.observe(1_000_000, 0.010 + 0.4)  # queued behind a busy receiver: slower, ignored by the max
    assert link.bandwidth_bytes_s == pytest.approx(10e6)


def test_a_later_smaller_rtt_sharpens_earlier_rates():
    link = LinkEstimate("hop")
    link.observe(0, 0.050)
    link.observe(MIN_TIMED_BYTES * 10, 0.060)
    first = link.bandwidth_bytes_s
    link.observe(0, 0.020)
    assert link.bandwidth_bytes_s < first
    assert link.bandwidth_bytes_s == pytest.approx(MIN_TIMED_BYTES * 10 / 0.040)


def test_transfer_cost_adds_wire_and_cpu_time():
    assert transfer_cost_s(1000, None, 1000.0) == pytest.approx(1.0)
    cost = CodecCost(ratio=0.5, encode_s_per_byte=1e-4, decode_s_per_byte=1e-4, samples=1)
    assert transfer_cost_s(1000, cost, 1000.0) == pytest.approx(0.5 + 0.2)


@pytest.mark.parametrize(
    ("bandwidth", "nbytes", "expected"),
    [
        (None, DECODE_FRAME, Codec.CODEC_NONE),  # nothing measured yet: off
        (20_000 * MBIT, DECODE_FRAME, Codec.CODEC_NONE),  # loopback (~20 Gbit/s): off
        (500 * MBIT, DECODE_FRAME, Codec.CODEC_NONE),  # saves 7 us of wire, costs 50 us of CPU
        (20 * MBIT, DECODE_FRAME, Codec.CODEC_LANE_BLOCKS_ZSTD),  # saves 180 us, costs 50 us
        (20 * MBIT, 32 * 60 * 2304, Codec.CODEC_LANE_BLOCKS_ZSTD),  # a prefill
        (20 * MBIT, 0, Codec.CODEC_NONE),
    ],
)
def test_compression_only_where_wire_time_saved_exceeds_cpu_time(bandwidth, nbytes, expected):
    assert best_codec(nbytes, COSTS, bandwidth) == expected


def test_incompressible_data_stays_off_even_on_a_slow_link():
    flat = {Codec.CODEC_LANE_BLOCKS_ZSTD: CodecCost(ratio=1.0, encode_s_per_byte=1e-9, samples=1)}
    assert best_codec(DECODE_FRAME, flat, 1 * MBIT) == Codec.CODEC_NONE


def _hidden(rows: int = 4) -> np.ndarray:
    rng = np.random.default_rng(0)
    return (rng.standard_normal((1, rows, 576)) * 3).astype(np.float32)


def test_fixed_modes_ignore_the_link():
    link = LinkEstimate("fixed")
    assert CodecChooser("zstd", link).choose(_hidden()) == Codec.CODEC_ZSTD
    assert CodecChooser("none", None).choose(_hidden()) == Codec.CODEC_NONE


def test_auto_measures_its_own_data_and_follows_the_link():
    slow, fast = LinkEstimate("slow"), LinkEstimate("fast")
    for link, seconds in ((slow, 1.0), (fast, 1e-5)):  # 1 MB at 8 Mbit/s and at ~800 Gbit/s
        link.observe(0, 0.001)
        link.observe(1_000_000, 0.001 + seconds)
    # The codecs' sizes are measured on the data; their CPU time on a fake clock (1 us per call),
    # so a loaded machine cannot flip the choice.
    ticks = iter(range(10**6))

    def clock() -> float:
        return next(ticks) * 1e-6

    assert CodecChooser("auto", slow, clock=clock).choose(_hidden()) == Codec.CODEC_LANE_BLOCKS_ZSTD
    assert CodecChooser("auto", fast, clock=clock).choose(_hidden()) == Codec.CODEC_NONE
    assert CodecChooser("auto", None).choose(_hidden()) == Codec.CODEC_NONE
    assert CodecChooser("auto", LinkEstimate("unmeasured")).choose(_hidden()) == Codec.CODEC_NONE


def test_unknown_mode_names_the_codec_parameter():
    with pytest.raises(InvalidArgument, match="`codec`"):
        CodecChooser("gzip", None)


def test_a_probe_trains_rate_counts_with_the_passive_samples():
    link = LinkEstimate("train")
    link.observe_rate(2.5e6)  # 20 Mbit/s from a probe train's ack spacing
    assert link.bandwidth_bytes_s == pytest.approx(2.5e6)
    link.observe(0, 0.05)
    link.observe(MIN_TIMED_BYTES, 0.05 + MIN_TIMED_BYTES / 2.0e6)  # a slower passive sample
    assert link.bandwidth_bytes_s == pytest.approx(2.5e6)


def test_near_break_even_the_current_choice_holds():
    bandwidth = 60 * MBIT  # where lane blocks barely pay off on a decode frame
    plain = transfer_cost_s(DECODE_FRAME, None, bandwidth)
    lanes = transfer_cost_s(DECODE_FRAME, LANES, bandwidth)
    assert lanes < plain < lanes / 0.95  # a saving, but under the 5% margin
    assert best_codec(DECODE_FRAME, COSTS, bandwidth, current=Codec.CODEC_NONE) == Codec.CODEC_NONE
    held = best_codec(DECODE_FRAME, COSTS, bandwidth, current=Codec.CODEC_LANE_BLOCKS_ZSTD)
    assert held == Codec.CODEC_LANE_BLOCKS_ZSTD
