"""Node descriptions: the fleet the planner places layers on, loaded from YAML.

nodes.yaml is a list in pipeline order (the planner never reorders it)::

    - name: laptop
      address: 10.0.0.2:50061
      per_layer_ms: 0.9            # decode, per layer; or {1: 0.9, 4: 1.3} by rows per step
      memory_bytes: 8000000000
      link_to_next: {mbit: 100, rtt_ms: 20}
    - name: desktop
      profile: desktop.yaml        # a `pipeshard profile` output; fields given here win
      link_to_next: {mbit: 1000, rtt_ms: 1}

Optional per node: ``overhead_ms`` (fixed cost of one step), ``embed_ms`` (extra on the first
stage), ``head_ms`` (final norm + LM head on the last stage), ``reserve_bytes`` (memory kept
free). A profile file is itself a valid entry (its ``measured`` detail is ignored). A missing
``link_to_next`` is an ideal link (loopback). Each node's link carries what it sends: to the next
stage it uses, or from the last stage back to the coordinator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from pipeshard.errors import InvalidArgument
from pipeshard.planning.cost import Curve, Link

_FIELDS = {
    "name",
    "address",
    "profile",
    "per_layer_ms",
    "overhead_ms",
    "embed_ms",
    "head_ms",
    "memory_bytes",
    "reserve_bytes",
    "link_to_next",
    "device",
    "measured",  # a profile's measurement detail: kept for people, ignored by the planner
}
# What a profile file contributes; everything else in it (measurement detail) is ignored.
_FROM_PROFILE = (
    "name",
    "address",
    "device",
    "per_layer_ms",
    "overhead_ms",
    "embed_ms",
    "head_ms",
    "memory_bytes",
)


IDEAL_LINK = Link()
NO_TIME = Curve.constant(0.0)


@dataclass(frozen=True)
class Node:
    name: str
    address: str
    per_layer_ms: Curve
    memory_bytes: int
    link_to_next: Link = IDEAL_LINK
    overhead_ms: Curve = NO_TIME
    embed_ms: Curve = NO_TIME
    head_ms: Curve = NO_TIME
    reserve_bytes: int = 0
    device: str = "CPU"  # the OpenVINO device it was profiled on and its stage compiles for

    @property
    def usable_bytes(self) -> int:
        return self.memory_bytes - self.reserve_bytes


def _number(raw: dict, key: str, where: str, *, integer: bool = False, positive: bool = False) -> Any:
    value = raw[key]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgument(f"{where}.{key}", f"must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise InvalidArgument(f"{where}.{key}", f"must be {'> 0' if positive else '>= 0'}, got {value!r}")
    return int(value) if integer else float(value)


def _link(value: Any, where: str) -> Link:
    if value is None:
        return Link()
    if not isinstance(value, dict):
        raise InvalidArgument(where, f"must be a mapping {{mbit, rtt_ms}}, got {value!r}")
    unknown = set(value) - {"mbit", "rtt_ms"}
    if unknown:
        raise InvalidArgument(where, f"has unknown keys {sorted(unknown)} (known: mbit, rtt_ms)")
    mbit = _number(value, "mbit", where, positive=True) if "mbit" in value else math.inf
    rtt = _number(value, "rtt_ms", where) if "rtt_ms" in value else 0.0
    return Link(mbit=mbit, rtt_ms=rtt)


def _read_yaml(path: Path, field: str) -> Any:
    if not path.is_file():
        raise InvalidArgument(field, f"no such file: {path}")
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise InvalidArgument(field, f"{path} is not valid YAML ({exc})") from None


def parse_node(raw: Any, where: str, base: Path | None = None) -> Node:
    """One node entry; ``where`` (e.g. ``nodes[2]``) prefixes every error's field name."""
    if not isinstance(raw, dict):
        raise InvalidArgument(where, f"must be a mapping, got {raw!r}")
    unknown = set(raw) - _FIELDS
    if unknown:
        known = ", ".join(sorted(_FIELDS))
        raise InvalidArgument(where, f"has unknown keys {sorted(unknown)} (known: {known})")
    if "profile" in raw:
        path = Path(raw["profile"])
        path = path if path.is_absolute() or base is None else base / path
        prof = _read_yaml(path, f"{where}.profile")
        if not isinstance(prof, dict):
            raise InvalidArgument(f"{where}.profile", f"{path} must hold a mapping")
        raw = {**{k: prof[k] for k in _FROM_PROFILE if k in prof}, **raw}
    for key in ("name", "per_layer_ms", "memory_bytes"):
        if key not in raw:
            raise InvalidArgument(f"{where}.{key}", "is required (or give a `profile` that has it)")
    name = raw["name"]
    if not isinstance(name, str) or not name:
        raise InvalidArgument(f"{where}.name", f"must be a non-empty string, got {name!r}")
    address = raw.get("address", "")
    if not isinstance(address, str):
        raise InvalidArgument(f"{where}.address", f"must be a HOST:PORT string, got {address!r}")
    device = raw.get("device", "CPU")
    if not isinstance(device, str) or not device:
        raise InvalidArgument(
            f"{where}.device", f"must be an OpenVINO device such as CPU or GPU.1, got {device!r}"
        )
    curves = {
        key: Curve.parse(raw[key], f"{where}.{key}")
        for key in ("per_layer_ms", "overhead_ms", "embed_ms", "head_ms")
        if key in raw
    }
    node = Node(
        name=name,
        address=address,
        memory_bytes=_number(raw, "memory_bytes", where, integer=True, positive=True),
        link_to_next=_link(raw.get("link_to_next"), f"{where}.link_to_next"),
        reserve_bytes=_number(raw, "reserve_bytes", where, integer=True) if "reserve_bytes" in raw else 0,
        device=device,
        **curves,
    )
    if node.usable_bytes <= 0:
        raise InvalidArgument(f"{where}.reserve_bytes", f"leaves no memory of {node.memory_bytes} bytes")
    return node


def parse_nodes(raw: Any, base: Path | None = None) -> list[Node]:
    if raw is None or (isinstance(raw, list) and not raw):
        raise InvalidArgument("nodes", "is empty: list at least one node, in pipeline order")
    if not isinstance(raw, list):
        raise InvalidArgument("nodes", f"must be a list of nodes in pipeline order, got {type(raw).__name__}")
    nodes = [parse_node(entry, f"nodes[{i}]", base) for i, entry in enumerate(raw)]
    seen: set[str] = set()
    for i, node in enumerate(nodes):
        if node.name in seen:
            raise InvalidArgument(f"nodes[{i}].name", f"{node.name!r} is used by an earlier node")
        seen.add(node.name)
    return nodes


def load_nodes(path: Path | str) -> list[Node]:
    """nodes.yaml -> nodes; profile paths are relative to the file's folder."""
    path = Path(path)
    return parse_nodes(_read_yaml(path, "nodes"), base=path.parent)
