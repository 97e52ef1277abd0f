"""The analysis transforms bench-compress measures (not shipped) must be exactly lossless, or their
sizes would mean nothing; and bench-wan's summary must pick the worst point and mode."""

from __future__ import annotations

import numpy as np
import pytest

from bench.compress import lane_dicts, quantum_dict
from bench.wan import CODECS, MODES, SAMPLED_CODECS, summarise


def _quantized(rng: np.random.Generator, n: int, quantum: float | None = 2.0**-12) -> np.ndarray:
    """Activation-like values, all multiples of ``quantum`` (None: full fp32 mantissas)."""
    x = (rng.standard_normal(n) * 4).astype(np.float32)
    if quantum is not None:
        x = (np.round(x / quantum) * quantum).astype(np.float32)
    return x[None, None, :]


def test_quantum_with_an_exponent_dictionary_is_lossless_and_compresses():
    rng = np.random.default_rng(1)
    frames = [_quantized(rng, 576) for _ in range(48)]
    assert quantum_dict(frames[8:], frames[:8]) < 75.0  # the function checks every round trip


def test_lane_dictionaries_are_lossless_and_compress():
    rng = np.random.default_rng(2)
    frames = [_quantized(rng, 576) for _ in range(40)]
    assert lane_dicts(frames[8:], frames[:8]) < 100.0  # the function checks every lane round trip


def test_wan_summary_takes_the_worst_point_and_the_20mbit_speedups():
    def config(tok_s: float, rest_ms: float = 10.0) -> dict:
        step = {"wall_ms": 50.0 + rest_ms, "compute_ms": 50.0, "rest_ms": rest_ms}
        return {"tok_s": tok_s, "samples": [tok_s] * 10, "step": step}

    points = {}
    for name, auto_greedy in (("500mbit_0ms", 10.0), ("20mbit_25ms", 8.0), ("20mbit_0ms", 9.0)):
        points[name] = {c: {"greedy": config(10.0)} for c in CODECS}
        points[name]["auto"]["greedy"] = config(auto_greedy, rest_ms=15.0 if name == "500mbit_0ms" else 10.0)
        if name.startswith("20"):
            for codec in SAMPLED_CODECS:
                points[name][codec]["sampled_on_stage"] = config(20.0)
            points[name]["none"]["sampled_logits"] = config(20.0 / 3 if name == "20mbit_25ms" else 5.0)
            points[name]["auto"]["sampled_logits"] = config(8.0)
    result = summarise(points)
    assert result["auto_vs_best_min"] == pytest.approx(0.8)
    assert result["auto_vs_best_min_ci"] == pytest.approx([0.8, 0.8])
    assert result["auto_vs_best_min_at"] == "20mbit_25ms/greedy"  # greedy alone is measured everywhere
    # With the compute equal, only 500 Mbit/s's 5 ms more of auto's wire and codec time counts.
    assert result["auto_vs_best_same_compute_min"] == pytest.approx(60.0 / 65.0)
    assert result["final_stage_sampling_speedup_20mbit"] == pytest.approx(3.0)  # the worse 20 Mbit/s point
    assert result["final_stage_sampling_speedup_20mbit_auto"] == pytest.approx(2.5)
    assert set(MODES) >= {m for v in points.values() for c in CODECS for m in v[c] if m in MODES}
