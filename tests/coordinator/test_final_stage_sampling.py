"""Sampling on the final stage (RETURN_MODE_SAMPLED) draws exactly what the coordinator would:
the same rows and the same generator state give the same tokens, plain and speculative."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from pipeshard.errors import InvalidArgument
from pipeshard.sampling import Distribution, accept_sampled, restore_rng, rng_state, sample_step
from pipeshard.services.coordinator.generation import Generation, Summary
from pipeshard.services.coordinator.sampling import Sampler, SamplingParams
from pipeshard.services.coordinator.speculation.sources import DraftSources
from pipeshard.services.stage.domain import SamplingStep
from pipeshard.services.stage.wire import step_from_frame, token_frame
from pipeshard.shard.prompting import Prompter
from pipeshard.v1 import activation_pb2
from tests.coordinator.result_spy import ResultSpy

PARAMS = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, top_k=40, seed=11)


def _rows(n: int, vocab: int = 300, seed: int = 3) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((n, vocab)) * 3).astype(np.float32)


def test_rng_state_round_trips_and_continues_the_same_stream():
    a, b = np.random.default_rng(5), np.random.default_rng(99)
    a.random()
    restore_rng(b, rng_state(a))
    assert [a.random() for _ in range(3)] == [b.random() for _ in range(3)]


def test_bad_rng_state_names_the_field():
    with pytest.raises(InvalidArgument, match=r"`sampling\.rng_state`"):
        sample_step(_rows(1), Distribution(1.0), [], b"short")


@pytest.mark.parametrize("drafts", [[], [4, 9], [17, 250, 3]])
def test_stage_draw_equals_the_coordinators(drafts):
    rows = _rows(len(drafts) + 1)
    for seed in range(20):
        coordinator = Sampler(SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=seed))
        shipped = rng_state(coordinator.rng)
        expected = accept_sampled(drafts, None, rows, coordinator.probabilities, coordinator.rng)
        tokens, after = sample_step(rows, coordinator.distribution, drafts, shipped)
        assert tokens == expected
        assert after == rng_state(coordinator.rng)


def _frame(**sampling) -> activation_pb2.ActivationFrame:
    state = sampling.pop("rng_state", rng_state(np.random.default_rng(0)))
    dist = Distribution(**{"temperature": 1.0, "top_p": 1.0, **sampling})
    return token_frame("s", 0, [1], 0, False, sampling=SamplingStep(dist, state))


@pytest.mark.parametrize(
    ("sampling", "field"),
    [
        ({"temperature": 0.0}, "plan.rows.sampling.temperature"),
        ({"top_p": 1.5}, "plan.rows.sampling.top_p"),
        ({"top_k": -2}, "plan.rows.sampling.top_k"),
        ({"rng_state": b"\x00" * 3}, "plan.rows.sampling.rng_state"),
    ],
)
def test_bad_sampling_request_names_the_field(sampling, field):
    frame = _frame(**sampling)
    assert frame.plan.rows[0].return_mode == activation_pb2.RETURN_MODE_SAMPLED
    with pytest.raises(InvalidArgument, match=f"`{field}`"):
        step_from_frame(frame, "input_ids")


def test_sampled_mode_without_a_request_is_refused():
    frame = token_frame("s", 0, [1], 0, False)
    frame.plan.rows[0].return_mode = activation_pb2.RETURN_MODE_SAMPLED
    with pytest.raises(InvalidArgument, match=r"`plan\.rows\.sampling`"):
        step_from_frame(frame, "input_ids")


@pytest.fixture(scope="module")
def spy_ring(smollm2_export):
    export = smollm2_export(2, "int4")
    return export, ResultSpy.stateful(export).ring()


@pytest.mark.slow
@pytest.mark.parametrize("speculative", ["none", pytest.param("ngram", marks=pytest.mark.extended)])
def test_same_seed_same_tokens_with_and_without_final_stage_sampling(spy_ring, speculative):
    export, ring = spy_ring
    prompter = Prompter.from_dir(export)
    ids = prompter.encode("", [("user", "Tell me a story about a cat and a cat and a cat.")])

    def run(on_stage: bool, seed: int) -> list[int]:
        gen = Generation(
            ring,
            prompter.tokenizer,
            prompter.eos_ids,
            drafts=DraftSources(export),
            final_stage_sampling=on_stage,
        )
        params = SamplingParams(
            max_tokens=24, temperature=0.9, top_p=0.95, top_k=40, seed=seed, ignore_eos=True
        )

        async def go() -> Summary:
            events = [e async for e in gen.run(ids, params, speculative=speculative, k=3)]
            return events[-1]

        return asyncio.run(go()).token_ids

    for seed in (1, 2):
        ring.stages.kinds.clear()
        on_stage = run(True, seed)
        assert set(ring.stages.kinds) == {"sampled"}
        ring.stages.kinds.clear()
        at_coordinator = run(False, seed)
        assert set(ring.stages.kinds) == {"logits"}
        assert on_stage == at_coordinator, seed
        assert len(on_stage) == 24
