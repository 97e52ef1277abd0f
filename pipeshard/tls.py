"""Fleet TLS: a fleet CA, per-node certificates (``pipeshard certs``) and the gRPC credentials.

Stages demand a client certificate signed by the fleet CA (mutual TLS), so only fleet members
(the coordinator, the previous stage) can send frames, open sessions or subscribe to results.
The coordinator and the exporter serve TLS to clients that hold only the CA certificate; those
clients prove themselves with the bearer token instead (pipeshard.auth).
"""

from __future__ import annotations

import datetime
import functools
import ipaddress
import os
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import grpc

from pipeshard import paths
from pipeshard.errors import FailedPrecondition, PermissionDenied
from pipeshard.revocation import check_peer

CA_CERT = "ca.pem"
CA_KEY = "ca.key"
TOKEN_FILE = "token"  # the fleet's client token beside the certificates (`pipeshard certs`)
DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")
VALID_DAYS = 90  # a node certificate's life: re-run `pipeshard certs` before it ends
CA_VALID_DAYS = 365
ROLES = ("exporter", "coordinator", "stage", "gateway")


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


@functools.lru_cache(maxsize=64)
def certificate_role(pem: bytes) -> str | None:
    """The role a fleet certificate names (``pipeshard certs --topology`` writes it as the
    organizational unit), or None for one without (`make up SECURE=1`'s, which act as any)."""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    units = x509.load_pem_x509_certificate(pem).subject.get_attributes_for_oid(
        NameOID.ORGANIZATIONAL_UNIT_NAME
    )
    return str(units[0].value) if units else None


@functools.lru_cache(maxsize=64)
def certificate_hosts(pem: bytes) -> frozenset[str]:
    """The addresses a certificate is valid for: its IP names, and its DNS names resolved
    (once per certificate; a name that does not resolve adds nothing)."""
    from cryptography import x509

    try:
        san = x509.load_pem_x509_certificate(pem).extensions.get_extension_for_class(
            x509.SubjectAlternativeName
        )
    except x509.ExtensionNotFound:
        return frozenset()
    hosts = {str(ip) for ip in san.value.get_values_for_type(x509.IPAddress)}
    for name in san.value.get_values_for_type(x509.DNSName):
        try:
            hosts.update(str(info[4][0]) for info in socket.getaddrinfo(name, None))
        except OSError:
            continue
    return frozenset(hosts)


def peer_host(context) -> str | None:
    """The caller's IP address from a gRPC context (``ipv4:10.0.0.5:4711``), None if not IP."""
    peer = getattr(context, "peer", None)
    kind, _, rest = (peer() if peer is not None else "").partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    return rest.rsplit(":", 1)[0].strip("[]").split("%")[0]


def require_host(context, pem: bytes, role: str) -> None:
    """Refuse a role-bearing certificate presented from a host it was not issued for: a stage's
    key copied to another machine does not work there (`pipeshard certs --topology` issues each
    for its topology host alone)."""
    host = peer_host(context)
    hosts = certificate_hosts(pem)
    if host is not None and hosts and host not in hosts:
        raise PermissionDenied(
            f"the caller's {role} certificate is for {', '.join(sorted(hosts))}, not {host}, where it "
            "is used (each fleet certificate serves its topology host alone)"
        )


def require_role(context, roles: tuple[str, ...], what: str) -> None:
    """Refuse a call whose peer certificate is revoked or names a role not in ``roles``
    (PermissionDenied): a stage's certificate cannot act as a coordinator; a role-bearing one
    must be used from its own host. Plaintext calls and certificates without a role pass the
    role and host checks (they are checked, or not, as before)."""
    auth = getattr(context, "auth_context", None)
    pem = (auth() if auth is not None else {}).get("x509_pem_cert")
    if pem:
        check_peer(pem[0])  # a revoked certificate is refused whatever its role
    role = certificate_role(pem[0]) if pem else None
    if role is not None and role not in roles:
        raise PermissionDenied(
            f"{what} is for a {' or '.join(roles)}; the caller's certificate is a {role}'s "
            "(`pipeshard certs --topology` gives each process its role)"
        )
    if pem and role is not None:
        require_host(context, pem[0], role)


def default_ca_cert() -> Path:
    """Where clients look for the fleet CA certificate: PIPESHARD_CA_CERT, else certs/ca.pem."""
    return Path(os.environ.get("PIPESHARD_CA_CERT", paths.certs_dir() / CA_CERT))


def client_credentials(ca_cert: Path) -> grpc.ChannelCredentials:
    """A client of the coordinator or exporter: verifies the server, presents no certificate."""
    return grpc.ssl_channel_credentials(root_certificates=Path(ca_cert).read_bytes())


