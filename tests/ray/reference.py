"""What the Ray fleets' tokens are checked against."""

from __future__ import annotations

import asyncio
from pathlib import Path

from pipeshard.precision import DEFAULT_PRECISION
from pipeshard.services.coordinator.generation import Generation, Summary
from pipeshard.services.coordinator.in_process import batched_ring
from pipeshard.services.coordinator.sampling import SamplingParams
from pipeshard.shard.prompting import Prompter


def greedy_reference(export: Path, prompts: tuple[str, ...], max_tokens: int) -> list[list[int]]:
    """Each prompt's greedy tokens (eos ignored) from the export in this process, in the
    configuration a fleet serves by default (paged stages at the default precision), so a fleet's
    answer must equal it token for token."""
    prompter = Prompter.from_dir(export)
    ring = batched_ring(export, DEFAULT_PRECISION)

    async def one(prompt: str) -> list[int]:
        generation = Generation(ring, prompter.tokenizer, prompter.eos_ids, prefill_chunk=ring.prefill_chunk)
        ids = prompter.encode("", [("user", prompt)])
        summary = None
        async for event in generation.run(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True)):
            if isinstance(event, Summary):
                summary = event
        assert summary is not None
        return list(summary.token_ids)

    return [asyncio.run(one(p)) for p in prompts]
