"""Real multi-process fleets on loopback (ephemeral ports), shared per test module (a fleet that
several modules need unchanged is shared across them: shared_fleet, default_fleet in tests/conftest.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from pipeshard.precision import DEFAULT_PRECISION
from pipeshard.services.launcher import Fleet, start_fleet


@pytest.fixture(scope="module")
def fleet_factory(tmp_path_factory):
    """Factory: start a fleet for an export; every fleet started is stopped when the module ends."""
    fleets: list[Fleet] = []

    def start(shards: Path, stages: int, precision: str = DEFAULT_PRECISION, **kwargs) -> Fleet:
        run_dir = tmp_path_factory.mktemp(f"fleet-{stages}s")
        fleet = start_fleet(shards, stages, run_dir, precision=precision, **kwargs)
        fleets.append(fleet)
        return fleet

    yield start
    for fleet in fleets:
        fleet.stop()


def _greedy_in_process(
    shards: Path,
    prompt_ids: list[list[int]],
    max_tokens: int,
    precision: str = DEFAULT_PRECISION,
    num_threads: int | None = None,
    **ring_options,
) -> list[list[int]]:
    from pipeshard.services.coordinator.generation import Generation, Summary
    from pipeshard.services.coordinator.in_process import batched_ring
    from pipeshard.services.coordinator.sampling import SamplingParams
    from pipeshard.shard.prompting import Prompter

    prompter = Prompter.from_dir(shards)
    ring = batched_ring(shards, precision, num_threads, **ring_options)
    generation = Generation(ring, prompter.tokenizer, prompter.eos_ids, prefill_chunk=ring.prefill_chunk)

    async def run() -> list[list[int]]:
        out = []
        for ids in prompt_ids:
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            async for event in generation.run(list(ids), params):
                if isinstance(event, Summary):
                    out.append(event.token_ids)
        return out

    return asyncio.run(run())


@pytest.fixture(scope="session")
def greedy_in_process() -> Callable[..., list[list[int]]]:
    """Function: greedy continuations (EOS ignored) of each prompt's ids, one prompt after another,
    from the in-process paged ring ``generate --local`` runs (batched_ring; ``precision``,
    ``num_threads`` and the ring's keyword options as given): what a fleet's tokens are checked against."""
    return _greedy_in_process
