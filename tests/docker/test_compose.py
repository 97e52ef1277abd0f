"""docker/compose.yaml and its generator stay consistent with the process launcher (fast, no Docker)."""

from __future__ import annotations

import dataclasses
import importlib
import sys
from pathlib import Path

import pytest

from pipeshard.exporter.main import ExporterSettings
from pipeshard.services.coordinator.main import CoordinatorSettings
from pipeshard.services.gateway.main import _refusal
from pipeshard.services.gateway.settings import GatewaySettings
from pipeshard.services.stage.main import StageSettings
from pipeshard.settings import env_name, load_settings
from pipeshard.topology import LANE_SEPARATOR, Topology

DOCKER = Path(__file__).resolve().parents[2] / "docker"
COMPOSE = DOCKER / "compose.yaml"
PATH_VARS = {"PIPESHARD_MODELS_DIR", "PIPESHARD_SHARDS_DIR"}


def load(name: str):
    """A module of docker/ (tooling run on the host, not part of the installed package; its
    modules import each other by plain name, as when run as scripts)."""
    if str(DOCKER) not in sys.path:
        sys.path.append(str(DOCKER))
    return importlib.import_module(name)


def _env(service: dict) -> dict[str, str]:
    return {k: str(v) for k, v in service.get("environment", {}).items()}


def _fleet(stages: int, replicas: int = 1, secure: bool = True) -> dict:
    gen = load("compose_gen")
    return gen.compose(gen.FleetSpec(stages=stages, replicas=replicas, secure=secure))


def test_checked_in_compose_file_is_the_generators_two_stage_secure_fleet():
    gen = load("compose_gen")
    assert COMPOSE.read_text() == gen.render(gen.FleetSpec(stages=2, replicas=1, secure=True))


@pytest.mark.parametrize("stages,replicas", [(2, 1), (3, 1), (3, 2)])
def test_services_use_the_launchers_ports_and_chain_each_lane(stages, replicas):
    services = _fleet(stages, replicas)["services"]
    gen = load("compose_gen")
    names = {gen.stage_service(k, r) for k in range(stages) for r in range(replicas)}
    assert set(services) == {"exporter", "coordinator", "gateway", *names}
    topo = Topology.loopback("shards/x", stages, replicas=replicas)
    for r, lane in enumerate(topo.lanes):
        for k, endpoint in enumerate(lane):
            env = _env(services[gen.stage_service(k, r)])
            assert env["PIPESHARD_STAGE"] == str(k)
            assert int(env["PIPESHARD_PORT"]) == endpoint.port
            assert env["PIPESHARD_EXPORTER"] == f"exporter:{topo.exporter.port}"
            hop = env.get("PIPESHARD_NEXT_HOP")
            assert hop == (f"{gen.stage_service(k + 1, r)}:{lane[k + 1].port}" if k + 1 < stages else None)
    coord = _env(services["coordinator"])
    assert int(coord["PIPESHARD_PORT"]) == topo.coordinator.port
    lanes = coord["PIPESHARD_STAGES"].split(",")
    assert len(lanes) == stages and all(len(s.split(LANE_SEPARATOR)) == replicas for s in lanes)
    assert set(services["coordinator"]["depends_on"]) == names
    assert services["gateway"]["command"][-1] == f"coordinator:{topo.coordinator.port}"


def test_every_variable_is_one_a_setting_reads():
    services = _fleet(3, 2)["services"]
    settings_of = {
        "exporter": ExporterSettings,
        "coordinator": CoordinatorSettings,
        "gateway": GatewaySettings,
    }
    for name, service in services.items():
        settings = settings_of.get(name, StageSettings)
        known = {env_name(f.name) for f in dataclasses.fields(settings)} | PATH_VARS
        unknown = {k for k in _env(service) if k.startswith("PIPESHARD_")} - known
        assert not unknown, f"{name} sets variables no setting reads: {unknown}"


def test_only_the_gateway_is_published_and_only_on_loopback():
    services = _fleet(3, 2)["services"]
    published = {name: s["ports"] for name, s in services.items() if s.get("ports")}
    assert published == {"gateway": ["127.0.0.1:8080:8080"]}


def test_no_shards_volume_is_shared_and_no_container_sees_the_ca_key():
    compose = _fleet(3, 2)
    assert list(compose["volumes"]) == ["exports"]
    for name, service in compose["services"].items():
        mounts = service.get("volumes", [])
        assert ("exports:/app/data" in mounts) == (name == "exporter"), name
        assert not any("ca.key" in m for m in mounts), name
        keys = [m for m in mounts if m.split(":")[0].endswith(".key")]
        assert keys == (
            [] if name == "gateway" else [f"../build/compose-certs/{name}.key:/app/certs/{name}.key:ro"]
        )
        assert all(m.endswith(":ro") for m in mounts if m.startswith("../")), name


def test_secure_services_name_their_own_certificate_and_plaintext_is_asked_for_otherwise():
    for name, service in _fleet(2, 2)["services"].items():
        env = _env(service)
        if name == "gateway":
            # Its HTTP is plain inside the container, asked for by name (published on loopback only),
            # and the gateway's start check accepts the container's environment.
            assert env["PIPESHARD_CA_CERT"] == "/app/certs/ca.pem"
            assert env["PIPESHARD_ALLOW_PLAINTEXT"] == "1"
            settings = load_settings(GatewaySettings, service["command"][1:], env=env)
            assert settings.host == "0.0.0.0" and _refusal(settings) == ""
        else:
            assert env["PIPESHARD_TLS_NAME"] == name and env["PIPESHARD_TLS_DIR"] == "/app/certs"
            assert "PIPESHARD_ALLOW_PLAINTEXT" not in env
    for service in _fleet(2, 1, secure=False)["services"].values():
        assert _env(service)["PIPESHARD_ALLOW_PLAINTEXT"] == "1"
        assert "PIPESHARD_TLS_DIR" not in _env(service)


def test_every_service_runs_unprivileged_with_a_health_check():
    dockerfile = (DOCKER / "Dockerfile").read_text()
    assert dockerfile.count("\nUSER 10001:10001") == 2 and dockerfile.count("\nHEALTHCHECK ") == 2
    assert "--no-index" in dockerfile and "index-url" not in dockerfile
    for name, service in _fleet(2, 1)["services"].items():
        assert service["user"] == "10001:10001", name
        assert service["healthcheck"]["test"] == ["CMD", "python", "/usr/local/bin/pipeshard-healthcheck"]
    assert _env(_fleet(2, 1)["services"]["gateway"])["HEALTHCHECK_URL"].endswith("/health")


def test_bad_counts_are_refused_by_name():
    gen = load("compose_gen")
    with pytest.raises(ValueError, match="stages"):
        gen.FleetSpec(stages=0)
    with pytest.raises(ValueError, match="replicas"):
        gen.FleetSpec(replicas=0)
