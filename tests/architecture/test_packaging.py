"""The installed distribution claims only the `pipeshard` import name (issue #11 item 7)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RENAMED = {"services": "pipeshard.services", "exporter": "pipeshard.exporter", "clients": "pipeshard.clients"}


def _setuptools() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_package_folder_is_listed_under_its_pipeshard_name():
    listed = set(_setuptools()["packages"])
    found = set()
    for init in [
        *REPO.glob("pipeshard/**/__init__.py"),
        *(p for d in RENAMED for p in REPO.glob(f"{d}/**/__init__.py")),
    ]:
        parts = init.parent.relative_to(REPO).parts
        name = ".".join(parts)
        found.add(RENAMED[parts[0]] + name[len(parts[0]) :] if parts[0] in RENAMED else name)
    assert found == listed, (
        f"pyproject [tool.setuptools] packages: missing {found - listed}, stale {listed - found}"
    )
    assert all(name.startswith("pipeshard") for name in listed)


def test_package_dir_maps_the_top_level_folders():
    assert _setuptools()["package-dir"] == {new: old for old, new in RENAMED.items()}


def test_installed_names_import_outside_the_repository(tmp_path):
    """From another directory only the installed (editable) mapping can resolve these names."""
    code = (
        "import importlib.util as u, pipeshard.client as c, pipeshard.services.stage.engine, "
        "pipeshard.exporter.families, pipeshard.clients.cli;"
        "assert c.PipeshardClient and c.AsyncPipeshardClient;"
        "assert all(u.find_spec(n) is None for n in ('services', 'exporter', 'clients'))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
