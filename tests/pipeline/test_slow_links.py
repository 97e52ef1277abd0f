"""Slow-link features on a real loopback fleet: each hop measures its link and, on loopback,
leaves compression off (``--codec auto``, the default); sampling on the final stage gives the
same tokens for a seed as sampling at the coordinator from shipped logits."""

from __future__ import annotations

import asyncio
import json

import pytest

from pipeshard.clients.client import PipeshardClient
from pipeshard.services.coordinator.generation import Generation, Summary
from pipeshard.services.coordinator.ring import Ring
from pipeshard.services.coordinator.sampling import SamplingParams
from pipeshard.shard.prompting import Prompter

pytestmark = pytest.mark.slow
PROMPT = "Explain in a few sentences how a refrigerator keeps food cold, step by step."


@pytest.fixture(scope="module")
def shards(smollm2_export):
    return smollm2_export(2, "int4")


@pytest.fixture(scope="module")
def fleet(shards, fleet_factory):
    return fleet_factory(shards, 2)


def _events(log_path, name: str) -> list[dict]:
    out = []
    for line in log_path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("event") == name:
            out.append(record)
    return out


def test_loopback_fleet_measures_its_hop_and_picks_none(fleet):
    with PipeshardClient(fleet.coordinator, timeout_s=120) as client:
        result = client.generate(PROMPT, max_tokens=8, ignore_eos=True)
    assert result.completion_tokens == 8
    stage0 = fleet.process("stage0").log
    measured = _events(stage0, "link_measured")
    assert measured, "stage 0 never measured its hop"
    assert measured[-1]["address"] == fleet.stages[1]
    assert measured[-1]["bandwidth_bytes_s"] > 0 and measured[-1]["rtt_s"] > 0
    choices = _events(stage0, "link_codec")
    assert choices and {c["mode"] for c in choices} == {"auto"}
    assert {c["codec"] for c in choices} == {"CODEC_NONE"}


def _coordinator_side(fleet, shards, params: SamplingParams) -> tuple[list[int], float | None]:
    """The same request through the same stages, sampled here from shipped logits (as before);
    also the return link's bandwidth as this ring measured it."""
    prompter = Prompter.from_dir(shards)
    ids = prompter.encode("", [("user", PROMPT)])

    async def run() -> tuple[list[int], float | None]:
        ring = Ring(fleet.stages)
        await ring.start()
        try:
            await ring.wait_ready(60)
            gen = Generation(ring, prompter.tokenizer, prompter.eos_ids, final_stage_sampling=False)
            events = [e async for e in gen.run(ids, params)]
            await gen.released()
        finally:
            await ring.close()
        summary = events[-1]
        assert isinstance(summary, Summary)
        return summary.token_ids, ring.results_link.bandwidth_bytes_s

    return asyncio.run(run())


@pytest.mark.parametrize("seed", [7, 8])
def test_final_stage_sampling_gives_the_seeds_tokens(fleet, shards, seed):
    sampled = dict(max_tokens=24, temperature=0.8, top_p=0.95, top_k=50, seed=seed)
    with PipeshardClient(fleet.coordinator, timeout_s=120) as client:
        on_stage = client.generate(PROMPT, ignore_eos=True, **sampled).token_ids
    assert len(on_stage) == 24
    shipped, results_bandwidth = _coordinator_side(fleet, shards, SamplingParams(ignore_eos=True, **sampled))
    assert on_stage == shipped
    # The shipped logits crossed the results link: measured by the ring's probe, and where that
    # measured loopback-fast the final stage's auto choice leaves them uncompressed (a loaded
    # machine can make the probe train look slow, and then compressing may rightly pay).
    assert results_bandwidth is not None and results_bandwidth > 0
    choices = [
        c for c in _events(fleet.process("stage1").log, "link_codec") if c["link"].startswith("results-")
    ]
    assert choices and {c["mode"] for c in choices} == {"auto"}
    fast = [c for c in choices if (c["bandwidth_bytes_s"] or 0) >= 1e9]
    assert {c["codec"] for c in fast} <= {"CODEC_NONE"}
