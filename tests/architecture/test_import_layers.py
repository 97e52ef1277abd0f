"""Imports flow one way (docs/ARCHITECTURE.md, "Layers"): every import of every module, lazy ones
included, is checked against the layer table below, which is the one the document shows."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# folder -> installed package name (pyproject package-dir)
ROOTS = {
    "pipeshard": "pipeshard",
    "services": "pipeshard.services",
    "exporter": "pipeshard.exporter",
    "clients": "pipeshard.clients",
}

# layer: (module prefixes, layers it may import besides itself). Most specific prefix wins.
LAYERS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "contract": (("pipeshard.v1",), ()),
    "core": (
        (
            "pipeshard.errors",
            "pipeshard.settings",
            "pipeshard.logs",
            "pipeshard.metrics",
            "pipeshard.paths",
            "pipeshard.offline",
            "pipeshard.tensor_codec",
            "pipeshard.interceptors",
            "pipeshard.grpc_server",
            "pipeshard.model",
            "pipeshard",
        ),
        ("contract",),
    ),
    "format": (("pipeshard.shard", "pipeshard.topology"), ("contract", "core")),
    # the planner proper is plain domain code; measuring this machine and the CLI sit above it
    "planning": (("pipeshard.planning",), ("core",)),
    "exporter": (("pipeshard.exporter",), ("contract", "core", "format", "planning")),
    "transport": (("pipeshard.services.transport",), ("contract", "core")),
    "stage": (("pipeshard.services.stage",), ("contract", "core", "format", "transport")),
    "coordinator": (
        ("pipeshard.services.coordinator",),
        ("contract", "core", "format", "transport", "stage"),
    ),
    "clients": (("pipeshard.clients", "pipeshard.client"), ("contract",)),
    # what `pipeshard top` and the gateway's page show: a topology's fleet read through public RPCs
    "status": (("pipeshard.services.fleet_status",), ("contract", "core", "format")),
    # the OpenAI gateway is a client of the coordinator that serves HTTP
    "gateway": (("pipeshard.services.gateway",), ("contract", "core", "clients", "format", "status")),
    "fleet": (
        (
            "pipeshard.services.launcher",
            "pipeshard.services.draft_training",  # a fleet start trains its missing draft
            "pipeshard.services.memcap",
            "pipeshard.services.fleet_cli",
            "pipeshard.certs_cli",  # a topology's hosts get their certificates
            "pipeshard.services.wan",
            "pipeshard.services.top",
        ),
        ("contract", "core", "format", "transport", "status", "gateway"),
    ),
    "profiling": (
        ("pipeshard.planning.profile", "pipeshard.planning.cli"),
        ("contract", "core", "format", "exporter", "planning"),
    ),
    # a fleet on a Ray cluster: the planner over its members, one actor per service process
    "ray": (
        ("pipeshard.services.raycluster",),
        ("contract", "core", "format", "transport", "gateway", "exporter", "planning", "profiling", "fleet"),
    ),
    "cli": (
        ("pipeshard.cli",),
        (
            "contract",
            "core",
            "format",
            "exporter",
            "stage",
            "coordinator",
            "fleet",
            "ray",
            "clients",
            "gateway",
            "planning",
            "profiling",
            "status",
        ),
    ),
}


def layer_of(module: str) -> str | None:
    best, best_len = None, -1
    for layer, (prefixes, _) in LAYERS.items():
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = layer, len(prefix)
    return best


def modules() -> dict[str, Path]:
    found = {}
    for folder, package in ROOTS.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = path.relative_to(REPO / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([package, *parts])
            if not name.startswith("pipeshard.v1"):
                found[name] = path
    return found


def imports_of(path: Path, module: str) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                name = ".".join([*base, *([node.module] if node.module else [])])
            else:
                name = node.module or ""
            out.append((node.lineno, name))
            out += [(node.lineno, f"{name}.{alias.name}") for alias in node.names]
    return out


def violations() -> list[str]:
    internal = modules()
    bad = []
    for module, path in internal.items():
        source = layer_of(module)
        assert source is not None, f"{module} is in no layer: add it to LAYERS and to ARCHITECTURE.md"
        allowed = {source, *LAYERS[source][1]}
        for line, name in imports_of(path, module):
            top = name.split(".")[0]
            where = f"{path.relative_to(REPO)}:{line}"
            if top in ("services", "exporter", "clients"):
                bad.append(f"{where} imports {name}: use the installed name pipeshard.{name}")
                continue
            if name == "pipeshard.v1" or name.startswith("pipeshard.v1."):
                target = "contract"  # generated stubs (not on disk before `make proto`)
            elif top != "pipeshard" or (name not in internal and name.rpartition(".")[0] not in internal):
                continue  # third-party, or `from x import Name` (its module is checked)
            else:
                target = layer_of(name if name in internal else name.rpartition(".")[0])
            if target not in allowed:
                bad.append(f"{where}: {module} ({source}) imports {name} ({target})")
    return bad


def test_imports_follow_the_layer_order():
    bad = violations()
    assert not bad, "imports against the layer order (docs/ARCHITECTURE.md):\n" + "\n".join(bad)


def test_the_check_sees_a_violation(monkeypatch, tmp_path):
    """The walker must catch a lazy upward import (the shape of the old coupling)."""
    fake = tmp_path / "sources.py"
    fake.write_text("def f():\n    from pipeshard.exporter.draft import ensure_draft_export\n")
    names = [name for _, name in imports_of(fake, "pipeshard.services.coordinator.speculation.sources")]
    assert "pipeshard.exporter.draft" in names
    assert layer_of("pipeshard.exporter.draft") not in LAYERS["coordinator"][1]
    assert layer_of("pipeshard.services.stage.rawtcp") == "stage"
    assert layer_of("pipeshard") == "core" and layer_of("pipeshard.v1.stage_pb2") == "contract"


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_architecture_md_names_every_layer(layer):
    assert f"| {layer} |" in (REPO / "docs" / "ARCHITECTURE.md").read_text()
