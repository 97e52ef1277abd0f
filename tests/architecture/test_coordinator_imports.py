"""No import circle among the coordinator's modules (lazy and type-checking imports included): a
circle means two modules know each other's insides, and neither can change alone."""

from __future__ import annotations

from tests.architecture.test_import_layers import imports_of, modules

PACKAGE = "pipeshard.services.coordinator"


def import_graph(prefix: str = PACKAGE) -> dict[str, set[str]]:
    """Module -> the modules under ``prefix`` it imports (``from m import Name`` counts as m)."""
    internal = {name: path for name, path in modules().items() if name.startswith(prefix)}
    graph: dict[str, set[str]] = {}
    for module, path in internal.items():
        targets = set()
        for _, name in imports_of(path, module):
            target = name if name in internal else name.rpartition(".")[0]
            if target in internal and target != module:
                targets.add(target)
        graph[module] = targets
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_circle_among_coordinator_modules():
    graph = import_graph()
    assert f"{PACKAGE}.generation" in graph and f"{PACKAGE}.failover" in graph
    found = circles(graph)
    assert not found, "import circles among the coordinator's modules:\n" + "\n".join(
        " <-> ".join(group) for group in found
    )


def test_the_check_sees_a_circle(tmp_path):
    """A type-checking import back is a circle too (the shape generation <-> failover had)."""
    fake = tmp_path / "failover.py"
    fake.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from pipeshard.services.coordinator.generation import _Request\n"
    )
    names = {name for _, name in imports_of(fake, f"{PACKAGE}.failover")}
    assert f"{PACKAGE}.generation" in names
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []
