"""Slow-link features on a real loopback fleet: each hop measures its link and, on loopback,
leaves compression off (``--codec auto``, the default); sampling on the final stage gives the
same tokens for a seed as sampling at the coordinator from shipped logits."""

from __future__ import annotations

import asyncio
import json
import socket
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pipeshard.clients.client import PipeshardClient
from pipeshard.identity import Identity
from pipeshard.services.coordinator.fleet_kv import AUTO, FleetKv
from pipeshard.services.coordinator.generation import Generation, Summary
from pipeshard.services.coordinator.remote_stages import RemoteStages
from pipeshard.services.coordinator.ring import Ring, SessionTerms, StageFailed
from pipeshard.services.coordinator.sampling import SamplingParams
from pipeshard.services.coordinator.scheduler import Scheduler
from pipeshard.shard.prompting import Prompter

pytestmark = pytest.mark.slow
PROMPT = "Explain in a few sentences how a refrigerator keeps food cold, step by step."


@pytest.fixture(scope="module")
def shards(smollm2_export):
    return smollm2_export(2, "int4")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def fleet(shards, fleet_factory):
    metrics = {name: _free_port() for name in ("stage0", "stage1")}
    started = fleet_factory(shards, 2, metrics_ports=metrics)
    started.metrics_ports = metrics
    return started


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


async def _ring(fleet) -> Ring[RemoteStages]:
    """A ring over the fleet's stages, batching (or not) as they report their backend does."""
    stages = RemoteStages(fleet.stages)
    await stages.start()
    await stages.wait_ready(60)
    return Ring(stages, FleetKv.agreed(AUTO, await stages.stage_infos()))


def _coordinator_side(fleet, shards, params: SamplingParams) -> tuple[list[int], float | None]:
    """The same request through the same stages, sampled here from shipped logits (as before);
    also the return link's bandwidth as this ring measured it."""
    prompter = Prompter.from_dir(shards)
    ids = prompter.encode("", [("user", PROMPT)])

    async def run() -> tuple[list[int], float | None]:
        ring = await _ring(fleet)
        try:
            gen = Generation(ring, prompter.tokenizer, prompter.eos_ids, final_stage_sampling=False)
            events = [e async for e in gen.run(ids, params)]
            await gen.released()
        finally:
            await ring.close()
        summary = events[-1]
        assert isinstance(summary, Summary)
        return summary.token_ids, ring.stages.results_link.bandwidth_bytes_s

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


def _frames_by_codec(fleet, stage: str, link_prefix: str) -> dict[str, float]:
    """Tensors ``stage`` has sent on its links named ``link_prefix``..., by codec (its metrics)."""
    url = f"http://127.0.0.1:{fleet.metrics_ports[stage]}/metrics"
    with urllib.request.urlopen(url, timeout=30) as response:
        text = response.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "pipeshard_link_frames_total" and sample.labels["link"].startswith(link_prefix):
                out[sample.labels["codec"]] = out.get(sample.labels["codec"], 0.0) + sample.value
    return out


def test_each_session_sends_with_the_codec_it_opened_with(fleet, shards):
    """OpenSession's codec: a session asking none sends raw frames (and raw logits on the results
    link), one asking lane blocks compresses them, in the same fleet, with the same tokens."""
    prompter = Prompter.from_dir(shards)
    ids = prompter.encode("", [("user", PROMPT)])
    tokens: dict[tuple[str, str], list[int]] = {}
    sent: dict[tuple[str, str], dict[str, float]] = {}

    async def run() -> None:
        ring = await _ring(fleet)
        try:
            gen = Generation(ring, prompter.tokenizer, prompter.eos_ids, final_stage_sampling=False)
            for kind, params in (
                ("greedy", SamplingParams(max_tokens=6, ignore_eos=True)),
                ("logits", SamplingParams(max_tokens=6, temperature=0.8, seed=3, ignore_eos=True)),
            ):
                stage, link = ("stage0", "") if kind == "greedy" else ("stage1", "results-")
                for codec in ("none", "lane_blocks_zstd"):
                    before = _frames_by_codec(fleet, stage, link)
                    # The codec rides on the request's admission, as a batch job's items' does.
                    async with Scheduler(1, 0).admit(Identity(""), 0, codec=codec) as admission:
                        plain = gen.check_speculative("", 0)
                        events = [e async for e in gen.generate(ids, params, plain, admission=admission)]
                    after = _frames_by_codec(fleet, stage, link)
                    tokens[(kind, codec)] = events[-1].token_ids
                    sent[(kind, codec)] = {c: n - before.get(c, 0.0) for c, n in after.items()}
            with pytest.raises(StageFailed) as bad:
                await ring.stages.open_session("bad-codec", SessionTerms(codec="gzip"))
            assert bad.value.code == "INVALID_ARGUMENT" and "`codec`" in str(bad.value)
            await gen.released()
        finally:
            await ring.close()

    asyncio.run(run())
    for kind in ("greedy", "logits"):
        assert len(tokens[(kind, "none")]) == 6
        assert tokens[(kind, "none")] == tokens[(kind, "lane_blocks_zstd")]
        off, on = sent[(kind, "none")], sent[(kind, "lane_blocks_zstd")]
        # Stage 0 sends a frame per step (prefill + decode steps); the results link a logits tensor.
        assert off.get("CODEC_NONE", 0) >= 5 and off.get("CODEC_LANE_BLOCKS_ZSTD", 0) == 0, (kind, off)
        assert on.get("CODEC_LANE_BLOCKS_ZSTD", 0) >= 5 and on.get("CODEC_NONE", 0) == 0, (kind, on)
