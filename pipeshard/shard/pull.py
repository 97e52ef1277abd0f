"""A fleet node pulls its files from the exporter, verifying every file's checksum.

A stage pulls its stage's shard (the root files and its stage folder); a coordinator pulls only
the export's root files (manifest, config, tokenizer). Files land in a temporary folder beside
the target and are moved in only when every checksum matched, so an interrupted pull never
leaves a shard that looks complete.
"""

from __future__ import annotations

import hashlib
import shutil
import socket
import ssl
import time
from pathlib import Path

import grpc
import structlog

from pipeshard.auth import token_metadata
from pipeshard.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied, Unavailable
from pipeshard.reach import is_tls_failure, unreachable_hint
from pipeshard.revocation import REVOKED_FILE, Denylist
from pipeshard.shard.manifest import verify_root_files, verify_shard
from pipeshard.tls import TlsConfig, certificate_role
from pipeshard.v1 import exporter_pb2, exporter_pb2_grpc

log = structlog.get_logger(__name__)

CONNECT_TIMEOUT_S = 60.0  # how long an unreachable exporter is retried before the pull fails
RETRY_S = 2.0


def pull_shard(
    address: str,
    export_dir: Path,
    stage: int,
    timeout_s: float = 600.0,
    *,
    tls: TlsConfig | None = None,
    token: str | None = None,
    connect_timeout_s: float = CONNECT_TIMEOUT_S,
) -> Path:
    """Fetch stage ``stage`` of export ``export_dir.name`` from the exporter at ``address``
    (over TLS with ``tls``, presenting ``token`` when the exporter requires one). An exporter
    not reachable within ``connect_timeout_s`` fails the pull with a line naming the fix."""
    export_dir = Path(export_dir)
    request = exporter_pb2.FetchShardRequest(export_name=export_dir.name, stage_index=stage)
    _retrying(address, export_dir, request, f"stage {stage}", timeout_s, tls, token, connect_timeout_s)
    verify_shard(export_dir, stage)
    return export_dir


def pull_root_files(
    address: str,
    export_dir: Path,
    timeout_s: float = 600.0,
    *,
    tls: TlsConfig | None = None,
    token: str | None = None,
    connect_timeout_s: float = CONNECT_TIMEOUT_S,
) -> Path:
    """Fetch the root files (manifest, config, tokenizer) of export ``export_dir.name``: what a
    coordinator reads, none of the stages' weights."""
    export_dir = Path(export_dir)
    request = exporter_pb2.FetchShardRequest(export_name=export_dir.name, root_files_only=True)
    what = "the export's root files"
    _retrying(address, export_dir, request, what, timeout_s, tls, token, connect_timeout_s)
    verify_root_files(export_dir)
    return export_dir


def _retrying(
    address: str,
    export_dir: Path,
    request: exporter_pb2.FetchShardRequest,
    what: str,
    timeout_s: float,
    tls: TlsConfig | None,
    token: str | None,
    connect_timeout_s: float,
) -> None:
    """``_pull``, retried while the exporter cannot be reached (it may start after this node),
    then refused in one line that names the fix; a refusal by the exporter is final at once."""
    deadline = time.monotonic() + connect_timeout_s
    while True:
        try:
            if tls is not None:
                check_exporter_role(address, tls)
            return _pull(address, export_dir, request, timeout_s, tls, token)
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details() or ""
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidArgument(
                    "stage", f"cannot be pulled from the exporter at {address}: {details}"
                ) from None
            if code == grpc.StatusCode.NOT_FOUND:
                raise NotFound(
                    f"the exporter at {address} has no export {request.export_name!r} (the --shards "
                    f"folder's last part names it): {details}"
                ) from None
            if code != grpc.StatusCode.UNAVAILABLE:
                raise Unavailable(f"cannot pull {what} from the exporter at {address}: {details}") from None
            hint = unreachable_hint("exporter", address, details)
            if is_tls_failure(details) or time.monotonic() + RETRY_S > deadline:
                raise Unavailable(f"{hint} (pulling {what})") from None
            log.warning("exporter_unreachable", exporter=address, hint=hint)
            time.sleep(RETRY_S)


def check_exporter_role(address: str, tls: TlsConfig) -> None:
    """Refuse an exporter whose certificate names another role (a stage's key cannot serve
    shards) or is in the revocation list beside this node's certificates: read on a TLS
    connection of its own before the pull, as gRPC does not show a client its server's
    certificate. Fleets whose certificates name no role (`make up SECURE=1`) and revoke none,
    and exporters not answering yet (the pull itself then says why), pass."""
    denylist = Denylist(tls.ca.parent / REVOKED_FILE)
    if certificate_role(tls.cert.read_bytes()) is None and not denylist.serials():
        return
    host, _, port = address.rpartition(":")
    context = ssl.create_default_context(cafile=str(tls.ca))
    context.set_alpn_protocols(["h2"])
    context.load_cert_chain(tls.cert, tls.key)
    try:
        with (
            socket.create_connection((host, int(port)), timeout=10) as raw,
            context.wrap_socket(raw, server_hostname=host) as conn,
        ):
            der = conn.getpeercert(binary_form=True)
    except (OSError, ValueError):
        return
    pem = ssl.DER_cert_to_PEM_cert(der).encode() if der else None
    if pem is not None:
        denylist.check(pem, f"the exporter at {address}")
    role = certificate_role(pem) if pem else None
    if role is not None and role != "exporter":
        raise PermissionDenied(
            f"the server at {address} is not an exporter: its certificate is a {role}'s; give "
            "the exporter's address (--exporter, or the topology's exporter)"
        )


def _pull(
    address: str,
    export_dir: Path,
    request: exporter_pb2.FetchShardRequest,
    timeout_s: float,
    tls: TlsConfig | None,
    token: str | None,
) -> None:
    """Stream the files ``request`` asks for into ``export_dir``, each checked on arrival; a
    failed call (grpc.RpcError) leaves nothing behind."""
    part = "root" if request.root_files_only else str(request.stage_index)
    tmp = export_dir.parent / f".{export_dir.name}.pull-{part}"
    shutil.rmtree(tmp, ignore_errors=True)
    received: list[str] = []
    try:
        channel = (
            grpc.secure_channel(address, tls.channel_credentials())
            if tls is not None
            else grpc.insecure_channel(address)
        )
        with channel:
            stub = exporter_pb2_grpc.ExporterServiceStub(channel)
            digest, handle = None, None
            calls = stub.FetchShard(request, timeout=timeout_s, metadata=token_metadata(token))
            for chunk in calls:
                if chunk.offset == 0:
                    target = (tmp / chunk.path).resolve()
                    if tmp.resolve() not in target.parents:
                        raise FailedPrecondition(f"exporter sent a path outside the shard: {chunk.path!r}")
                    target.parent.mkdir(parents=True, exist_ok=True)
                    handle, digest = target.open("wb"), hashlib.sha256()
                if handle is None or digest is None:
                    raise FailedPrecondition(f"exporter began {chunk.path!r} at offset {chunk.offset}")
                handle.write(chunk.data)
                digest.update(chunk.data)
                if chunk.last_chunk:
                    handle.close()
                    if digest.hexdigest() != chunk.file_sha256.removeprefix("sha256:"):
                        raise FailedPrecondition(f"{chunk.path} arrived damaged (sha256 mismatch)")
                    received.append(chunk.path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    export_dir.mkdir(parents=True, exist_ok=True)
    for rel in received:
        (export_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / rel).replace(export_dir / rel)
    shutil.rmtree(tmp, ignore_errors=True)
