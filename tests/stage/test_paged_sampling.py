"""Final-stage sampling on paged stages (RETURN_MODE_SAMPLED per plan-frame row): each row of a
batched step draws with its own generator state, so a seed gives the same tokens as the
coordinator's draw from full logits, plain and speculative, next to other sessions' rows."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from pipeshard.errors import InvalidArgument
from pipeshard.sampling import Distribution, rng_state
from pipeshard.services.coordinator.generation import Generation, Summary
from pipeshard.services.coordinator.in_process import InProcessStages
from pipeshard.services.coordinator.sampling import SamplingParams
from pipeshard.services.coordinator.speculation.sources import DraftSources
from pipeshard.services.stage.domain import ReturnMode, SamplingStep, Step, StepOutput
from pipeshard.services.stage.wire import frame_from_outputs, plan_from_frames, step_from_frame, token_frame
from pipeshard.shard.prompting import Prompter
from pipeshard.v1 import activation_pb2


def _sampled(session: str, seed: int, drafts: list[int], **dist) -> activation_pb2.ActivationFrame:
    request = SamplingStep(
        Distribution(**{"temperature": 0.8, "top_p": 0.9, **dist}),
        rng_state(np.random.default_rng(seed)),
        drafts,
    )
    return token_frame(session, 3, [5, *drafts], 10, False, return_last=len(drafts) + 1, sampling=request)


def test_plan_rows_carry_their_own_sampling_request_to_every_stage():
    greedy = token_frame("g", 0, [7], 4, True)
    plan = plan_from_frames([_sampled("a", 1, [11, 12]), greedy, _sampled("b", 2, [], top_k=5)])
    steps = step_from_frame(plan, "input_ids").rows
    assert [s.return_mode for s in steps] == [ReturnMode.SAMPLED, ReturnMode.TOP1, ReturnMode.SAMPLED]
    a, g, b = (s.sampling for s in steps)
    assert g is None
    assert (a.draft_tokens, a.distribution.top_p, b.distribution.top_k) == ([11, 12], 0.9, 5)
    assert a.rng_state == rng_state(np.random.default_rng(1)) != b.rng_state
    # A middle stage forwards each row's request with its hidden states.
    outs = [StepOutput(row=s, hidden_states=np.zeros((1, s.tokens, 4), dtype=np.float32)) for s in steps]
    onward = step_from_frame(frame_from_outputs(Step(steps), outs), "hidden_states").rows
    assert [s.sampling for s in onward] == [a, None, b]


def test_a_bad_row_sampling_request_names_the_row_field():
    plan = plan_from_frames([_sampled("a", 1, [], top_p=1.5)])
    with pytest.raises(InvalidArgument, match=r"`plan\.rows\.sampling\.top_p`"):
        step_from_frame(plan, "input_ids")
    plan.plan.rows[0].ClearField("sampling")
    with pytest.raises(InvalidArgument, match=r"`plan\.rows\.sampling`"):
        step_from_frame(plan, "input_ids")


class _Spy(InProcessStages):
    """Counts the results that came back as drawn tokens, logits and Top1."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.kinds: list[str] = []

    async def run(self, frames):
        results = await super().run(frames)
        self.kinds.extend(_kind(r) for r in results if not isinstance(r, Exception))
        return results


def _kind(result: activation_pb2.StepResult) -> str:
    for kind in ("sampled", "logits", "top1"):
        if result.HasField(kind):
            return kind
    return "none"


@pytest.mark.slow
def test_same_seed_same_tokens_drawn_on_the_paged_stage_or_the_coordinator(smollm2_export):
    export = smollm2_export(2, "int4")
    prompter = Prompter.from_dir(export)
    ring = _Spy.paged(export, "exact", 1, cache_bytes=64 << 20).ring()
    ring.stages.warmup()
    prompts = ["Tell me a story about a cat and a cat and a cat.", "Name three rivers.", "Hi!"]
    ids = [prompter.encode("", [("user", p)]) for p in prompts]
    # (temperature, seed, draft source): two sampled sessions (one speculating) beside a greedy one.
    plans = [(0.9, 1, "ngram"), (0.7, 5, "none"), (0.0, None, "none")]

    def run(on_stage: bool) -> list[list[int]]:
        generation = Generation(
            ring,
            prompter.tokenizer,
            prompter.eos_ids,
            prefill_chunk=ring.prefill_chunk,
            drafts=DraftSources(export),
            final_stage_sampling=on_stage,
        )

        async def one(i: int) -> list[int]:
            temperature, seed, mode = plans[i]
            params = SamplingParams(
                max_tokens=24, temperature=temperature, top_p=0.95, top_k=40, seed=seed, ignore_eos=True
            )
            events = [e async for e in generation.run(ids[i], params, speculative=mode, k=3)]
            assert isinstance(events[-1], Summary)
            return events[-1].token_ids

        async def main():
            out = await asyncio.gather(*(one(i) for i in range(len(plans))))
            await generation.released()
            return out

        return asyncio.run(main())

    ring.stages.kinds.clear()
    on_stage = run(True)
    assert set(ring.stages.kinds) == {"sampled", "top1"}
    ring.stages.kinds.clear()
    at_coordinator = run(False)
    assert set(ring.stages.kinds) == {"logits", "top1"}
    assert on_stage == at_coordinator
    assert all(len(t) == 24 for t in on_stage)
