"""bench/spec_batch.py's loop check: the most repeated 4-gram and the set's repetition rate."""

from __future__ import annotations

from bench.spec_batch import MAX_REPEAT, most_repeated, repetition_rate


def test_a_looping_answer_is_caught_and_a_natural_one_kept():
    loop = [5, 6, 7, 8] * 5  # "that is a bicycle that is a bicycle ..."
    natural = list(range(40))
    assert most_repeated(loop) == 5 > MAX_REPEAT
    assert most_repeated(natural) == 1 <= MAX_REPEAT
    assert most_repeated([1, 2, 3]) == 0  # shorter than a 4-gram


def test_repetition_rate_counts_repeated_4grams_over_all():
    assert repetition_rate([list(range(10))]) == 0.0
    # 17 4-grams of which the 4 distinct ones are first occurrences: 13 repeats.
    assert repetition_rate([[5, 6, 7, 8] * 5]) == 13 / 17
    assert repetition_rate([[5, 6, 7, 8] * 5, list(range(21))]) == 13 / 35
