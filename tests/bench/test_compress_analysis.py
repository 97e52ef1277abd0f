"""The analysis transforms bench-compress measures (not shipped) must be exactly lossless, or their
sizes would mean nothing; and bench-wan's summary must pick the worst point and mode."""

from __future__ import annotations

import numpy as np
import pytest

from bench.compress import QUANTA, _quantum_packed, _quantum_unpack, lane_dicts, quantum_pack
from bench.wan import CODECS, MODES, summarise


def _quantized(rng: np.random.Generator, n: int, quantum: float | None = 2.0**-12) -> np.ndarray:
    """Activation-like values, all multiples of ``quantum`` (None: full fp32 mantissas)."""
    x = (rng.standard_normal(n) * 4).astype(np.float32)
    if quantum is not None:
        x = (np.round(x / quantum) * quantum).astype(np.float32)
    return x[None, None, :]


@pytest.mark.parametrize("q", [QUANTA[0], -19, QUANTA[-1]])
def test_quantum_packing_round_trips_awkward_values(q):
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-40, 3.4e38, 24800.0], dtype=np.float32)
    noise = np.random.default_rng(0).standard_normal(200).astype(np.float32)  # every value an exception
    bits = np.concatenate([special, noise]).view(np.uint32)
    assert np.array_equal(_quantum_unpack(_quantum_packed(bits, q, None), bits.size, None), bits)


def test_quantum_packing_drops_the_zero_bits_below_a_common_quantum():
    rng = np.random.default_rng(1)
    quantized = [_quantized(rng, 576) for _ in range(48)]
    full = [_quantized(rng, 576, None) for _ in range(8)]
    assert quantum_pack(quantized[:8]) < quantum_pack(full) - 20  # 12+ mantissa bits of 32 are zero
    assert quantum_pack(quantized[:8], train=quantized[8:]) < quantum_pack(full)


def test_lane_dictionaries_are_lossless_and_compress():
    rng = np.random.default_rng(2)
    frames = [_quantized(rng, 576) for _ in range(40)]
    assert lane_dicts(frames[8:], frames[:8]) < 100.0  # the function checks every lane round trip


def test_wan_summary_takes_the_worst_mode_and_point():
    def config(tok_s: float) -> dict:
        return {"tok_s": tok_s, "samples": [tok_s] * 10, "step": {}}

    points = {}
    for name, auto_logits in (("500mbit_0ms", 10.0), ("20mbit_25ms", 8.0)):
        points[name] = {c: {m: config(10.0) for m in MODES} for c in CODECS}
        points[name]["auto"]["sampled_logits"] = config(auto_logits)
        points[name]["auto"]["sampled_on_stage"] = config(20.0)
    result = summarise(points)
    assert result["auto_vs_best_min"] == pytest.approx(0.8)
    assert result["auto_vs_best_min_at"] == "20mbit_25ms/sampled_logits"
    assert result["final_stage_sampling_speedup_20mbit"] == pytest.approx(2.5)
