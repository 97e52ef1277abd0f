"""The grammar engine on the default model's tokenizer: masks that hold any logits to the schema,
compiles cached per grammar text, and errors that name the parameter."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from pipeshard.errors import InvalidArgument
from pipeshard.services.coordinator.grammar import Grammars, GrammarSpec
from pipeshard.shard.prompting import Prompter
from tests.pipeline.schema_check import violations

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "n": {"type": "integer", "minimum": 3, "maximum": 7},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "n", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def grammars(smollm2_dir):
    prompter = Prompter.from_dir(smollm2_dir)
    return Grammars(prompter.tokenizer, len(prompter.tokenizer), prompter.eos_ids), prompter


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_masked_random_logits_always_give_valid_json(grammars, seed):
    """Whatever the logits say (random here), the argmax of the masked row keeps to the schema."""
    engine, prompter = grammars
    constraint = engine.constraint(GrammarSpec("json_schema", json.dumps(SCHEMA)))
    rng = np.random.default_rng(seed)
    tokens: list[int] = []
    while not constraint.stopped and len(tokens) < 200:
        logits = rng.standard_normal(len(prompter.tokenizer)).astype(np.float32)
        before = logits.copy()
        token = int(np.argmax(constraint.masked(logits)))
        assert np.array_equal(logits, before)  # the row itself (another request's) is untouched
        constraint.consume(token)
        tokens.append(token)
    # complete: ended by end-of-sequence, or by the last token when nothing can follow it
    assert constraint.stopped
    value = json.loads(prompter.tokenizer.decode([t for t in tokens if t not in prompter.eos_ids]))
    assert not violations(value, SCHEMA), value


def test_the_final_stage_mask_chooses_as_the_coordinator_does(grammars):
    """The bitmask sent to the final stage (``allowed_bits``) allows exactly the tokens the
    coordinator's own mask keeps, so the stage's Top1 is the coordinator's masked argmax."""
    from pipeshard.services.stage.step_engine import allowed_only

    engine, prompter = grammars
    constraint = engine.constraint(GrammarSpec("json_schema", json.dumps(SCHEMA)))
    rng = np.random.default_rng(5)
    steps = 0
    while not constraint.stopped and steps < 60:
        logits = rng.standard_normal(len(prompter.tokenizer)).astype(np.float32)
        here = constraint.masked(logits)
        there = allowed_only(logits[None], constraint.allowed_bits())[0]
        np.testing.assert_array_equal(np.isfinite(here), np.isfinite(there))
        token = int(np.argmax(there))
        assert token == int(np.argmax(here))
        constraint.consume(token)
        steps += 1
    assert constraint.stopped


def test_a_grammar_is_compiled_once_per_text(grammars):
    engine, _ = grammars
    spec = GrammarSpec("regex", "[0-9]{3}")
    assert engine.compile(spec) is engine.compile(GrammarSpec("regex", "[0-9]{3}"))
    assert engine.compile(spec) is not engine.compile(GrammarSpec("regex", "[0-9]{4}"))


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (GrammarSpec("json_schema", '{"type": "frobnicate"}'), "grammar"),
        (GrammarSpec("json_schema", "{not json"), "grammar.json_schema"),
        (GrammarSpec("json_schema", "[1, 2]"), "grammar.json_schema"),
        (GrammarSpec("regex", "(("), "grammar"),
        (GrammarSpec("lark", "start: undefined_rule"), "grammar"),
    ],
)
def test_an_uncompilable_grammar_names_the_parameter(grammars, spec, field):
    engine, _ = grammars
    with pytest.raises(InvalidArgument) as info:
        engine.compile(spec)
    assert info.value.field == field


def test_a_lark_grammar_holds_the_text_to_its_rules(grammars):
    """``guided_grammar``: whatever the logits say, the text is a sentence of the grammar."""
    engine, prompter = grammars
    grammar = 'start: answer ", " colour "."\nanswer: "yes" | "no"\ncolour: /[a-z]{2,6}/'
    constraint = engine.constraint(GrammarSpec("lark", grammar))
    rng = np.random.default_rng(3)
    tokens: list[int] = []
    while not constraint.stopped and len(tokens) < 40:
        token = int(np.argmax(constraint.masked(rng.standard_normal(len(prompter.tokenizer)))))
        constraint.consume(token)
        tokens.append(token)
    text = prompter.tokenizer.decode(tokens, skip_special_tokens=True)
    assert constraint.stopped and re.fullmatch(r"(yes|no), [a-z]{2,6}\.", text), text
