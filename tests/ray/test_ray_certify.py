"""The secured Ray fleet's certificates without a cluster: a member's request is signed for its
host and role alone; a request from a node without the fleet token, or for an unknown role, is
refused; the request itself holds no private key and no token."""

from __future__ import annotations

import pytest

pytest.importorskip("ray", reason="Ray is not installed: pip install -e '.[ray]' (make setup does)")

from cryptography import x509
from cryptography.x509.oid import NameOID

from pipeshard.auth import load_or_create_token
from pipeshard.errors import PermissionDenied
from pipeshard.services.raycluster import certify
from pipeshard.tls import TOKEN_FILE, certificate_role, fleet_ca


class _Signer:
    """Stands in for the signer actor's handle: ``sign.remote`` signs at once."""

    def __init__(self, folder):
        self.ca_key, self.ca_cert = fleet_ca(folder)
        self.token = (folder / TOKEN_FILE).read_text().strip()
        self.requests: list[certify.CertRequest] = []
        self.sign = self

    def remote(self, request):
        self.requests.append(request)
        return certify.sign_request(self.ca_key, self.ca_cert, self.token, request)


@pytest.fixture
def fleet(tmp_path, monkeypatch):
    head = tmp_path / "head"
    fleet_ca(head)
    token = load_or_create_token(head / TOKEN_FILE)
    member = tmp_path / "member"
    member.mkdir()
    for name in ("ca.pem", TOKEN_FILE):
        (member / name).write_bytes((head / name).read_bytes())
    monkeypatch.setattr(certify.ray, "get", lambda value, **_: value)
    return head, member, token


def test_a_member_gets_a_certificate_for_its_host_and_role_and_no_secret_crosses(
    fleet, tmp_path, monkeypatch
):
    head, member, token = fleet
    monkeypatch.setenv("PIPESHARD_CERTS_DIR", str(member))
    signer = _Signer(head)
    env = certify.request_certificate(signer, tmp_path / "tls", "stage1.r1", "stage", "10.1.2.3")
    cert = x509.load_pem_x509_certificate((tmp_path / "tls" / "stage1.r1.pem").read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["10.1.2.3"]
    assert sans.get_values_for_type(x509.DNSName) == []
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "stage1.r1"
    assert certificate_role((tmp_path / "tls" / "stage1.r1.pem").read_bytes()) == "stage"
    assert cert.issuer == signer.ca_cert.subject
    assert ((tmp_path / "tls" / "stage1.r1.key").stat().st_mode & 0o777) == 0o600
    assert env["PIPESHARD_TLS_NAME"] == "stage1.r1" and env["PIPESHARD_TLS_DIR"] == str(tmp_path / "tls")
    (request,) = signer.requests
    crossed = repr(request).encode() + request.csr_pem
    assert b"PRIVATE KEY" not in crossed and token.encode() not in crossed


def test_a_node_without_the_fleet_token_gets_no_certificate(fleet, tmp_path, monkeypatch):
    head, member, _ = fleet
    signer = _Signer(head)
    stranger = tmp_path / "stranger"  # a CA and token of its own: not the fleet's
    fleet_ca(stranger)
    load_or_create_token(stranger / TOKEN_FILE)
    monkeypatch.setenv("PIPESHARD_CERTS_DIR", str(stranger))
    with pytest.raises(PermissionDenied, match="does not hold the fleet's token"):
        certify.request_certificate(signer, tmp_path / "tls", "stage0", "stage", "10.1.2.4")
    assert not (tmp_path / "tls" / "stage0.pem").exists()
    monkeypatch.setenv("PIPESHARD_CERTS_DIR", str(tmp_path / "empty"))
    with pytest.raises(PermissionDenied, match="has no fleet CA"):
        certify.request_certificate(signer, tmp_path / "tls", "stage0", "stage", "10.1.2.4")
    monkeypatch.setenv("PIPESHARD_CERTS_DIR", str(member))
    with pytest.raises(PermissionDenied, match="role must be one of"):
        certify.request_certificate(signer, tmp_path / "tls", "stage0", "admin", "10.1.2.4")
