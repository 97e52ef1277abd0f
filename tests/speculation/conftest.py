"""Shared pieces of the speculative-decoding tests: prompts of many kinds, rings, drafts and
target-only greedy references, each built once per session and per weight format.

FP32 shards run at ``f32``; INT4 shards (the default deployment) at ``exact``, the precision
that promises speculation never changes a token."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from pipeshard.services.coordinator.generation import Generation, Summary
from pipeshard.services.coordinator.in_process import batched_ring, local_ring
from pipeshard.services.coordinator.sampling import SamplingParams
from pipeshard.services.coordinator.speculation.sources import DraftSources
from pipeshard.shard.chain import LocalChain
from pipeshard.shard.prompting import Prompter

REPO_ROOT = Path(__file__).resolve().parents[2]
TOKENS = 256
STAGE_COUNTS = (1, 2, 3)
KS = (1, 3, 5, 8)
SOURCES = ("ngram", "self", "dir")
# The precision each weight format's exactness is checked at.
PRECISION = {"fp32": "f32", "int4": "exact"}

# (kind, chat messages): every kind the issue names, plus a multi-turn chat.
SPEC_PROMPTS: tuple[tuple[str, list[tuple[str, str]]], ...] = (
    ("factual", [("user", "What is the capital of Japan, and what is it known for?")]),
    ("code", [("user", "Write a Python function that checks whether a string is a palindrome.")]),
    ("list", [("user", "List ten fruits, one per line.")]),
    ("translation", [("user", "Translate into French: 'The weather is nice today and I want to go out.'")]),
    ("creative", [("user", "Write a short poem about the sea at night.")]),
    (
        "chat",
        [
            ("user", "Hi! Who are you?"),
            ("assistant", "I am a helpful assistant."),
            ("user", "What can you do?"),
        ],
    ),
    ("reasoning", [("user", "If I have 3 apples and buy 5 more, then eat 2, how many do I have? Explain.")]),
    ("technical", [("user", "Explain how a hash table handles collisions.")]),
    (
        "code-completion",
        [("user", "Complete this code:\ndef fibonacci(n):\n    if n < 2:\n        return n\n")],
    ),
    ("summary", [("user", "Summarize in three sentences why sleep is important for health.")]),
)


def shards_root() -> Path:
    return Path(os.environ.get("PIPESHARD_TEST_SHARDS", REPO_ROOT / "shards" / ".test"))


@pytest.fixture(scope="session")
def spec_prompt_ids(smollm2_export) -> list[list[int]]:
    prompter = Prompter.from_dir(smollm2_export(1, "fp32"))
    return [prompter.encode("", messages) for _, messages in SPEC_PROMPTS]


@pytest.fixture(scope="session")
def spec_generation(smollm2_export, smollm2_draft, hf_draft_dir):
    """Factory: (Generation over an in-process ring of that many stages and weights at their
    PRECISION, stateful (``local_ring``) or paged (``batched_ring``), draft mode of a source)."""
    built: dict[tuple[int, str, str], Generation] = {}
    self_draft = smollm2_draft(2, 4096, "int4")

    def get(stages: int, source: str, weights: str = "fp32", kv: str = "stateful") -> tuple[Generation, str]:
        if (stages, weights, kv) not in built:
            export = smollm2_export(stages, weights)
            prompter = Prompter.from_dir(export)
            drafts = DraftSources(
                export,
                self_draft=self_draft,
                named={"dir": hf_draft_dir},
                draft_cache=shards_root() / ".drafts",
            )
            ring = (local_ring if kv == "stateful" else batched_ring)(export, PRECISION[weights])
            built[(stages, weights, kv)] = Generation(
                ring, prompter.tokenizer, prompter.eos_ids, drafts=drafts
            )
        return built[(stages, weights, kv)], source

    return get


@pytest.fixture(scope="session")
def greedy_reference(smollm2_export, spec_prompt_ids):
    """Factory: target-only greedy (TOKENS, eos ignored) of prompt i on the export of n stages and
    those weights, at their PRECISION."""
    chains: dict[tuple[int, str], LocalChain] = {}
    cache: dict[tuple[int, int, str], list[int]] = {}

    def get(stages: int, prompt: int, weights: str = "fp32") -> list[int]:
        if (stages, prompt, weights) not in cache:
            if (stages, weights) not in chains:
                chains[(stages, weights)] = LocalChain(smollm2_export(stages, weights), PRECISION[weights])
            out = chains[(stages, weights)].generate_greedy(spec_prompt_ids[prompt], TOKENS, ignore_eos=True)
            cache[(stages, prompt, weights)] = out.token_ids
        return cache[(stages, prompt, weights)]

    return get


def generate(generation: Generation, ids: list[int], params: SamplingParams, mode: str, k: int) -> Summary:
    async def run() -> Summary:
        summary = None
        async for event in generation.run(ids, params, speculative=mode, k=k):
            if isinstance(event, Summary):
                summary = event
        return summary

    return asyncio.run(run())
