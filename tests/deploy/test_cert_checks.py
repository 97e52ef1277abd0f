"""Fleet certificates checked per host and against the revocation list: a role-bearing
certificate used from another host is refused; `pipeshard certs revoke NAME` lists its serials
beside the certificates and in every host bundle, removes it so a new one can be issued, and a
service's denylist refuses it once the file changes."""

from __future__ import annotations

import argparse
import datetime

import pytest
from cryptography import x509

from pipeshard.certs_cli import run, run_revoke
from pipeshard.errors import PermissionDenied
from pipeshard.revocation import REVOKED_FILE, Denylist, certificate_serial, read_serials
from pipeshard.services.stage.servicer import COORDINATOR, RING
from pipeshard.tls import HostCert, make_certs, make_host_bundles, require_role
from pipeshard.topology import Topology


class PeerContext:
    """A servicer context whose caller presented ``pem`` from ``peer`` (grpc's form)."""

    def __init__(self, pem: bytes | None, peer: str = "ipv4:10.88.0.5:40000"):
        self._pem, self._peer = pem, peer

    def auth_context(self) -> dict[str, list[bytes]]:
        return {"x509_pem_cert": [self._pem]} if self._pem else {}

    def peer(self) -> str:
        return self._peer


@pytest.fixture
def bundles(tmp_path):
    certs = [
        HostCert("coordinator", "coordinator", "10.88.0.5"),
        HostCert("stage0", "stage", "10.88.0.3"),
        HostCert("stage0", "stage", "10.88.0.4"),  # a replica on another host
    ]
    return tmp_path / "certs", make_host_bundles(tmp_path / "certs", certs)


def test_a_certificate_is_refused_from_a_host_it_was_not_issued_for(bundles, tmp_path):
    _, hosts = bundles
    coordinator = (hosts["10.88.0.5"] / "coordinator.pem").read_bytes()
    stage = (hosts["10.88.0.3"] / "stage0.pem").read_bytes()
    require_role(PeerContext(coordinator, "ipv4:10.88.0.5:5000"), COORDINATOR, "OpenSession")
    require_role(PeerContext(stage, "ipv4:10.88.0.3:5000"), RING, "Forward")
    with pytest.raises(PermissionDenied, match=r"certificate is for 10.88.0.5, not 10.88.0.9"):
        require_role(PeerContext(coordinator, "ipv4:10.88.0.9:5000"), COORDINATOR, "OpenSession")
    with pytest.raises(PermissionDenied, match=r"stage certificate is for 10.88.0.3, not 10.88.0.4"):
        require_role(PeerContext(stage, "ipv4:10.88.0.4:5000"), RING, "Forward")
    make_certs(tmp_path / "loopback", ["coordinator"])  # no role (`make up SECURE=1`): any host
    plain = (tmp_path / "loopback" / "coordinator.pem").read_bytes()
    require_role(PeerContext(plain, "ipv4:10.88.0.9:5000"), COORDINATOR, "OpenSession")


def test_revoke_lists_every_copy_of_a_name_and_a_denylist_refuses_it(bundles, capsys):
    folder, hosts = bundles
    serials = {certificate_serial((hosts[h] / "stage0.pem").read_bytes()) for h in ("10.88.0.3", "10.88.0.4")}
    stage = (hosts["10.88.0.3"] / "stage0.pem").read_bytes()
    coordinator = (hosts["10.88.0.5"] / "coordinator.pem").read_bytes()
    denylist = Denylist(hosts["10.88.0.3"] / REVOKED_FILE, recheck_s=0)
    denylist.check(stage, "stage0")  # nothing revoked yet

    assert run_revoke(argparse.Namespace(name="stage0", dir=folder)) == 0
    assert "revoked" in capsys.readouterr().out
    for place in (folder, *hosts.values()):
        assert read_serials(place / REVOKED_FILE) == serials
    assert not (hosts["10.88.0.3"] / "stage0.pem").exists()
    assert not (hosts["10.88.0.3"] / "stage0.key").exists()
    with pytest.raises(PermissionDenied, match="stage0's certificate is revoked"):
        denylist.check(stage, "stage0")
    denylist.check(coordinator, "coordinator")  # others are not
    assert run_revoke(argparse.Namespace(name="nobody", dir=folder)) == 2
    assert "no certificate nobody.pem" in capsys.readouterr().err


def test_a_broken_list_keeps_the_serials_read_before(tmp_path):
    path = tmp_path / REVOKED_FILE
    path.write_text("ab12  # stage0\n")
    denylist = Denylist(path, recheck_s=0)
    assert denylist.serials() == {0xAB12}
    path.write_text("not hex\n")
    assert denylist.serials() == {0xAB12}


def lifetime(pem: bytes) -> datetime.timedelta:
    cert = x509.load_pem_x509_certificate(pem)
    return cert.not_valid_after_utc - cert.not_valid_before_utc


@pytest.mark.parametrize("per_host", [False, True], ids=["one-machine", "host-bundles"])
def test_pipeshard_certs_issues_node_certificates_for_90_days_unless_told(tmp_path, per_host):
    topology = None
    if per_host:
        topology = tmp_path / "topology.yaml"
        Topology.loopback("shards/x", 2).save(topology)
    issued = {}
    for days in (None, 7):
        folder = tmp_path / f"certs-{days}"
        args = argparse.Namespace(dir=folder, stages=2, nodes="", hosts="", topology=topology, days=days)
        assert run(args) == 0
        nodes = [p for p in folder.rglob("*.pem") if p.name != "ca.pem"]
        assert len(nodes) >= 4  # exporter, coordinator, stage0, stage1 (and the gateway per host)
        issued[days] = {lifetime(p.read_bytes()) for p in nodes}
        assert lifetime((folder / "ca.pem").read_bytes()) == datetime.timedelta(days=365, minutes=5)
    # not_valid_before is 5 minutes back, for clocks a little behind
    assert issued == {
        None: {datetime.timedelta(days=90, minutes=5)},
        7: {datetime.timedelta(days=7, minutes=5)},
    }
