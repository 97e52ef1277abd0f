"""bench-spec's tree configurations and its repetition rate."""

from __future__ import annotations

from bench.spec import TREES, repetition_rate, spec_configs


def test_repetition_rate_counts_answers_that_loop():
    looping = [1, 2, 3, 4] * 4  # the 4-gram 1 2 3 4 four times
    natural = list(range(16))
    assert repetition_rate([looping, natural]) == 0.5
    assert repetition_rate([natural, [1, 2, 3, 4] * 3]) == 0.0  # three times is allowed


def test_every_source_gets_chains_trees_and_both_adaptive_modes():
    configs = spec_configs(("ngram",), (5,))
    assert configs["plain"] == ("none", 0, "off")
    assert configs["ngram-k5"] == ("ngram", 5, "off")
    assert configs["ngram-chain-auto"] == ("ngram", 0, "off")
    assert configs["ngram-auto"] == ("ngram", 0, "auto")
    assert all(configs[f"ngram-tree{shape}"] == ("ngram", 0, shape) for shape in TREES)
