"""A StepResult is read once into a typed StepAnswer: which fields it carries, its tensors
decoded and checked there (fast, no model)."""

from __future__ import annotations

import numpy as np
import pytest

from pipeshard.errors import Internal, PipeshardError
from pipeshard.services.coordinator.step_answer import Drawn, read_answer
from pipeshard.tensor_codec import encode
from pipeshard.v1 import activation_pb2


def test_a_greedy_answer_carries_its_argmax_ids_and_nothing_else():
    answer = read_answer(
        activation_pb2.StepResult(top1=activation_pb2.Top1(token_ids=[4, 9], probabilities=[0.5, 0.25]))
    )
    assert (answer.top1, answer.top1_probabilities) == ([4, 9], [0.5, 0.25])
    assert answer.drawn is answer.logits is answer.features is answer.heads is None
    with pytest.raises(Internal, match="no logits"):
        answer.rows()


def test_logits_features_and_draws_are_read_into_their_fields():
    logits = np.arange(6, dtype=np.float32).reshape(2, 3)
    result = activation_pb2.StepResult(
        logits=encode(logits),
        features=encode(np.ones((2, 4), dtype=np.float32)),
        sampled=activation_pb2.SampledTokens(token_ids=[5], rng_state=b"state"),
    )
    answer = read_answer(result)
    np.testing.assert_array_equal(answer.rows(), logits)
    assert answer.features is not None and answer.features.shape == (2, 4)
    assert answer.drawn == Drawn([5], b"state") and answer.top1 == []


def test_a_malformed_tensor_is_refused_where_the_answer_is_read():
    result = activation_pb2.StepResult(logits=encode(np.zeros((2, 3), dtype=np.float32)))
    result.logits.shape[:] = [-1, 3]
    with pytest.raises(PipeshardError, match="logits"):
        read_answer(result)
