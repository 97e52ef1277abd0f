"""The servicer -> ring call path runs one way: the modules that carry a step to the stages (the
ring, its batching settings and transports) import nothing of the request side (generation, the
engine loop, failover, the servicer), so a step's way down can never call back into a request;
what the engine keeps of a request's place in the batching (its ``StepSlot``) is plain data, no
callbacks."""

from __future__ import annotations

import dataclasses

from pipeshard.services.coordinator.step_batcher import StepSlot
from tests.architecture.test_coordinator_imports import PACKAGE, import_graph

# The way a step goes down: the ring, its batching settings, its transports and what they use.
RING_SIDE = ("ring", "step_batcher", "remote_stages", "in_process", "replicas", "local_stage", "stage_watch")
# The request side: whatever holds or steps a request.
REQUEST_SIDE = ("generation", "engine", "failover", "servicer", "batch_jobs", "main", "local_generate")


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module ``start`` imports, directly or through others."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_the_ring_side_imports_nothing_of_the_request_side():
    graph = import_graph()
    request_side = {f"{PACKAGE}.{name}" for name in REQUEST_SIDE}
    for name in RING_SIDE:
        module = f"{PACKAGE}.{name}"
        assert module in graph, module
        upward = reachable(graph, module) & request_side
        assert not upward, f"{module} reaches the request side: {sorted(upward)}"


def test_the_check_sees_a_way_back():
    graph = {"ring": {"batcher"}, "batcher": {"generation"}, "generation": {"ring"}}
    assert reachable(graph, "ring") == {"batcher", "generation", "ring"}


def test_a_requests_place_in_the_batcher_holds_no_callbacks():
    slot = StepSlot()
    values = [getattr(slot, f.name) for f in dataclasses.fields(StepSlot)]
    assert values and not any(callable(v) for v in values)
    assert all("Callable" not in str(f.type) for f in dataclasses.fields(StepSlot))
