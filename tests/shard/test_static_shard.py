"""Static stateless shards (``pipeshard export --static``) of SmolLM2, INT4: the export's fixed
shapes and missing state, the stage's KV buffers, and greedy tokens equal to the paged backend's
over 128 tokens in exact mode (in process; real stage processes: tests/pipeline/test_static_fleet.py)."""

from __future__ import annotations

import asyncio

import numpy as np
import openvino as ov
import pytest

from pipeshard.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from pipeshard.services.coordinator.generation import Generation, Summary
from pipeshard.services.coordinator.in_process import batched_ring
from pipeshard.services.coordinator.sampling import SamplingParams
from pipeshard.shard.manifest import load_manifest
from pipeshard.shard.prompting import Prompter
from pipeshard.shard.static import StaticRow, StaticShard

pytestmark = pytest.mark.slow

TOKENS = 128
STATIC_SLOTS, STATIC_CHUNK, STATIC_CONTEXT = 4, 16, 512  # the smollm2_static_export fixture's


def test_a_static_export_has_fixed_shapes_and_no_state(smollm2_static_export):
    export = smollm2_static_export(2)
    manifest = load_manifest(export)
    assert manifest.kv_layout == "static"
    assert (manifest.static.slots, manifest.static.chunk) == (STATIC_SLOTS, STATIC_CHUNK)
    core = ov.Core()
    for entry in manifest.stages:
        # The [S, C] model and its [S, 1] decode twin: same KV inputs, their own rows.
        assert entry.decode_model
        for path, chunk in ((entry.model, STATIC_CHUNK), (entry.decode_model, 1)):
            model = core.read_model(str(export / path))
            assert not model.get_variables() and entry.kv_reorder.read_values == 0
            assert all(p.get_partial_shape().is_static for p in [*model.inputs, *model.outputs])
            ports = {p.get_any_name(): list(p.get_shape()) for p in model.inputs}
            first_kv = f"past_key_values.{entry.layer_start}.key"
            assert ports[first_kv] == [STATIC_SLOTS, 3, STATIC_CONTEXT, 64]
            assert ports["attention_mask"] == [STATIC_SLOTS, STATIC_CONTEXT + chunk]
            assert ports["position_ids"] == [STATIC_SLOTS, chunk]
            assert entry.state_variables[0] == first_kv
            outs = {p.get_any_name(): list(p.get_shape()) for p in model.outputs}
            assert outs[f"present.{entry.layer_start}.key"] == [STATIC_SLOTS, 3, chunk, 64]


def test_a_static_stage_refuses_rows_beyond_its_shapes_by_name(smollm2_static_export, smollm2_export):
    shard = StaticShard(smollm2_static_export(2), 0, num_threads=1)
    ids = np.ones(STATIC_CHUNK + 1, np.int64)
    with pytest.raises(InvalidArgument, match="`tokens` a row holds at most 16 tokens on the static shard"):
        shard.step([StaticRow(0, 0, ids, np.arange(len(ids)))])
    with pytest.raises(InvalidArgument, match=r"`slot_id` must be in \[0, 4\)"):
        shard.step([StaticRow(4, 0, ids[:2], np.arange(2))])
    with pytest.raises(InvalidArgument, match="`positions` slot 0 would grow to 514 positions"):
        shard.step([StaticRow(0, STATIC_CONTEXT - 1, ids[:3], np.arange(3))])
    slots = [shard.acquire() for _ in range(STATIC_SLOTS)]
    assert slots == [0, 1, 2, 3]
    with pytest.raises(ResourceExhausted, match="all 4 slots of the static shard"):
        shard.acquire()
    with pytest.raises(FailedPrecondition, match="static stages need `pipeshard export --static`"):
        StaticShard(smollm2_export(2, "int4"), 0)


def _greedy(ring, prompter: Prompter, prompt_ids: list[list[int]], together: bool) -> list[list[int]]:
    generation = Generation(ring, prompter.tokenizer, prompter.eos_ids, prefill_chunk=ring.prefill_chunk)

    async def one(ids: list[int]) -> list[int]:
        params = SamplingParams(max_tokens=TOKENS, ignore_eos=True)
        events = [e async for e in generation.run(list(ids), params)]
        assert isinstance(events[-1], Summary)
        return events[-1].token_ids

    async def run() -> list[list[int]]:
        if together:
            return list(await asyncio.gather(*(one(ids) for ids in prompt_ids)))
        return [await one(ids) for ids in prompt_ids]

    return asyncio.run(run())


@pytest.mark.parametrize("stages", [2, pytest.param(3, marks=pytest.mark.extended)])
def test_static_greedy_of_four_sessions_at_once_equals_paged_alone_over_128_tokens(
    stages, smollm2_static_export, smollm2_export, chat_prompt_ids
):
    """In exact mode at one thread: the static ring (16-token prefill chunks, every step one
    inference over the 4 slots, the four sessions sharing it) gives each session the paged ring's
    tokens of its solo run. Three stages (extended) cover a middle stage (hidden states in and out
    under one name): binding its output by that name once fed it zeros."""
    static_dir, paged_dir = smollm2_static_export(stages), smollm2_export(stages, "int4")
    prompter = Prompter.from_dir(static_dir)
    ids = chat_prompt_ids[:STATIC_SLOTS]
    paged = _greedy(batched_ring(paged_dir, "exact", 1), prompter, ids, together=False)
    static_ring = batched_ring(static_dir, "exact", 1)
    assert static_ring.stages.kv_backend == "static" and static_ring.prefill_chunk == STATIC_CHUNK
    assert _greedy(static_ring, prompter, ids, together=True) == paged
