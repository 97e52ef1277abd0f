"""A fleet node pulls its files from the exporter, verifying every file's checksum.

A stage pulls its stage's shard (the root files and its stage folder); a coordinator pulls only
the export's root files (manifest, config, tokenizer). Files land in a temporary folder beside
the target and are moved in only when every checksum matched, so an interrupted pull never
leaves a shard that looks complete.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import grpc

from pipeshard.auth import token_metadata
from pipeshard.errors import FailedPrecondition, Unavailable
from pipeshard.shard.manifest import verify_root_files, verify_shard
from pipeshard.tls import TlsConfig
from pipeshard.v1 import exporter_pb2, exporter_pb2_grpc


def pull_shard(
    address: str,
    export_dir: Path,
    stage: int,
    timeout_s: float = 600.0,
    *,
    tls: TlsConfig | None = None,
    token: str | None = None,
) -> Path:
    """Fetch stage ``stage`` of export ``export_dir.name`` from the exporter at ``address``
    (over TLS with ``tls``, presenting ``token`` when the exporter requires one)."""
    export_dir = Path(export_dir)
    request = exporter_pb2.FetchShardRequest(export_name=export_dir.name, stage_index=stage)
    _pull(address, export_dir, request, f"stage {stage}", timeout_s, tls, token)
    verify_shard(export_dir, stage)
    return export_dir


def pull_root_files(
    address: str,
    export_dir: Path,
    timeout_s: float = 600.0,
    *,
    tls: TlsConfig | None = None,
    token: str | None = None,
) -> Path:
    """Fetch the root files (manifest, config, tokenizer) of export ``export_dir.name``: what a
    coordinator reads, none of the stages' weights."""
    export_dir = Path(export_dir)
    request = exporter_pb2.FetchShardRequest(export_name=export_dir.name, root_files_only=True)
    _pull(address, export_dir, request, "the export's root files", timeout_s, tls, token)
    verify_root_files(export_dir)
    return export_dir


def _pull(
    address: str,
    export_dir: Path,
    request: exporter_pb2.FetchShardRequest,
    what: str,
    timeout_s: float,
    tls: TlsConfig | None,
    token: str | None,
) -> None:
    """Stream the files ``request`` asks for into ``export_dir``, each checked on arrival."""
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
            calls = stub.FetchShard(
                request, timeout=timeout_s, wait_for_ready=True, metadata=token_metadata(token)
            )
            for chunk in calls:
                if chunk.offset == 0:
                    target = (tmp / chunk.path).resolve()
                    if tmp.resolve() not in target.parents:
                        raise FailedPrecondition(f"exporter sent a path outside the shard: {chunk.path!r}")
                    target.parent.mkdir(parents=True, exist_ok=True)
                    handle, digest = target.open("wb"), hashlib.sha256()
                handle.write(chunk.data)
                digest.update(chunk.data)
                if chunk.last_chunk:
                    handle.close()
                    if digest.hexdigest() != chunk.file_sha256.removeprefix("sha256:"):
                        raise FailedPrecondition(f"{chunk.path} arrived damaged (sha256 mismatch)")
                    received.append(chunk.path)
    except grpc.RpcError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise Unavailable(f"cannot pull {what} from the exporter at {address}: {exc.details()}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    export_dir.mkdir(parents=True, exist_ok=True)
    for rel in received:
        (export_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / rel).replace(export_dir / rel)
    shutil.rmtree(tmp, ignore_errors=True)
