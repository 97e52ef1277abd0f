"""A JSON schema's numbers bounded in their digits before the grammar is compiled.

JSON Schema lets a number run on: ``{"type": "number", "minimum": -180, "maximum": 180}`` admits
``2.35222222...`` to any length, and a small model at a reduced precision does write such runs
until ``max_tokens``. Like llama.cpp's schema converter, the grammar bounds them instead: at most
``INTEGER_DIGITS`` digits before the point and ``FRACTION_DIGITS`` after it (the finest
``multipleOf`` llguidance compiles; it writes a decimal ``multipleOf`` as a digit count). The
rewrite only narrows: every answer it allows validates against the schema as sent, which is what
the answer is checked against.
"""

from __future__ import annotations

from typing import Any

# Digits before the point: |x| <= 10**15 - 1, integers an f64 holds exactly.
INTEGER_DIGITS = 15
# Digits after the point (llguidance refuses a multipleOf finer than 1e-10 as "too many digits").
FRACTION_DIGITS = 10
LARGEST = 10**INTEGER_DIGITS - 1
FINEST = float(f"1e-{FRACTION_DIGITS}")

# Keywords whose value is a schema, a list of schemas, or a map of names to schemas: the walk
# follows only these, so data (enum, const, default, examples) and property names stay as sent.
_SCHEMA = (
    "items",
    "additionalProperties",
    "not",
    "if",
    "then",
    "else",
    "contains",
    "propertyNames",
    "unevaluatedItems",
    "unevaluatedProperties",
    "additionalItems",
)
_SCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems", "items")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def bounded(schema: Any) -> Any:
    """``schema`` with each number and integer bounded in its digits (a copy; the input is kept)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = bounded(out[key])
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [bounded(s) for s in out[key]]
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: bounded(s) for name, s in out[key].items()}
    types = out.get("type")
    kinds = set(types) if isinstance(types, list) else {types}
    if kinds & {"number", "integer"}:
        _bound_range(out)
        if "number" in kinds and "multipleOf" not in out:
            out["multipleOf"] = FINEST  # a multipleOf already set bounds the fraction itself
    return out


def _bound_range(node: dict) -> None:
    """Tighten minimum and maximum to +-LARGEST, unless the schema's own range lies outside it
    (then its bounds are kept as they are: narrowing would leave no value)."""
    low = [node[k] for k in ("minimum", "exclusiveMinimum") if _is_number(node.get(k))]
    high = [node[k] for k in ("maximum", "exclusiveMaximum") if _is_number(node.get(k))]
    if any(v > LARGEST for v in low) or any(v < -LARGEST for v in high):
        return
    node["minimum"] = max(node["minimum"], -LARGEST) if _is_number(node.get("minimum")) else -LARGEST
    node["maximum"] = min(node["maximum"], LARGEST) if _is_number(node.get("maximum")) else LARGEST


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