# ---------------------------------------------------------------- making certificates


def write_private(path: Path, data: bytes) -> None:
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


@dataclass(frozen=True)
class HostCert:
    """One process's certificate: its node name (file and common name), role and host."""

    name: str  # exporter, coordinator, stage0, ...: the file name in its bundle
    role: str  # one of ROLES, written into the certificate (organizational unit)
    host: str  # the only name or IP the certificate is valid for


def _ca(folder: Path, now: datetime.datetime, days: int):
    """The fleet CA in ``folder`` (made if missing): (key, certificate, files written)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    if (folder / CA_CERT).exists() and (folder / CA_KEY).exists():
        ca_key = serialization.load_pem_private_key((folder / CA_KEY).read_bytes(), None)
        return ca_key, x509.load_pem_x509_certificate((folder / CA_CERT).read_bytes()), []
    ca_key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"pipeshard fleet CA {now:%Y%m%d%H%M%S}")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
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
    write_private(folder / CA_KEY, ca_key.private_bytes(**key_format()))
    (folder / CA_CERT).write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    return ca_key, ca_cert, [folder / CA_KEY, folder / CA_CERT]


def key_format() -> dict:
    from cryptography.hazmat.primitives import serialization

    return dict(
        encoding=serialization.Encoding.PEM,
        format=serialization.PrivateFormat.PKCS8,
        encryption_algorithm=serialization.NoEncryption(),
    )


def signed_certificate(
    ca_key, ca_cert, public_key, node: str, sans: Iterable[str], days: int, role: str | None = None
) -> bytes:
    """A node certificate (PEM) for ``public_key``, valid for exactly ``sans``, naming ``role``:
    the one shape of certificate the fleet CA signs, for keys made here or on another machine."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    subject = [x509.NameAttribute(NameOID.COMMON_NAME, node)]
    if role is not None:
        subject.append(x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role))
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name(subject))
        .issuer_name(ca_cert.subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()), critical=False
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .add_extension(_san(sans), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM)


def _issue(
    ca_key, ca_cert, folder: Path, node: str, sans: Iterable[str], days: int, role: str | None = None
) -> list[Path]:
    """Write ``node``.pem and ``node``.key in ``folder``, valid for exactly ``sans``."""
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    cert_path, key_path = folder / f"{node}.pem", folder / f"{node}.key"
    write_private(key_path, key.private_bytes(**key_format()))
    cert_path.write_bytes(signed_certificate(ca_key, ca_cert, key.public_key(), node, sans, days, role))
    return [key_path, cert_path]


def make_certs(
    folder: Path, nodes: Iterable[str], hosts: Iterable[str] = (), days: int = VALID_DAYS
) -> list[Path]:
    """Create the fleet CA (unless ``folder`` has one) and a certificate for every node that has
    none; each is valid for the node's name, loopback and ``hosts`` (one machine's fleet, `make up
    SECURE=1`). Returns the files written."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    hosts = list(hosts)
    ca_key, ca_cert, written = _ca(folder, datetime.datetime.now(datetime.UTC), CA_VALID_DAYS)
    for node in nodes:
        if (folder / f"{node}.pem").exists() and (folder / f"{node}.key").exists():
            continue
        written += _issue(ca_key, ca_cert, folder, node, [node, *DEFAULT_HOSTS, *hosts], days)
    return written


def make_host_bundles(folder: Path, certs: Iterable[HostCert], days: int = VALID_DAYS) -> dict[str, Path]:
    """The fleet CA in ``folder`` (kept there: it never leaves this machine) and, per host, a
    folder ``folder/hosts/HOST`` holding ca.pem and only the certificates of the processes on
    that host, each valid for that host alone and naming its role. Existing certificates are
    made again (a re-run after a topology change must not leave one for an old host). Returns
    each host's folder: copy it to that machine as its ``--tls-dir``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert, _ = _ca(folder, datetime.datetime.now(datetime.UTC), CA_VALID_DAYS)
    bundles: dict[str, Path] = {}
    for cert in certs:
        if cert.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {cert.role!r}")
        bundle = bundles.get(cert.host)
        if bundle is None:
            bundle = bundles[cert.host] = folder / "hosts" / cert.host
            bundle.mkdir(parents=True, exist_ok=True)
            (bundle / CA_CERT).write_bytes((folder / CA_CERT).read_bytes())
        _issue(ca_key, ca_cert, bundle, cert.name, [cert.host], days, cert.role)
    return bundles


def fleet_ca(folder: Path):
    """The fleet CA in ``folder`` (made if missing): its key and certificate."""
    ca_key, ca_cert, _ = _ca(Path(folder), datetime.datetime.now(datetime.UTC), CA_VALID_DAYS)
    return ca_key, ca_cert
