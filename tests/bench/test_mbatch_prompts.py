"""bench-mbatch's prompt-set check (bench/batched.py): an answer loops when a 4-gram occurs more
than three times, and the set's repetition rate is the share of looping answers."""

from __future__ import annotations

from bench.batched import PROMPTS, max_4gram_repeats, repetition


def test_a_looping_answer_is_counted_and_a_varied_one_is_not():
    varied = list(range(40))
    looping = [7, 8] + [1, 2, 3, 4] * 4 + [9]
    assert max_4gram_repeats(varied) == 1 and max_4gram_repeats(looping) == 4
    assert max_4gram_repeats([1, 2, 3]) == 0
    out = repetition([varied, looping, [5, 6, 7, 5, 6, 7, 5, 6, 7]])
    assert out == {"rate": 1 / 3, "max_4gram_repeats": [1, 4, 2]}


def test_the_prompt_set_has_sixteen_different_prompts():
    assert len(PROMPTS) == 16 and len(set(PROMPTS)) == 16
