"""Certificates for a secured Ray fleet (``up --ray --secure``), issued at start with no key crossing Ray.

Each actor makes its private key on its own node and sends the signer only a certificate request
(its public key, name, role and node address) with a proof that its node holds the fleet token: an
HMAC of the request under the token, never the token. The signer, a detached actor on the head,
reads the fleet CA's key from the head's disk and returns the certificate, valid for that node's
address alone and naming the role, as ``pipeshard certs --topology`` makes them.

A fleet member is a node whose ``PIPESHARD_CERTS_DIR`` (``certs/``) holds the fleet's ``ca.pem``
and ``token``, copied there from the head. A node without them (one that joined an open Ray cluster)
proves nothing: the planner leaves it out, so no lane is pinned to it, and the signer refuses it a
certificate, so nothing started there could join the fleet's mutual TLS.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pipeshard.errors import PermissionDenied
from pipeshard.paths import certs_dir
from pipeshard.services.raycluster.members import Member
from pipeshard.tls import CA_CERT, ROLES, TOKEN_FILE, VALID_DAYS, fleet_ca, key_format, signed_certificate
from pipeshard.tls import write_private as write_private_file

SIGNER = "signer"  # the detached signer actor's name


def proof(token: str, data: bytes) -> str:
    """What shows the fleet token was at hand when ``data`` was made, without revealing it."""
    return hmac.new(token.encode(), data, hashlib.sha256).hexdigest()


def ca_fingerprint(ca_pem: bytes) -> str:
    return hashlib.sha256(ca_pem).hexdigest()


@dataclass(frozen=True)
class NodeCredentials:
    """What makes a node a fleet member: the fleet's CA certificate and token, on its disk."""

    folder: Path
    ca_pem: bytes
    token: str

    @classmethod
    def here(cls) -> NodeCredentials | None:
        folder = certs_dir()
        ca, token = folder / CA_CERT, folder / TOKEN_FILE
        if not (ca.is_file() and token.is_file()):
            return None
        return cls(folder, ca.read_bytes(), token.read_text().strip())


@dataclass(frozen=True)
class CertRequest:
    """One actor's request: a CSR (public key only) and the proof that its node is a member."""

    name: str  # the service's certificate name: exporter, coordinator, gateway, stage0, stage1.r1
    role: str  # one of pipeshard.tls.ROLES
    host: str  # the node address it serves on: the only one the certificate is valid for
    csr_pem: bytes
    proof: str  # proof(token, csr_pem)


@ray.remote(num_cpus=0)
class Signer:
    """The fleet CA on the head: signs members' requests; its key never leaves the head's disk."""

    def __init__(self, folder: str, days: int = VALID_DAYS):
        self.ca_key, self.ca_cert = fleet_ca(Path(folder))
        self.token = (Path(folder) / TOKEN_FILE).read_text().strip()
        self.days = days
        self.crossed: list[tuple[CertRequest, bytes]] = []

    def sign(self, request: CertRequest) -> bytes:
        cert = sign_request(self.ca_key, self.ca_cert, self.token, request, self.days)
        self.crossed.append((request, cert))
        return cert

    def audit(self) -> list[tuple[CertRequest, bytes]]:
        """Every request that reached the signer over Ray and the certificate it sent back: what
        to check for key material (docs/RAY.md, "Security")."""
        return list(self.crossed)

    def prove(self, nonce: str) -> str:
        """The head's answer to a member probe, to compare with a node's (see ``verified``)."""
        return proof(self.token, nonce.encode())


def sign_request(ca_key, ca_cert, token: str, request: CertRequest, days: int = VALID_DAYS) -> bytes:
    """The certificate (PEM) for ``request``; refused unless its node proved it holds the token."""
    from cryptography import x509

    if not hmac.compare_digest(request.proof, proof(token, request.csr_pem)):
        raise PermissionDenied(
            f"{request.name} on {request.host}: its node does not hold the fleet's token "
            f"({certs_dir().name}/{TOKEN_FILE} from the head): no certificate, no stage"
        )
    if request.role not in ROLES:
        raise PermissionDenied(f"role must be one of {', '.join(ROLES)}, got {request.role!r}")
    csr = x509.load_pem_x509_csr(request.csr_pem)
    if not csr.is_signature_valid:
        raise PermissionDenied(f"{request.name}: its certificate request is not signed by its key")
    return signed_certificate(
        ca_key, ca_cert, csr.public_key(), request.name, [request.host], days, request.role
    )


def request_certificate(signer, folder: Path, name: str, role: str, host: str) -> dict[str, str]:
    """On the actor's node: a key made here (kept in ``folder``, mode 0600), a certificate for it
    from the signer, and the node's CA certificate and token beside them. Returns the environment
    that points the service at them (PIPESHARD_TLS_DIR and friends)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    creds = NodeCredentials.here()
    if creds is None:
        raise PermissionDenied(
            f"this node ({host}) has no fleet CA: copy ca.pem and token from the head's certs/ to "
            f"{certs_dir()} (PIPESHARD_CERTS_DIR) before it takes a stage"
        )
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.COMMON_NAME, name),
            x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role),
        ]
    )
    csr = x509.CertificateSigningRequestBuilder().subject_name(subject).sign(key, hashes.SHA256())
    csr_pem = csr.public_bytes(serialization.Encoding.PEM)
    cert = ray.get(signer.sign.remote(CertRequest(name, role, host, csr_pem, proof(creds.token, csr_pem))))
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    write_private_file(folder / f"{name}.key", key.private_bytes(**key_format()))
    write_private_file(folder / TOKEN_FILE, (creds.token + "\n").encode())
    (folder / f"{name}.pem").write_bytes(cert)
    (folder / CA_CERT).write_bytes(creds.ca_pem)
    return {
        "PIPESHARD_TLS_DIR": str(folder),
        "PIPESHARD_TLS_NAME": name,
        "PIPESHARD_CA_CERT": str(folder / CA_CERT),
        "PIPESHARD_TOKEN": creds.token,
    }


@ray.remote(num_cpus=0)
def member_proof(nonce: str, fingerprint: str) -> str:
    """On one node: the proof over ``nonce`` when it holds the fleet's CA and token, else ""."""
    creds = NodeCredentials.here()
    if creds is None or ca_fingerprint(creds.ca_pem) != fingerprint:
        return ""
    return proof(creds.token, nonce.encode())


def verified(
    signer, found: list[Member], ca_pem: bytes, timeout_s: float = 60.0
) -> tuple[list[Member], list[Member]]:
    """The members that prove they hold the fleet's CA and token (to ``signer``), and those that do not."""
    nonce = secrets.token_hex(16)
    want = ray.get(signer.prove.remote(nonce), timeout=timeout_s)
    answers = [
        member_proof.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(m.node_id, soft=False)
        ).remote(nonce, ca_fingerprint(ca_pem))
        for m in found
    ]
    good: list[Member] = []
    bad: list[Member] = []
    for m, answer in zip(found, answers, strict=True):
        try:
            ok = hmac.compare_digest(ray.get(answer, timeout=timeout_s), want)
        except Exception:  # a node that cannot answer is not shown to be a member
            ok = False
        (good if ok else bad).append(m)
    return good, bad
