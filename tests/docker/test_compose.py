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


def test_compose_publishes_only_the_coordinator_and_metrics_and_only_on_loopback():
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    published = {name: service.get("ports", []) for name, service in services.items()}
    assert all(port.startswith("127.0.0.1:") for ports in published.values() for port in ports), published
    grpc_ports = {
        name for name, ports in published.items() for p in ports if p.split(":")[1].startswith("50")
    }
    assert grpc_ports == {"coordinator"}


def test_every_service_runs_unprivileged_with_a_grpc_health_check():
    compose = yaml.safe_load(COMPOSE.read_text())
    dockerfile = (COMPOSE.parent / "Dockerfile").read_text()
    assert "--index-url https://download.pytorch.org/whl/cpu" in dockerfile
    assert "\nUSER 10001" in dockerfile and "\nHEALTHCHECK " in dockerfile
    probe = ["CMD", "python", "/usr/local/bin/pipeshard-healthcheck"]
    for name, service in compose["services"].items():
        assert service["user"] == "10001:10001", name
        assert service["healthcheck"]["test"] == probe, name
    assert compose["services"]["coordinator"]["depends_on"] == {
        "stage0": {"condition": "service_healthy"},
        "stage1": {"condition": "service_healthy"},
    }
