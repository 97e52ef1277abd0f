"""A small JSON-schema validator for the tests: the keywords the structured-output schemas use
(type, properties, required, additionalProperties, items, min/maxItems, enum, const, bounds,
min/maxLength, multipleOf, anyOf), strict, so an answer that breaks any of them fails the test."""

from __future__ import annotations

_TYPES = {
    "object": dict,
    "array": list,
    "string": str,
    "boolean": bool,
    "null": type(None),
}


def violations(value, schema: dict, where: str = "$") -> list[str]:
    """What ``value`` breaks of ``schema`` (empty: it validates)."""
    out: list[str] = []
    if "anyOf" in schema:
        if all(violations(value, s, where) for s in schema["anyOf"]):
            out.append(f"{where}: matches no anyOf branch")
        return out
    kind = schema.get("type")
    if kind is not None and not _is(value, kind):
        return [f"{where}: {value!r} is not {kind}"]
    if "enum" in schema and value not in schema["enum"]:
        out.append(f"{where}: {value!r} not in {schema['enum']}")
    if "const" in schema and value != schema["const"]:
        out.append(f"{where}: {value!r} != {schema['const']!r}")
    if isinstance(value, int | float) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            out.append(f"{where}: {value} < {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            out.append(f"{where}: {value} > {schema['maximum']}")
        step = schema.get("multipleOf")
        if step and abs(value / step - round(value / step)) > 1e-6:
            out.append(f"{where}: {value} is not a multiple of {step}")
    if isinstance(value, str) and not schema.get("minLength", 0) <= len(value) <= schema.get(
        "maxLength", len(value)
    ):
        out.append(f"{where}: length {len(value)} out of bounds")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0) or len(value) > schema.get("maxItems", len(value)):
            out.append(f"{where}: {len(value)} items out of bounds")
        for i, item in enumerate(value):
            out += violations(item, schema.get("items", {}), f"{where}[{i}]")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        out += [f"{where}: missing {k}" for k in schema.get("required", []) if k not in value]
        for key, item in value.items():
            if key in props:
                out += violations(item, props[key], f"{where}.{key}")
            elif schema.get("additionalProperties") is False:
                out.append(f"{where}: unexpected {key}")
    return out


def _is(value, kind) -> bool:
    if isinstance(kind, list):
        return any(_is(value, k) for k in kind)
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    return isinstance(value, _TYPES[kind])
