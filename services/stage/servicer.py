"""StageService over gRPC: protobuf in, StageNode call, protobuf out.

Every session call and Results subscription acts for the caller's owner key (pipeshard.ownership):
another owner's sessions answer NOT_FOUND exactly like sessions that do not exist.
"""

from __future__ import annotations

import asyncio

import structlog

from pipeshard import trace
from pipeshard.errors import InvalidArgument, PermissionDenied
from pipeshard.ownership import owner_from_metadata
from pipeshard.services.stage.node import StageNode
from pipeshard.services.stage.wire import check_id
from pipeshard.services.transport.hop import PROBE_BYTES, PROBE_TRAIN
from pipeshard.shard.kvblob import (
    RestoreLimits,
    SnapshotAssembler,
    check_chunk_bytes,
    from_proto,
    snapshot_chunks,
    to_proto,
)
from pipeshard.tls import require_role
from pipeshard.v1 import stage_pb2, stage_pb2_grpc

log = structlog.get_logger(__name__)


COORDINATOR = ("coordinator",)
RING = ("coordinator", "stage")  # who may send frames: the coordinator, the previous stage
MAX_REASON_CHARS = 512  # of an AbortSession's reason, as logged


def _owner(context) -> str:
    """The caller's owner key; sessions and subscriptions are a coordinator's alone."""
    require_role(context, COORDINATOR, "this stage call")
    return owner_from_metadata(context.invocation_metadata())


def _caller_owner(context) -> str | None:
    """The caller's owner key, or None for a caller without one (GetStageInfo is open to all)."""
    if context is None:
        return None
    try:
        return _owner(context)
    except PermissionDenied:
        return None


