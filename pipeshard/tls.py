"""Fleet TLS: a fleet CA, per-node certificates (``pipeshard certs``) and the gRPC credentials.

Stages demand a client certificate signed by the fleet CA (mutual TLS), so only fleet members
(the coordinator, the previous stage) can send frames, open sessions or subscribe to results.
The coordinator and the exporter serve TLS to clients that hold only the CA certificate; those
clients prove themselves with the bearer token instead (pipeshard.auth).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import grpc

from pipeshard import paths
from pipeshard.errors import FailedPrecondition

CA_CERT = "ca.pem"
CA_KEY = "ca.key"
DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")
VALID_DAYS = 825


@dataclass(frozen=True)
class TlsConfig:
    """One fleet member's identity: the fleet CA and this node's certificate and key."""

    ca: Path
    cert: Path
    key: Path

    @classmethod
    def from_dir(cls, folder: Path, name: str) -> TlsConfig:
        config = cls(Path(folder) / CA_CERT, Path(folder) / f"{name}.pem", Path(folder) / f"{name}.key")
        for path in (config.ca, config.cert, config.key):
            if not path.is_file():
                raise FailedPrecondition(
                    f"TLS file {path} is missing: create the fleet's certificates with "
                    f"`pipeshard certs --dir {folder}` (node name {name!r})"
                )
        return config

    def server_credentials(self, *, require_client_cert: bool) -> grpc.ServerCredentials:
        """With ``require_client_cert`` only peers holding a certificate of the fleet CA connect."""
        return grpc.ssl_server_credentials(
            [(self.key.read_bytes(), self.cert.read_bytes())],
            root_certificates=self.ca.read_bytes() if require_client_cert else None,
            require_client_auth=require_client_cert,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Verifies the server against the fleet CA and presents this node's certificate."""
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca.read_bytes(),
            private_key=self.key.read_bytes(),
            certificate_chain=self.cert.read_bytes(),
        )


def default_ca_cert() -> Path:
    """Where clients look for the fleet CA certificate: PIPESHARD_CA_CERT, else certs/ca.pem."""
    return Path(os.environ.get("PIPESHARD_CA_CERT", paths.certs_dir() / CA_CERT))


def client_credentials(ca_cert: Path) -> grpc.ChannelCredentials:
    """A client of the coordinator or exporter: verifies the server, presents no certificate."""
    return grpc.ssl_channel_credentials(root_certificates=Path(ca_cert).read_bytes())


# ---------------------------------------------------------------- making certificates


def _write_private(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _san(hosts: Iterable[str]):
    from cryptography import x509

    names: list[x509.GeneralName] = []
    for host in dict.fromkeys(hosts):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def make_certs(folder: Path, nodes: Iterable[str], hosts: Iterable[str] = ()) -> list[Path]:
    """Create the fleet CA (unless ``folder`` has one) and a certificate for every node that has
    none; each is valid for the node's name, loopback and ``hosts``. Returns the files written."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    now = datetime.datetime.now(datetime.UTC)
    pem = serialization.Encoding.PEM
    pkcs8, unencrypted = serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    if (folder / CA_CERT).exists() and (folder / CA_KEY).exists():
        loaded = serialization.load_pem_private_key((folder / CA_KEY).read_bytes(), None)
        if not isinstance(loaded, ec.EllipticCurvePrivateKey):
            raise FailedPrecondition(f"{folder / CA_KEY} is not the EC key this command makes")
        ca_key = loaded
        ca_cert = x509.load_pem_x509_certificate((folder / CA_CERT).read_bytes())
    else:
        ca_key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"pipeshard fleet CA {now:%Y%m%d%H%M%S}")])
        ca_cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(ca_key, hashes.SHA256())
        )
        _write_private(folder / CA_KEY, ca_key.private_bytes(pem, pkcs8, unencrypted))
        (folder / CA_CERT).write_bytes(ca_cert.public_bytes(pem))
        written += [folder / CA_KEY, folder / CA_CERT]
    for node in nodes:
        cert_path, key_path = folder / f"{node}.pem", folder / f"{node}.key"
        if cert_path.exists() and key_path.exists():
            continue
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node)]))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(_san([node, *DEFAULT_HOSTS, *hosts]), critical=False)
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .sign(ca_key, hashes.SHA256())
        )
        _write_private(key_path, key.private_bytes(pem, pkcs8, unencrypted))
        cert_path.write_bytes(cert.public_bytes(pem))
        written += [key_path, cert_path]
    return written
