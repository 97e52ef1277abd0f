"""What a process on another host reads from its topology and its certificate bundle: its own
host, ports and the exporter's address; the bundle holds only that host's certificates, each
valid for that host alone and naming its role, and the fleet token."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import NameOID

from pipeshard.certs_cli import host_certs
from pipeshard.certs_cli import run as certs_run
from pipeshard.exporter.main import ExporterSettings
from pipeshard.services.coordinator.main import CoordinatorSettings
from pipeshard.services.coordinator.main import resolve as resolve_coordinator
from pipeshard.services.stage.main import StageSettings
from pipeshard.services.stage.main import resolve as resolve_stage
from pipeshard.settings import load_settings
from pipeshard.topology import Endpoint, StageEndpoint, Topology

HOSTS = {"exporter": "10.88.0.2", "s0": "10.88.0.3", "s1": "10.88.0.4", "coordinator": "10.88.0.5"}


@pytest.fixture
def topology(tmp_path) -> Path:
    topo = Topology(
        shards="shards/smollm2-135m-instruct-2s-int4",
        coordinator=Endpoint(HOSTS["coordinator"], 50051, 9151),
        exporter=Endpoint(HOSTS["exporter"], 50071, 9171),
        stages=[
            StageEndpoint(HOSTS["s0"], 50061, 9161, "CPU"),
            StageEndpoint(HOSTS["s1"], 50062, 9162, "GPU"),
        ],
    )
    path = tmp_path / "topology.yaml"
    topo.save(path)
    return path


def test_a_stage_takes_its_host_ports_device_and_exporter_from_the_topology(topology):
    settings = resolve_stage(load_settings(StageSettings, ["--topology", str(topology), "--stage", "1"]))
    assert (settings.host, settings.port, settings.metrics_port) == (HOSTS["s1"], 50062, 9162)
    assert settings.device == "GPU" and settings.next_hop is None
    assert settings.exporter == f"{HOSTS['exporter']}:50071"
    stage0 = resolve_stage(load_settings(StageSettings, ["--topology", str(topology)]))
    assert stage0.next_hop == f"{HOSTS['s1']}:50062"
    given = ["--topology", str(topology), "--host", "0.0.0.0", "--port", "0"]  # flags still win
    flagged = resolve_stage(load_settings(StageSettings, given))
    assert (flagged.host, flagged.port) == ("0.0.0.0", 0)


def test_a_coordinator_takes_its_host_and_the_exporter_from_the_topology(topology):
    settings = resolve_coordinator(load_settings(CoordinatorSettings, ["--topology", str(topology)]))
    assert (settings.host, settings.port, settings.metrics_port) == (HOSTS["coordinator"], 50051, 9151)
    assert settings.exporter == f"{HOSTS['exporter']}:50071"
    assert settings.stages == [f"{HOSTS['s0']}:50061", f"{HOSTS['s1']}:50062"]


def test_fleet_commands_default_to_the_fleet_ports_with_metrics_on():
    stage = resolve_stage(load_settings(StageSettings, ["--shards", "x", "--stage", "2", "--replica", "1"]))
    assert (stage.port, stage.metrics_port) == (50061 + 2 + 20, 9161 + 2 + 20)
    ephemeral = resolve_stage(load_settings(StageSettings, ["--shards", "x", "--port", "0"]))
    assert (ephemeral.port, ephemeral.metrics_port) == (0, 0)  # tests' ephemeral ports: metrics off
    fixed = resolve_stage(load_settings(StageSettings, ["--shards", "x", "--port", "43000"]))
    assert (fixed.port, fixed.metrics_port) == (43000, 0)  # no metrics port derived from a given one
    coordinator = resolve_coordinator(
        load_settings(CoordinatorSettings, ["--stages", "a:1", "--shards", "x"])
    )
    assert (coordinator.port, coordinator.metrics_port) == (50051, 9151)


def test_the_token_is_read_from_the_tls_dir_unless_given(tmp_path):
    (tmp_path / "token").write_text("stored-token\n")
    assert load_settings(ExporterSettings, ["--tls-dir", str(tmp_path)]).token == "stored-token"
    given = ["--tls-dir", str(tmp_path), "--token", "flag-token"]
    assert load_settings(ExporterSettings, given).token == "flag-token"
    assert load_settings(ExporterSettings, []).token is None


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_certs_make_one_bundle_per_host_with_only_its_own_certificates(topology, tmp_path, capsys):
    folder = tmp_path / "certs"
    assert certs_run(_args(folder, topology)) == 0
    bundles = {p.name: sorted(f.name for f in p.iterdir()) for p in (folder / "hosts").iterdir()}
    assert bundles == {
        HOSTS["exporter"]: ["ca.pem", "exporter.key", "exporter.pem", "token"],
        HOSTS["coordinator"]: sorted(
            ["ca.pem", "coordinator.key", "coordinator.pem", "gateway.key", "gateway.pem", "token"]
        ),
        HOSTS["s0"]: ["ca.pem", "stage0.key", "stage0.pem", "token"],
        HOSTS["s1"]: ["ca.pem", "stage1.key", "stage1.pem", "token"],
    }
    token = (folder / "token").read_text()
    for cert in host_certs(Topology.load(topology)):
        bundle = folder / "hosts" / cert.host
        assert (bundle / "token").read_text() == token and (bundle / "token").stat().st_mode & 0o077 == 0
        issued = _cert(bundle / f"{cert.name}.pem")
        sans = issued.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == [cert.host]
        assert sans.get_values_for_type(x509.DNSName) == []  # not even loopback
        role = issued.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
        assert [a.value for a in role] == [cert.role]
        life = issued.not_valid_after_utc - issued.not_valid_before_utc
        assert datetime.timedelta(days=89) < life < datetime.timedelta(days=91)
    assert not list((folder / "hosts").rglob("ca.key"))  # the CA key never goes into a bundle
    assert "copy to 10.88.0.3" in capsys.readouterr().out


def _args(folder: Path, topology: Path):
    import argparse

    return argparse.Namespace(dir=folder, topology=topology, days=None, stages=8, nodes="", hosts="")


class _PeerContext:
    """A servicer context whose caller presented ``pem`` over TLS (what grpc's auth context holds)."""

    def __init__(self, pem: bytes | None):
        self._pem = pem

    def auth_context(self) -> dict[str, list[bytes]]:
        return {"x509_pem_cert": [self._pem]} if self._pem else {}


def test_a_stage_certificate_cannot_act_as_a_coordinator(tmp_path):
    from pipeshard.errors import PermissionDenied
    from pipeshard.services.stage.servicer import COORDINATOR, RING
    from pipeshard.tls import HostCert, make_certs, make_host_bundles, require_role

    certs = [HostCert("stage0", "stage", "10.88.0.3"), HostCert("coordinator", "coordinator", "10.88.0.5")]
    bundles = make_host_bundles(tmp_path / "certs", certs)
    stage = (bundles["10.88.0.3"] / "stage0.pem").read_bytes()
    coordinator = (bundles["10.88.0.5"] / "coordinator.pem").read_bytes()
    with pytest.raises(PermissionDenied, match="is for a coordinator; the caller's certificate is a stage's"):
        require_role(_PeerContext(stage), COORDINATOR, "OpenSession")
    require_role(_PeerContext(stage), RING, "Forward")  # the previous stage sends frames
    require_role(_PeerContext(coordinator), COORDINATOR, "OpenSession")
    make_certs(tmp_path / "loopback", ["stage0"])  # `make up SECURE=1`'s certificates name no role
    require_role(
        _PeerContext((tmp_path / "loopback" / "stage0.pem").read_bytes()), COORDINATOR, "OpenSession"
    )
    require_role(_PeerContext(None), COORDINATOR, "OpenSession")  # plaintext: as before
