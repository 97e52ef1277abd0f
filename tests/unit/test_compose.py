"""docker/compose.yaml stays consistent with the process launcher (images cannot be built here)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from pipeshard.exporter.main import ExporterSettings
from pipeshard.services.coordinator.main import CoordinatorSettings
from pipeshard.services.stage.main import StageSettings
from pipeshard.settings import env_name
from pipeshard.topology import Topology

COMPOSE = Path(__file__).resolve().parents[2] / "docker" / "compose.yaml"
PATH_VARS = {"PIPESHARD_MODELS_DIR", "PIPESHARD_SHARDS_DIR"}


def _env(service: dict) -> dict[str, str]:
    return {k: str(v) for k, v in service.get("environment", {}).items()}


def test_compose_names_the_launchers_services_ports_and_variables():
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    assert set(services) == {"exporter", "stage0", "stage1", "coordinator"}
    topo = Topology.loopback("shards/x", 2)
    for k, endpoint in enumerate(topo.stages):
        env = _env(services[f"stage{k}"])
        assert env["PIPESHARD_STAGE"] == str(k)
        assert int(env["PIPESHARD_PORT"]) == endpoint.port
        assert int(env["PIPESHARD_METRICS_PORT"]) == endpoint.metrics_port
        assert services[f"stage{k}"]["command"] == ["stage"]
    assert _env(services["stage0"])["PIPESHARD_NEXT_HOP"] == f"stage1:{topo.stages[1].port}"
    exporter = _env(services["exporter"])
    assert services["exporter"]["command"] == ["exporter-service"]
    assert int(exporter["PIPESHARD_PORT"]) == topo.exporter.port
    assert all(
        _env(services[f"stage{k}"])["PIPESHARD_EXPORTER"] == f"exporter:{topo.exporter.port}" for k in (0, 1)
    )
    coord = _env(services["coordinator"])
    assert int(coord["PIPESHARD_PORT"]) == topo.coordinator.port
    assert coord["PIPESHARD_STAGES"] == ",".join(f"stage{k}:{e.port}" for k, e in enumerate(topo.stages))
    settings_of = {
        "stage0": StageSettings,
        "stage1": StageSettings,
        "coordinator": CoordinatorSettings,
        "exporter": ExporterSettings,
    }
    for name, settings in settings_of.items():
        known = {env_name(f.name) for f in dataclasses.fields(settings)} | PATH_VARS
        unknown = {k for k in _env(services[name]) if k.startswith("PIPESHARD_")} - known
        assert not unknown, f"{name} sets variables no setting reads: {unknown}"
