"""ExporterService over gRPC: Export streams progress then the manifest; FetchShard streams files.

Exports run one at a time in a worker thread (each stage in its own subprocess); progress
events cross back to the event loop through a queue. An export whose caller goes away is
cancelled and leaves no partial folder; a forced export never replaces an export a running
fleet serves (pipeshard.shard.serving). With a token configured, only its holders may call (the
operator): see pipeshard.auth. FetchShard serves only files listed in an
export's manifest, so a request can never read outside the shards directory: one stage's files
for a stage, or only the root files (manifest, config, tokenizer) for a coordinator.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import structlog

from pipeshard import paths
from pipeshard.errors import InvalidArgument, NotFound
from pipeshard.exporter.export import ExportResult, ProgressEvent, export_model
from pipeshard.model.fetch import resolve_model_source
from pipeshard.shard.manifest import MANIFEST, WEIGHT_FORMATS, file_sha256, load_manifest
from pipeshard.shard.serving import not_served
from pipeshard.v1 import exporter_pb2, exporter_pb2_grpc

log = structlog.get_logger(__name__)

CHUNK_BYTES = 1 << 20


def _safe_name(name: str, field: str) -> str:
    if not name or "/" in name or "\\" in name or name.startswith("."):
        raise InvalidArgument(field, f"must be a plain folder name under the shards directory, got {name!r}")
    return name


class ExporterServicer(exporter_pb2_grpc.ExporterServiceServicer):
    def __init__(self, shards_dir: Path | None = None):
        self._shards_dir = shards_dir or paths.shards_dir()
        self._lock = asyncio.Lock()

    async def Export(self, request, context) -> AsyncIterator[exporter_pb2.ExportResponse]:
        if request.weights and request.weights not in WEIGHT_FORMATS:
            raise InvalidArgument(
                "weights", f"must be one of {', '.join(WEIGHT_FORMATS)}, got {request.weights!r}"
            )
        if request.stages < 0:
            raise InvalidArgument("stages", f"must be positive, got {request.stages}")
        if not request.model:
            raise InvalidArgument("model", "must name a model folder or a model under the models directory")
        model_dir = resolve_model_source(request.model)
        weights = request.weights or "int4"
        stages = request.stages or (len(request.split) if request.split else 1)
        name = (
            _safe_name(request.out, "out")
            if request.out
            else paths.export_name(model_dir.name, stages, weights)
        )
        out = self._shards_dir / name
        if (out / MANIFEST).exists() and not request.force:
            yield exporter_pb2.ExportResponse(
                done=exporter_pb2.ExportDone(out_dir=str(out), manifest_json=(out / MANIFEST).read_text())
            )
            return
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[ProgressEvent | None] = asyncio.Queue()
        cancel = threading.Event()

        def progress(event: ProgressEvent) -> None:
            loop.call_soon_threadsafe(events.put_nowait, event)

        def run() -> ExportResult:
            try:
                # A forced export must not replace what a running fleet serves (pipeshard.shard.serving).
                with not_served(out) if request.force else contextlib.nullcontext():
                    return export_model(
                        model_dir,
                        out,
                        stages=None if request.split else stages,
                        split=list(request.split) or None,
                        weights=weights,
                        group_size=request.group_size or "auto",
                        max_context=request.max_context or None,
                        force=request.force,
                        progress=progress,
                        cancel=cancel,
                    )
            finally:
                loop.call_soon_threadsafe(events.put_nowait, None)

        async with self._lock:
            job = loop.run_in_executor(None, run)
            try:
                while (event := await events.get()) is not None:
                    yield exporter_pb2.ExportResponse(
                        progress=exporter_pb2.ExportProgress(
                            stage_index=-1 if event.stage is None else event.stage,
                            phase=event.phase,
                            fraction=event.fraction,
                            message=event.message,
                        )
                    )
                result = await job
            finally:
                if not job.done():
                    # The caller went away (or the server is stopping): stop the export and wait
                    # for it to remove its partial folder before the next export may start.
                    cancel.set()
                    log.info("export_cancelled", out=out.name)
                    with contextlib.suppress(BaseException):
                        await asyncio.shield(job)
        yield exporter_pb2.ExportResponse(
            done=exporter_pb2.ExportDone(
                out_dir=str(result.path), manifest_json=json.dumps(result.manifest.to_dict())
            )
        )

    async def FetchShard(self, request, context) -> AsyncIterator[exporter_pb2.FetchShardResponse]:
        root = self._shards_dir / _safe_name(request.export_name, "export_name")
        if not (root / MANIFEST).is_file():
            raise NotFound(f"no export named {request.export_name!r} in {self._shards_dir}")
        manifest = load_manifest(root)
        if request.root_files_only:
            rels = manifest.root_files()
        else:
            rels = manifest.files_for_stage(request.stage_index)
        for rel in rels:
            path = root / rel
            size = path.stat().st_size
            digest = file_sha256(path)
            with path.open("rb") as f:
                offset = 0
                while True:
                    data = f.read(CHUNK_BYTES)
                    last = offset + len(data) >= size
                    yield exporter_pb2.FetchShardResponse(
                        path=rel,
                        offset=offset,
                        data=data,
                        file_size=size,
                        file_sha256=digest,
                        last_chunk=last,
                    )
                    offset += len(data)
                    if last:
                        break
