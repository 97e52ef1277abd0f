"""Each generated token's logprob, as the coordinator reports it, against logits computed
independently: HF transformers teacher-forced on the whole sequence (FP32 shards at ``f32``, within
1e-4), and the INT4 shards' own logits decoded step by step (the default deployment)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from pipeshard.services.coordinator.generation import Generation, Summary
from pipeshard.services.coordinator.in_process import local_ring
from pipeshard.services.coordinator.sampling import SamplingParams
from pipeshard.services.coordinator.speculation.sources import DraftSources
from pipeshard.shard.chain import LocalChain
from pipeshard.shard.prompting import Prompter

pytestmark = pytest.mark.slow

TOKENS = 24


def generate(shards, precision: str, prompt_ids: list[int], **kwargs) -> Summary:
    prompter = Prompter.from_dir(shards)
    ring = local_ring(shards, precision=precision)
    generation = Generation(ring, prompter.tokenizer, prompter.eos_ids, drafts=DraftSources(shards))
    speculative = kwargs.pop("speculative", "")
    k = kwargs.pop("k", 0)
    params = SamplingParams(max_tokens=TOKENS, ignore_eos=True, logprobs=True, **kwargs)

    async def run() -> Summary:
        return [e async for e in generation.run(prompt_ids, params, speculative=speculative, k=k)][-1]

    return asyncio.run(run())


def log_softmax(logits: np.ndarray) -> np.ndarray:
    rows = logits.astype(np.float64)
    top = rows.max(axis=-1, keepdims=True)
    return rows - top - np.log(np.exp(rows - top).sum(axis=-1, keepdims=True))


def hf_logprobs(hf_model, prompt_ids: list[int], tokens: list[int]) -> list[float]:
    """The model's log-probability of each generated token, teacher-forced in one pass."""
    import torch

    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt_ids + tokens])).logits[0].numpy()
    rows = log_softmax(logits[len(prompt_ids) - 1 : len(prompt_ids) - 1 + len(tokens)])
    return [float(rows[i, t]) for i, t in enumerate(tokens)]


@pytest.fixture(scope="module")
def prompt_ids(chat_prompt_ids) -> list[int]:
    return chat_prompt_ids[5]


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({}, id="greedy"),  # from the final stage's Top1 probability
        pytest.param({"speculative": "ngram", "k": 3}, id="greedy-speculative", marks=pytest.mark.extended),
        # sampled: from the logits (raw, untempered)
        pytest.param(
            {"temperature": 0.8, "top_p": 0.9, "seed": 11}, id="sampled", marks=pytest.mark.extended
        ),
    ],
)
def test_logprobs_equal_hf_teacher_forced_on_fp32(smollm2_export, hf_model, prompt_ids, kwargs):
    summary = generate(smollm2_export(2, "fp32"), "f32", prompt_ids, **kwargs)
    assert len(summary.logprobs) == len(summary.token_ids) == TOKENS
    expected = hf_logprobs(hf_model, prompt_ids, summary.token_ids)
    assert np.max(np.abs(np.array(summary.logprobs) - expected)) < 1e-4
    assert all(lp <= 0 for lp in summary.logprobs)
    if not kwargs:  # greedy tokens are the argmax: the most likely, often far from certain
        assert min(summary.logprobs) > -5 and max(summary.logprobs) > -1e-3


def test_greedy_logprobs_equal_the_int4_shards_own_logits(smollm2_export, prompt_ids):
    shards = smollm2_export(2, "int4")
    summary = generate(shards, "default", prompt_ids)
    chain = LocalChain(shards)
    x: np.ndarray = np.array([prompt_ids], dtype=np.int64)  # the prompt in one step, then a token each
    expected = []
    for token in summary.token_ids:
        for session in chain.sessions:
            x = session.run(x)
        expected.append(float(log_softmax(x[0, -1])[token]))
        x = np.array([[token]], dtype=np.int64)
    assert np.max(np.abs(np.array(summary.logprobs) - expected)) < 1e-4
