"""Request validation names the parameter; the sampler follows temperature/top-k/top-p and its seed."""

from __future__ import annotations

import numpy as np
import pytest

from pipeshard.errors import InvalidArgument
from pipeshard.services.coordinator.sampling import LogitShaper, Sampler, SamplingParams

OK = {"prompt_tokens": 10, "max_context": 200, "vocab_size": 50}


@pytest.mark.parametrize(
    ("params", "field", "text"),
    [
        (SamplingParams(max_tokens=0), "max_tokens", "at least 1"),
        (SamplingParams(max_tokens=-3), "max_tokens", "got -3"),
        (SamplingParams(max_tokens=191), "max_tokens", "at most 190"),
        (SamplingParams(temperature=-0.1), "temperature", "non-negative"),
        (SamplingParams(temperature=float("nan")), "temperature", "non-negative"),
        (SamplingParams(top_p=1.5), "top_p", "got 1.5"),
        (SamplingParams(top_p=0.0), "top_p", "(0, 1]"),
        (SamplingParams(top_k=-1), "top_k", "positive"),
        (SamplingParams(stop=("",)), "stop", "empty"),
        (SamplingParams(stop_token_ids=(50,)), "stop_token_ids", "50"),
    ],
)
def test_invalid_parameters_name_the_field(params, field, text):
    with pytest.raises(InvalidArgument, match=f"`{field}`") as info:
        params.validate(**OK)
    assert text in str(info.value)


def test_prompt_filling_the_context_is_rejected():
    with pytest.raises(InvalidArgument, match="`prompt` has 100 tokens"):
        SamplingParams(max_tokens=1).validate(prompt_tokens=100, max_context=100, vocab_size=50)


def test_valid_parameters_pass():
    SamplingParams(max_tokens=190, temperature=0.7, top_p=0.9, top_k=5, stop=("x",)).validate(**OK)


def test_top_k_and_top_p_truncate_the_distribution():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    probs = Sampler(SamplingParams(temperature=1.0, top_k=2)).probabilities(logits)
    np.testing.assert_allclose(probs, [0.625, 0.375, 0, 0], atol=1e-12)
    probs = Sampler(SamplingParams(temperature=1.0, top_p=0.75)).probabilities(logits)
    np.testing.assert_allclose(probs, [0.625, 0.375, 0, 0], atol=1e-12)
    probs = Sampler(SamplingParams(temperature=1.0, top_p=0.85)).probabilities(logits)
    np.testing.assert_allclose(probs, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0], atol=1e-12)


def test_same_seed_same_draws_and_distribution_is_followed():
    logits = np.log(np.array([0.6, 0.3, 0.1]))
    params = SamplingParams(temperature=1.0, seed=1234)
    first, second = Sampler(params), Sampler(params)
    draws_a = [first.sample(logits) for _ in range(200)]
    draws_b = [second.sample(logits) for _ in range(200)]
    assert draws_a == draws_b and len(set(draws_a)) == 3
    counts = (
        np.bincount(
            [Sampler(SamplingParams(temperature=1.0, seed=i)).sample(logits) for i in range(3000)],
            minlength=3,
        )
        / 3000
    )
    np.testing.assert_allclose(counts, [0.6, 0.3, 0.1], atol=0.03)


def test_resuming_counts_the_streamed_tokens_out_of_max_tokens():
    resumed = SamplingParams(max_tokens=10).resuming([3, 4, 5], vocab_size=50)
    assert (resumed.max_tokens, resumed.resumed) == (7, (3, 4, 5))
    assert SamplingParams(max_tokens=10).resuming([], vocab_size=50) == SamplingParams(max_tokens=10)


@pytest.mark.parametrize(
    ("tokens", "text"),
    [
        ([1] * 10, "fewer than max_tokens (10), got 10"),
        ([1, 50], "50 is not a token id"),
        ([-1], "-1 is not"),
    ],
)
def test_resume_tokens_too_many_or_out_of_vocabulary_name_the_field(tokens, text):
    with pytest.raises(InvalidArgument, match="`resume_token_ids`") as info:
        SamplingParams(max_tokens=10).resuming(tokens, vocab_size=50)
    assert text in str(info.value)


def test_a_resumed_seeded_sampler_draws_what_the_undisturbed_one_would_next():
    """Each token drawn takes one output of the seeded stream: a sampler resumed after n tokens
    continues it where the undisturbed one is after drawing n."""
    rng = np.random.default_rng(0)
    rows = [rng.normal(size=50).astype(np.float32) for _ in range(12)]
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, seed=1234, max_tokens=12)
    whole = Sampler(params)
    tokens = [whole.sample(row) for row in rows]
    resumed = Sampler(params.resuming(tokens[:5], vocab_size=50))
    assert [resumed.sample(row) for row in rows[5:]] == tokens[5:]
    assert [Sampler(params).sample(row) for row in rows[5:]] != tokens[5:]  # the position matters


def test_a_resumed_shaper_counts_the_streamed_tokens_as_generated():
    params = SamplingParams(presence_penalty=1.0, frequency_penalty=0.5, max_tokens=8)
    shaper = LogitShaper(params.resuming([2, 2, 7], vocab_size=10))
    shaped = shaper.shaped(np.zeros(10, dtype=np.float32))
    assert shaped[2] == pytest.approx(-2.0) and shaped[7] == pytest.approx(-1.5) and shaped[0] == 0.0
