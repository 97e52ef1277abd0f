"""A schema's numbers bounded in their digits: the compiled grammar stops a number after 15 digits
before the point and 10 after it, keeps the schema's own bounds, and leaves data and property
names as they were sent."""

from __future__ import annotations

import json

import llguidance
import pytest

from pipeshard.services.coordinator.grammar import GrammarSpec
from pipeshard.services.coordinator.number_bounds import FINEST, LARGEST, bounded

BYTES = llguidance.LLTokenizer("byte")


def _accepts(spec: GrammarSpec, text: str) -> bool:
    matcher = llguidance.LLMatcher(BYTES, spec.source(), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return matcher.consume_tokens(BYTES.tokenize_bytes(text.encode())) and matcher.is_accepting()


def _schema(schema: dict) -> GrammarSpec:
    return GrammarSpec("json_schema", json.dumps(schema))


LON = {"type": "number", "minimum": -180, "maximum": 180}


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ("2.3522222222", True),  # ten digits after the point
        ("2.35222222222", False),  # eleven: the run the grammar now stops
        ("-180", True),
        ("180.0000000001", False),  # the schema's own bound is kept
        ("1e2", False),
    ],
)
def test_a_bounded_number_stops_after_ten_fraction_digits(text, ok):
    assert _accepts(_schema(LON), text) is ok


@pytest.mark.parametrize(
    ("schema", "text", "ok"),
    [
        ({"type": "integer"}, "999999999999999", True),
        ({"type": "integer"}, "1000000000000000", False),
        ({"type": "integer"}, "-999999999999999", True),
        ({"type": "number"}, "-1000000000000000", False),
        ({"type": "integer", "maximum": 9}, "-12", True),  # the open side is bounded, not the other
        ({"type": "number", "multipleOf": 0.01}, "3.14", True),  # a multipleOf set is kept
        ({"type": "number", "multipleOf": 0.01}, "3.141", False),
        ({"type": ["number", "string"]}, '"free text"', True),
        ({"type": ["number", "null"]}, "0.12345678901", False),
    ],
)
def test_integers_and_numbers_without_bounds_get_them(schema, text, ok):
    assert _accepts(_schema(schema), text) is ok


def test_numbers_are_bounded_wherever_the_schema_nests_them():
    schema = {
        "type": "object",
        "properties": {
            "points": {"type": "array", "items": {"$ref": "#/$defs/point"}, "maxItems": 1},
            "extra": {"anyOf": [{"type": "null"}, {"type": "number"}]},
        },
        "required": ["points", "extra"],
        "additionalProperties": False,
        "$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}},
    }
    spec = _schema(schema)
    assert _accepts(spec, '{"points": [{"x": 0.5}], "extra": 1.25}')
    assert not _accepts(spec, '{"points": [{"x": 0.12345678901}], "extra": null}')
    assert not _accepts(spec, '{"points": [], "extra": 0.12345678901}')


def test_data_and_property_names_are_left_as_sent():
    schema = {
        "type": "object",
        "properties": {"enum": {"type": "number"}, "const": {"enum": [{"type": "number"}, 1.123456789012]}},
        "default": {"type": "number"},
    }
    out = bounded(schema)
    assert out["properties"]["enum"] == {
        "type": "number",
        "minimum": -LARGEST,
        "maximum": LARGEST,
        "multipleOf": FINEST,
    }
    assert out["properties"]["const"] == schema["properties"]["const"]
    assert out["default"] == {"type": "number"}
    assert schema["properties"]["enum"] == {"type": "number"}  # the input is not changed


def test_a_range_outside_the_bound_is_kept_as_it_is():
    schema = {"type": "integer", "minimum": 10**16}
    assert bounded(schema) == schema
    assert _accepts(_schema(schema), str(10**16 + 3))


def test_json_object_numbers_are_bounded_too():
    spec = GrammarSpec("json_object")
    assert _accepts(spec, '{"a": 1.5, "b": [1, {"c": null}], "d": "x", "e": true}')
    assert not _accepts(spec, '{"a": [0.12345678901]}')
    assert not _accepts(spec, "[1]")
