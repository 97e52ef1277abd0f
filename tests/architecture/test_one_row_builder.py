"""A row's options are decided in one place and written to the wire by one translation: only
services/stage/wire.py writes frames and only services/stage/rows.py writes plan rows, and the
coordinator builds no ``StepRow`` of its own (its rows come from ``wire.token_row``), so adding a
row option never means retyping it in a second frame builder."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.architecture.test_import_layers import modules

# Protobuf messages -> the one module that may construct them.
WRITERS = {
    "ActivationFrame": "pipeshard.services.stage.wire",
    "PlanFrame": "pipeshard.services.stage.wire",
    "PlanRow": "pipeshard.services.stage.rows",
}
COORDINATOR = "pipeshard.services.coordinator"


def constructions(path: Path) -> list[tuple[int, str]]:
    """Every call of a name or attribute spelled like a message or ``StepRow`` in ``path``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in WRITERS or name == "StepRow":
                out.append((node.lineno, name))
    return out


def violations(found: dict[str, Path]) -> list[str]:
    bad = []
    for module, path in found.items():
        for line, name in constructions(path):
            if name in WRITERS and WRITERS[name] != module:
                bad.append(f"{module}:{line} builds {name} (only {WRITERS[name]} does)")
            if name == "StepRow" and module.startswith(COORDINATOR):
                bad.append(f"{module}:{line} builds a StepRow (the coordinator's come from wire.token_row)")
    return bad


def test_frames_and_rows_are_written_in_one_place():
    found = modules()
    assert "pipeshard.services.stage.wire" in found and f"{COORDINATOR}.generation" in found
    assert violations(found) == []


def test_the_check_sees_a_second_builder(tmp_path):
    second = tmp_path / "generation.py"
    second.write_text(
        "from pipeshard.v1 import activation_pb2\n"
        "from pipeshard.services.stage.domain import StepRow\n"
        "def frame(row):\n"
        "    return activation_pb2.ActivationFrame(plan=activation_pb2.PlanFrame(rows=[]))\n"
        "def row():\n"
        "    return StepRow()\n"
    )
    bad = violations({f"{COORDINATOR}.generation": second})
    assert len(bad) == 3
    assert any("builds ActivationFrame" in b for b in bad) and any("StepRow" in b for b in bad)
