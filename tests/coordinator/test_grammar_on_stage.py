"""A greedy request whose only shaping is its grammar sends the grammar's mask with each step and
gets one Top1 id back from the final stage, no row of logits; its tokens equal those chosen on the
coordinator from the logits (the same request with a zero logit_bias, which keeps the logits path).
In-process INT4 2-stage SmolLM2, stateful and paged."""

from __future__ import annotations

import asyncio
import json

import pytest

from pipeshard.services.coordinator.generation import Generation, Summary
from pipeshard.services.coordinator.grammar import Grammars, GrammarSpec
from pipeshard.services.coordinator.sampling import SamplingParams
from pipeshard.shard.prompting import Prompter
from tests.coordinator.result_spy import ResultSpy
from tests.pipeline.schema_check import violations

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 12},
        "rank": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "rank"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("backend", ["stateful", "paged"])
def test_the_grammar_mask_is_applied_on_the_final_stage(smollm2_export, backend):
    export = smollm2_export(2, "int4")
    ring = getattr(ResultSpy, backend)(export).ring()
    prompter = Prompter.from_dir(export)
    grammars = Grammars(prompter.tokenizer, len(prompter.tokenizer), prompter.eos_ids)
    gen = Generation(ring, prompter.tokenizer, prompter.eos_ids, grammars=grammars)
    ids = prompter.encode("", [("user", "Name a big city and its rank as JSON.")])
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))

    def run(**extra) -> Summary:
        params = SamplingParams(max_tokens=48, grammar=spec, **extra)

        async def go() -> Summary:
            events = [e async for e in gen.run(ids, params)]
            return events[-1]

        return asyncio.run(go())

    ring.stages.kinds.clear()
    on_stage = run()
    assert set(ring.stages.kinds) == {"top1"}
    ring.stages.kinds.clear()
    here = run(logit_bias=((0, 0.0),))  # a bias that changes nothing but where the token is chosen
    assert set(ring.stages.kinds) == {"logits"}
    assert on_stage.token_ids == here.token_ids and on_stage.finish_reason == "stop"
    text = prompter.tokenizer.decode([t for t in on_stage.token_ids if t not in prompter.eos_ids])
    assert not violations(json.loads(text), SCHEMA), text
