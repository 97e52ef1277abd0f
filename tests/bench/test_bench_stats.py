"""Benchmark statistics: interleaving, warm-up discarded, ratio of medians and its interval."""

from __future__ import annotations

import pytest

from bench.stats import interleaved, interleaved_generations, ratio_ci


def test_interleaved_discards_warmup_and_runs_every_config_each_round():
    calls: list[str] = []
    counter = {"a": 0, "b": 0}

    def make(name):
        def run():
            calls.append(name)
            counter[name] += 1
            return float(counter[name])

        return run

    samples = interleaved({"a": make("a"), "b": make("b")}, runs=4, warmup=2)
    assert samples == {"a": [3.0, 4.0, 5.0, 6.0], "b": [3.0, 4.0, 5.0, 6.0]}
    rounds = [set(calls[i : i + 2]) for i in range(0, len(calls), 2)]
    assert all(r == {"a", "b"} for r in rounds)


def test_ratio_of_medians_and_interval():
    num = [2.0, 2.1, 1.9, 2.0, 2.05, 1.95, 2.0, 2.02, 1.98, 2.0]
    den = [1.0] * 10
    ratio, (lo, hi) = ratio_ci(num, den)
    assert ratio == pytest.approx(2.0)
    assert 1.9 <= lo <= ratio <= hi <= 2.1


def test_interleaved_generations_keeps_last_result():
    results = iter([{"tok_s": float(i), "tokens": [i]} for i in range(10)])
    samples, last = interleaved_generations({"x": lambda: next(results)}, runs=3, warmup=1)
    assert samples["x"] == [1.0, 2.0, 3.0] and last["x"]["tokens"] == [3]


def test_mean_ratio_over_kinds_weighs_every_kind_alike():
    from bench.stats import mean_ratio_ci

    # two kinds: one 4x faster, one unchanged; a slow kind must not dominate as it would in a total
    num = [[4.0, 1.0], [4.0, 1.0], [4.0, 1.0]]
    den = [[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]]
    ratio, ci = mean_ratio_ci(num, den)
    assert ratio == pytest.approx(2.5)
    assert ci == [pytest.approx(2.5), pytest.approx(2.5)]
    noisy, ci = mean_ratio_ci([[2.0], [3.0], [4.0]], [[1.0], [1.0], [1.0]])
    assert noisy == pytest.approx(3.0) and ci[0] < 3.0 < ci[1]
