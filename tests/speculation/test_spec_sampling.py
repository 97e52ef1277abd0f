"""Speculative sampling follows the target's distribution (rejection-sampling correction).

Over many seeds, the empirical distribution of the tokens that speculation produced (the second
and third of each generation; the first comes from the prefill) must match plain sampling from
the target; a two-sample chi-square test that fails when the draft's distribution leaks through
(tests/speculation/test_speculation_units.py shows the same test catching such a leak).
"""

from __future__ import annotations

from collections import Counter

import pytest
from scipy import stats

from pipeshard.services.coordinator.sampling import SamplingParams
from pipeshard.shard.prompting import Prompter
from tests.speculation.conftest import generate

pytestmark = pytest.mark.slow

SEEDS = 300


def _table(a: Counter, b: Counter, min_count: int = 5) -> list[list[int]]:
    keys = sorted(set(a) | set(b))
    common = [k for k in keys if a[k] + b[k] >= min_count]
    rows = [[a[k] for k in common], [b[k] for k in common]]
    rest = [sum(a[k] for k in keys if k not in common), sum(b[k] for k in keys if k not in common)]
    if sum(rest):
        rows[0].append(rest[0])
        rows[1].append(rest[1])
    return rows


def test_speculative_sampling_matches_plain_sampling(spec_generation, smollm2_export):
    generation, mode = spec_generation(1, "self")
    # A short raw prompt: the test is about the sampled tokens, not the prefill.
    ids = Prompter.from_dir(smollm2_export(1, "fp32")).encode("Once upon a time, in a small village,", [])
    plain, spec = Counter(), Counter()
    verified = 0
    for seed in range(SEEDS):
        params = SamplingParams(max_tokens=3, temperature=1.0, top_k=6, seed=seed, ignore_eos=True)
        a = generate(generation, ids, params, "none", 0)
        b = generate(generation, ids, params, mode, 3)
        verified += b.verify_steps
        plain[tuple(a.token_ids[1:])] += 1
        spec[tuple(b.token_ids[1:])] += 1
    assert verified >= SEEDS  # every generation went through at least one speculative verify
    table = _table(plain, spec)
    assert len(table[0]) >= 4, "the distribution is too concentrated to test"
    p_value = stats.chi2_contingency(table).pvalue
    assert p_value > 1e-3, (p_value, table)
