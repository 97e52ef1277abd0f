"""Real multi-process fleets on loopback (ephemeral ports), shared per test module."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeshard.services.launcher import Fleet, start_fleet


@pytest.fixture(scope="module")
def fleet_factory(tmp_path_factory):
    """Factory: start a fleet for an export; every fleet started is stopped when the module ends."""
    fleets: list[Fleet] = []

    def start(shards: Path, stages: int, precision: str = "default", **kwargs) -> Fleet:
        run_dir = tmp_path_factory.mktemp(f"fleet-{stages}s")
        fleet = start_fleet(shards, stages, run_dir, precision=precision, **kwargs)
        fleets.append(fleet)
        return fleet

    yield start
    for fleet in fleets:
        fleet.stop()
