"""StageService over gRPC: protobuf in, StageNode call, protobuf out."""

from __future__ import annotations

import structlog

from pipeshard.services.stage.node import StageNode
from pipeshard.v1 import stage_pb2, stage_pb2_grpc

log = structlog.get_logger(__name__)


class StageServicer(stage_pb2_grpc.StageServiceServicer):
    def __init__(self, node: StageNode, info: stage_pb2.GetStageInfoResponse):
        self._node = node
        self._info = info

    async def Forward(self, request_iterator, context):
        await context.send_initial_metadata(())  # lets the caller see the stream is up
        async for request in request_iterator:
            error = await self._node.handle(request.frame)
            if error is not None:
                yield stage_pb2.ForwardResponse(
                    session_id=request.frame.session_id, step_id=request.frame.step_id, error=error
                )

    async def Results(self, request, context):
        queue = self._node.results.subscribe(request.subscriber_id)
        await context.send_initial_metadata(())  # lets the subscriber see it is live
        try:
            while (result := await queue.get()) is not None:
                yield stage_pb2.ResultsResponse(result=result)
        finally:
            self._node.results.unsubscribe(request.subscriber_id, queue)

    async def OpenSession(self, request, context):
        self._node.engine.sessions.open(request.session_id)
        return stage_pb2.OpenSessionResponse(max_context=self._node.engine.max_context)

    async def ResetSession(self, request, context):
        self._node.engine.sessions.get(request.session_id).reset()
        return stage_pb2.ResetSessionResponse()

    async def ReleaseSession(self, request, context):
        return stage_pb2.ReleaseSessionResponse(
            released=self._node.engine.sessions.release(request.session_id)
        )

    async def AbortSession(self, request, context):
        log.info("session_aborted", session_id=request.session_id, reason=request.reason)
        return stage_pb2.AbortSessionResponse(aborted=self._node.engine.sessions.release(request.session_id))

    async def GetStageInfo(self, request, context):
        info = stage_pb2.GetStageInfoResponse()
        info.CopyFrom(self._info)
        info.live_sessions = len(self._node.engine.sessions)
        return info
