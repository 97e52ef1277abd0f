"""The docs users read match the code: SERVICES.md's flag tables are the services' parsers,
ARCHITECTURE.md has one row per layer (the layers test_import_layers.py enforces) and per folder
and names every module, and nothing in the project points to a file outside it."""

from __future__ import annotations

import argparse
import re
import subprocess
from pathlib import Path

import pytest

from pipeshard.settings import ServerSettings, _fields, flag_name
from tests.architecture.test_import_layers import LAYERS

REPO = Path(__file__).resolve().parents[2]
SERVICES = REPO / "docs" / "SERVICES.md"
ARCHITECTURE = REPO / "docs" / "ARCHITECTURE.md"


def table_after(text: str, heading: str) -> list[list[str]]:
    """The cells of the first table after ``heading`` (header and separator rows left out)."""
    start = text.index(heading)
    rows = []
    for line in text[start:].splitlines():
        if line.startswith("|"):
            rows.append([c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]])
        elif rows:
            break
    return rows[2:]


def shown(value: object) -> str:
    """A default as the tables write it."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return ", ".join(map(str, value)) or "empty"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value) if value != "" else "empty"


def settings_classes():
    from pipeshard.exporter.main import ExporterSettings
    from pipeshard.services.coordinator.main import CoordinatorSettings
    from pipeshard.services.gateway.settings import GatewaySettings
    from pipeshard.services.stage.main import StageSettings

    server = {f.name for f in _fields(ServerSettings)}
    return {
        "### Flags: every server": (ServerSettings, set()),
        "### Flags: `pipeshard stage`": (StageSettings, server),
        "### Flags: `pipeshard coordinator`": (CoordinatorSettings, server),
        "### Flags: `pipeshard exporter-service`": (ExporterSettings, server),
        "### Flags: `pipeshard serve-openai`": (GatewaySettings, set()),
    }


@pytest.mark.parametrize("heading", list(settings_classes()))
def test_flag_table_equals_the_parser(heading):
    cls, inherited = settings_classes()[heading]
    want = {flag_name(f.name): shown(f.default) for f in _fields(cls) if f.name not in inherited}
    rows = table_after(SERVICES.read_text(), heading)
    got = {flag.strip("`"): default.strip("`") for flag, default, _ in rows}
    assert len(got) == len(rows), f"{heading}: a flag is listed twice"
    assert got == want, f"{heading} in docs/SERVICES.md differs from {cls.__name__}"


def cli_parsers() -> dict[str, argparse.ArgumentParser]:
    """The argparse subcommands SERVICES.md tabulates (plain argparse, not settings classes)."""
    from pipeshard.services import fleet_cli
    from pipeshard.services.wan import cli as wan_cli

    root = argparse.ArgumentParser()
    sub = root.add_subparsers()
    fleet_cli.register(sub)
    wan_cli.register(sub)
    wan = next(a for a in sub.choices["wan"]._actions if isinstance(a, argparse._SubParsersAction))
    return {
        "### Flags: `pipeshard up`": sub.choices["up"],
        "### Flags: `pipeshard wan up`": wan.choices["up"],
    }


@pytest.mark.parametrize("heading", ["### Flags: `pipeshard up`", "### Flags: `pipeshard wan up`"])
def test_flag_table_equals_the_cli_parser(heading, monkeypatch):
    monkeypatch.delenv("PIPESHARD_DEVICE", raising=False)  # `pipeshard up --device` defaults to it
    parser = cli_parsers()[heading]
    flags = [a for a in parser._actions if a.option_strings[-1] != "--help"]
    want = {a.option_strings[-1]: shown(a.default) for a in flags}
    rows = table_after(SERVICES.read_text(), heading)
    got = {flag.strip("`"): default.strip("`") for flag, default, _ in rows}
    assert len(got) == len(rows), f"{heading}: a flag is listed twice"
    assert got == want, f"{heading} in docs/SERVICES.md differs from its parser"


def test_every_flag_table_is_checked():
    headings = re.findall(r"^### Flags: .*$", SERVICES.read_text(), re.M)
    known = (*settings_classes(), "### Flags: `pipeshard up`", "### Flags: `pipeshard wan up`")
    assert [h for h in headings if not h.startswith(known)] == []
    assert len(headings) == len(known)


def test_map_has_one_row_per_layer_in_the_enforced_order():
    rows = table_after(ARCHITECTURE.read_text(), "| layer | modules | may import | owns |")
    assert [r[0] for r in rows] == list(LAYERS)
    for layer, (prefixes, allowed) in LAYERS.items():
        row = next(r for r in rows if r[0] == layer)
        names = set(re.findall(r"`([\w.]+)`", row[1]))
        for prefix in prefixes:
            if prefix != "pipeshard":
                assert prefix in names or prefix.rpartition(".")[2] in names, f"{layer}: {prefix} unnamed"
        documented = {a.strip() for a in row[2].split(",")}
        if row[2] not in ("nothing", "every layer but transport"):
            assert documented == set(allowed), f"{layer} may import {sorted(allowed)}, the map says {row[2]}"


def test_folders_have_one_row_each_naming_every_module():
    rows = table_after(ARCHITECTURE.read_text(), "| folder | owns |")
    folders = [re.findall(r"`([^`]+)`", r[0]) for r in rows]
    flat = [f for fs in folders for f in fs]
    assert len(flat) == len(set(flat)), "a folder has two rows"
    tracked = subprocess.run(
        ["git", "ls-files", "pipeshard", "services", "exporter", "clients"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    missing = []
    for path in tracked:
        if not path.endswith(".py") or path.endswith("__init__.py") or path.startswith("pipeshard/v1/"):
            continue
        best, row = "", ""
        for names, cells in zip(folders, rows, strict=True):
            for name in names:
                if (path == name or (name.endswith("/") and path.startswith(name))) and len(name) > len(best):
                    best, row = name, cells[1] if name.endswith("/") else cells[0] + cells[1]
        stem = Path(path).stem
        if not best or not (f"{stem}.py" in row or f"`{stem}`" in row):
            missing.append(path)
    assert not missing, f"modules docs/ARCHITECTURE.md's folder table does not name: {missing}"


def test_nothing_refers_to_notes_outside_the_repository():
    notes = ("DESIGN" + ".md", "FACTS" + ".md")  # spelt in parts, so this file does not match itself
    found = subprocess.run(
        ["git", "grep", "-n", "-i", "-e", notes[0], "-e", notes[1]],
        cwd=REPO,
        capture_output=True,
        text=True,
    ).stdout
    assert found == "", f"files that point to notes outside the repository:\n{found}"
