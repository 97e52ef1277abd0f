"""pipeshard.auth and pipeshard.tls pieces that need no server: token parsing, client identity,
certificates that chain to their own fleet CA only."""

from __future__ import annotations

import pytest

from pipeshard.auth import Authenticator, bearer_of, load_or_create_token, token_metadata
from pipeshard.errors import Unauthenticated
from pipeshard.keys import KeyRing, add_key
from pipeshard.tls import make_certs


class Context:
    def __init__(self, metadata=(), peer="ipv4:127.0.0.1:50123"):
        self._metadata, self._peer = metadata, peer

    def invocation_metadata(self):
        return self._metadata

    def peer(self):
        return self._peer


def test_bearer_token_parsing():
    assert bearer_of(token_metadata("abc")) == "abc"
    assert bearer_of((("authorization", "Basic abc"),)) is None and bearer_of(()) is None


def test_an_open_service_names_callers_by_host_whatever_token_they_invent():
    identify = Authenticator().identify
    invented = {identify(Context(token_metadata(f"made-up-{i}"), f"ipv4:127.0.0.1:{i}")) for i in range(40)}
    assert [i.name for i in invented] == ["peer:127.0.0.1"]  # the forged-token flood is one identity
    assert identify(Context(peer="ipv6:[::1]:5")).name == "peer:[::1]"


def test_keys_and_the_fleet_token_are_identities_and_nothing_else_is(tmp_path):
    path = tmp_path / "api-keys"
    alice = add_key(path, "alice", weight=2.0, max_running=3, max_queued=5)
    bob = add_key(path, "bob")
    auth = Authenticator("fleet-token", KeyRing(path))
    a = auth.identify(Context(token_metadata(alice)))
    assert (a.name, a.weight, a.max_running, a.max_queued) == ("key:alice", 2.0, 3, 5)
    assert auth.identify(Context(token_metadata(bob))).name == "key:bob"
    assert auth.identify(Context(token_metadata("fleet-token"))).name == "token:fleet"
    for presented in ((), token_metadata("invented"), token_metadata(alice[:-1])):
        assert auth.verify(bearer_of(presented)) is None
        with pytest.raises(Unauthenticated, match="API key"):
            auth.identify(Context(presented))
    assert auth.required and not Authenticator().required


def test_token_file_is_private_and_stable(tmp_path):
    path = tmp_path / "certs" / "token"
    token = load_or_create_token(path)
    assert len(token) >= 32 and load_or_create_token(path) == token
    assert path.stat().st_mode & 0o077 == 0


def test_node_certificates_chain_to_their_own_ca_only(tmp_path):
    from cryptography import x509
    from cryptography.x509.verification import PolicyBuilder, Store, VerificationError

    make_certs(tmp_path / "a", ["stage0"], hosts=["10.0.0.5"])
    make_certs(tmp_path / "b", ["stage0"])
    assert make_certs(tmp_path / "a", ["stage0"]) == []  # idempotent: nothing rewritten
    assert (tmp_path / "a" / "stage0.key").stat().st_mode & 0o077 == 0

    def load(path):
        return x509.load_pem_x509_certificate(path.read_bytes())

    leaf = load(tmp_path / "a" / "stage0.pem")
    verifier = (
        PolicyBuilder()
        .store(Store([load(tmp_path / "a" / "ca.pem")]))
        .build_server_verifier(x509.DNSName("stage0"))
    )
    verifier.verify(leaf, [])
    with pytest.raises(VerificationError):
        verifier.verify(load(tmp_path / "b" / "stage0.pem"), [])
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"stage0", "localhost"} <= set(san.get_values_for_type(x509.DNSName))
    assert {"127.0.0.1", "10.0.0.5"} <= {str(ip) for ip in san.get_values_for_type(x509.IPAddress)}
