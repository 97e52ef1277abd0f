"""Every benchmark module imports: a moved name fails here, not at the start of a long benchmark run."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.parametrize("name", sorted(p.stem for p in BENCH.glob("*.py") if p.stem != "__init__"))
def test_bench_module_imports(name: str) -> None:
    importlib.import_module(f"bench.{name}")