class StageServicer(stage_pb2_grpc.StageServiceServicer):
    def __init__(self, node: StageNode, info: stage_pb2.GetStageInfoResponse):
        self._node = node
        self._info = info

    async def Forward(self, request_iterator, context):
        # Frames name their owner themselves (ActivationFrame.owner): they come from the
        # coordinator or, further down the ring, from the previous hop.
        require_role(context, RING, "Forward")
        await context.send_initial_metadata(())  # lets the caller see the stream is up
        async for request in request_iterator:
            if request.ack_id:  # the sender times its link: acknowledge before the compute
                yield stage_pb2.ForwardResponse(ack_id=request.ack_id)
            if not request.HasField("frame"):
                continue  # a link probe
            trace.mark("recv", request.frame.session_id, request.frame.step_id)
            error = await self._node.handle(request.frame)
            if error is not None:
                yield stage_pb2.ForwardResponse(
                    session_id=request.frame.session_id, step_id=request.frame.step_id, error=error
                )

    async def Results(self, request, context):
        owner = _owner(context)
        check_id("subscriber_id", request.subscriber_id)
        subscription = self._node.results.subscribe(owner, request.subscriber_id)
        await context.send_initial_metadata(())  # lets the subscriber see it is live
        try:
            if request.link_probe:  # the subscriber times the spacing of these (its return link)
                for _ in range(PROBE_TRAIN):
                    yield stage_pb2.ResultsResponse(padding=bytes(PROBE_BYTES))
            while (results := await subscription.get()) is not None:
                if len(results) == 1:
                    yield stage_pb2.ResultsResponse(result=results[0])
                else:  # a step of several rows: one message
                    yield stage_pb2.ResultsResponse(results=results)
                trace.mark("results_written", results[0].session_id, results[0].step_id)
        finally:
            self._node.results.unsubscribe(owner, request.subscriber_id, subscription)

    async def OpenSession(self, request, context):
        owner = _owner(context)
        check_id("session_id", request.session_id)
        self._node.note_results_link(owner, request.results_link_bandwidth_bytes_per_second)
        next_hop = request.next_hop if request.HasField("next_hop") else None
        self._node.open_session(owner, request.session_id, request.capacity or None, request.codec, next_hop)
        return stage_pb2.OpenSessionResponse(max_context=self._node.engine.max_context)

    async def RouteSession(self, request, context):
        owner = _owner(context)
        check_id("session_id", request.session_id)
        positions = self._node.route_session(
            owner,
            request.session_id,
            request.next_hop if request.HasField("next_hop") else None,
            request.keep_positions if request.HasField("keep_positions") else None,
        )
        log.info(
            "session_routed",
            session_id=request.session_id,
            next_hop=request.next_hop if request.HasField("next_hop") else None,
            positions=positions,
        )
        return stage_pb2.RouteSessionResponse(positions=positions)

    async def ResetSession(self, request, context):
        owner = _owner(context)
        check_id("session_id", request.session_id)
        self._node.engine.reset(owner, request.session_id)
        return stage_pb2.ResetSessionResponse()

    async def ReleaseSession(self, request, context):
        owner = _owner(context)
        check_id("session_id", request.session_id)
        return stage_pb2.ReleaseSessionResponse(
            released=self._node.engine.sessions.release(owner, request.session_id)
        )

    async def AbortSession(self, request, context):
        owner = _owner(context)
        check_id("session_id", request.session_id)
        # The reason is only logged: cut, so a caller cannot write megabytes to the log per call.
        log.info("session_aborted", session_id=request.session_id, reason=request.reason[:MAX_REASON_CHARS])
        return stage_pb2.AbortSessionResponse(
            aborted=self._node.engine.sessions.release(owner, request.session_id)
        )

    async def CaptureKv(self, request, context):
        owner, kv = _owner(context), self._node.kv
        if request.keep_in_cache:
            if request.from_position:
                raise InvalidArgument(
                    "from_position", "must be 0 with keep_in_cache: the cache keeps whole prefixes"
                )
            positions, added = kv.keep(owner, request.session_id, request.cache_scope, request.token_ids)
            return stage_pb2.CaptureKvResponse(
                positions=positions, cached_bytes=added, evicted_blocks=kv.dropped(owner)
            )
        blob = kv.capture(owner, request.session_id, request.token_ids, request.from_position)
        return stage_pb2.CaptureKvResponse(snapshot=to_proto(blob), positions=blob.positions)

    def _limits(self) -> RestoreLimits:
        return RestoreLimits.of(self._node.kv_service.source, self._node.engine.max_context)

    async def RestoreKv(self, request, context):
        owner, kv = _owner(context), self._node.kv
        check_id("session_id", request.session_id)
        if request.HasField("snapshot"):
            blob = from_proto(request.snapshot, kv.source, self._node.engine.max_context)
            positions = kv.restore(owner, request.session_id, blob)
        else:
            positions = kv.restore_cached(
                owner, request.session_id, request.cache_scope, request.cached_token_ids, request.positions
            )
        return stage_pb2.RestoreKvResponse(positions=positions, evicted_blocks=kv.dropped(owner))

    async def CaptureKvStream(self, request, context):
        if request.capture.keep_in_cache:
            raise InvalidArgument("capture.keep_in_cache", "must be false: keep with CaptureKv")
        capture, owner = request.capture, _owner(context)
        chunk_bytes = check_chunk_bytes(request.chunk_bytes)

        def snapshot() -> tuple[int, int, list[bytes]]:
            # Off the event loop: copying and hashing a long session's KV would stall every frame.
            blob = self._node.kv_service.capture(
                owner, capture.session_id, capture.token_ids, capture.from_position
            )
            return (blob.positions, *snapshot_chunks(to_proto(blob), chunk_bytes))

        positions, total, chunks = await asyncio.to_thread(snapshot)
        for chunk in chunks:
            yield stage_pb2.CaptureKvStreamResponse(
                snapshot_chunk=chunk, snapshot_bytes=total, positions=positions
            )

    async def RestoreKvStream(self, request_iterator, context):
        owner, session_id, parts = _owner(context), "", []  # one assembler per part
        limits, announced, chunks = self._limits(), 0, 0
        async for request in request_iterator:
            if not parts:
                session_id = request.session_id
                check_id("session_id", session_id)
                trace.mark("restore_first_chunk", session_id, 0)
            if not parts or request.next_part:
                announced += max(request.snapshot_bytes, 0)
                limits.check(len(parts) + 1, announced, chunks)  # before the part is taken in
                parts.append(SnapshotAssembler(request.snapshot_bytes))
            chunks += 1
            limits.check(len(parts), announced, chunks)
            parts[-1].add(request.snapshot_chunk)
        if not parts:
            raise InvalidArgument("snapshot_chunk", "the stream sent no chunk")
        if not session_id:
            raise InvalidArgument("session_id", "must not be empty (set it in the first chunk)")

        def checked_blob():
            # Off the event loop: decoding and hashing a long session's KV would stall every frame.
            source, most = self._node.kv.source, self._node.engine.max_context
            return self._node.kv.check_parts([from_proto(part.snapshot(), source, most) for part in parts])

        trace.mark("restore_received", session_id, 0)
        blob = await asyncio.to_thread(checked_blob)
        trace.mark("restore_checked", session_id, 0)
        positions = self._node.kv.restore(owner, session_id, blob, checked=True)
        trace.mark("restore_loaded", session_id, 0)
        log.info("kv_restored", session_id=session_id, positions=positions, parts=len(parts))
        return stage_pb2.RestoreKvStreamResponse(positions=positions)

    async def GetStageInfo(self, request, context):
        """The stage's facts and use; for a caller presenting its owner secret also its own
        share of the block pool and what it holds (what a coordinator's scheduler mirrors)."""
        info = stage_pb2.GetStageInfoResponse()
        info.CopyFrom(self._info)
        engine = self._node.engine
        info.live_sessions = len(engine.sessions)
        info.next_hop_states.extend(
            stage_pb2.NextHopState(address=hop.address, up=hop.up, reason=hop.reason)
            for hop in self._node.next_hops
        )
        info.max_sessions_per_owner = engine.sessions.max_per_owner
        engine.describe(info, _caller_owner(context))
        return info
