"""StageService over gRPC: protobuf in, StageNode call, protobuf out.

Every session call and Results subscription acts for the caller's owner key (pipeshard.ownership):
another owner's sessions answer NOT_FOUND exactly like sessions that do not exist.
"""

from __future__ import annotations

import structlog

from pipeshard.errors import Unimplemented
from pipeshard.ownership import owner_from_metadata
from pipeshard.services.stage.node import StageNode
from pipeshard.v1 import stage_pb2, stage_pb2_grpc

log = structlog.get_logger(__name__)


def _owner(context) -> str:
    return owner_from_metadata(context.invocation_metadata())


class StageServicer(stage_pb2_grpc.StageServiceServicer):
    def __init__(self, node: StageNode, info: stage_pb2.GetStageInfoResponse):
        self._node = node
        self._info = info

    async def Forward(self, request_iterator, context):
        # Frames name their owner themselves (ActivationFrame.owner): they come from the
        # coordinator or, further down the ring, from the previous hop.
        await context.send_initial_metadata(())  # lets the caller see the stream is up
        async for request in request_iterator:
            error = await self._node.handle(request.frame)
            if error is not None:
                yield stage_pb2.ForwardResponse(
                    session_id=request.frame.session_id, step_id=request.frame.step_id, error=error
                )

    async def Results(self, request, context):
        owner = _owner(context)
        subscription = self._node.results.subscribe(owner, request.subscriber_id)
        await context.send_initial_metadata(())  # lets the subscriber see it is live
        try:
            while (result := await subscription.get()) is not None:
                yield stage_pb2.ResultsResponse(result=result)
        finally:
            self._node.results.unsubscribe(owner, request.subscriber_id, subscription)

    async def OpenSession(self, request, context):
        self._node.engine.open(_owner(context), request.session_id, request.capacity or None)
        return stage_pb2.OpenSessionResponse(max_context=self._node.engine.max_context)

    async def ResetSession(self, request, context):
        self._node.engine.reset(_owner(context), request.session_id)
        return stage_pb2.ResetSessionResponse()

    async def ReleaseSession(self, request, context):
        return stage_pb2.ReleaseSessionResponse(
            released=self._node.engine.sessions.release(_owner(context), request.session_id)
        )

    async def AbortSession(self, request, context):
        owner = _owner(context)
        log.info("session_aborted", session_id=request.session_id, reason=request.reason)
        return stage_pb2.AbortSessionResponse(
            aborted=self._node.engine.sessions.release(owner, request.session_id)
        )

    async def CaptureKv(self, request, context):
        raise Unimplemented("CaptureKv is not implemented yet (issue #19, KV capture and restore)")

    async def RestoreKv(self, request, context):
        raise Unimplemented("RestoreKv is not implemented yet (issue #19, KV capture and restore)")

    async def GetStageInfo(self, request, context):
        info = stage_pb2.GetStageInfoResponse()
        info.CopyFrom(self._info)
        engine = self._node.engine
        info.live_sessions = len(engine.sessions)
        info.kv_backend = engine.kv_backend
        if engine.kv_backend == "paged":
            usage = engine.shard.usage()
            info.kv_cache_budget_bytes = usage.budget_bytes
            info.kv_cache_used_bytes = usage.bytes_used
            info.kv_block_tokens = usage.block_tokens
        return info
