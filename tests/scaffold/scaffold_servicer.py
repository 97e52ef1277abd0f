"""A tiny StageService used to exercise the scaffold (no model): every error path is reachable by id."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import structlog

from pipeshard.errors import InvalidArgument, NotFound
from pipeshard.v1 import activation_pb2, stage_pb2, stage_pb2_grpc

log = structlog.get_logger("scaffold.servicer")


def fail_for(field: str, value: str) -> None:
    """Raises the failure a test asked for by putting a magic value in a request field."""
    if value == "":
        raise InvalidArgument(field, "must not be empty")
    if value == "missing":
        raise NotFound(f"session {value!r} not found")
    if value == "boom":
        raise RuntimeError("secret internal detail")
    if value == "slow":
        raise TimeoutError("waited too long for the next hop")


class ScaffoldStage(stage_pb2_grpc.StageServiceServicer):
    def __init__(self, info_delay: float = 0.0, on_info: Callable[[], None] | None = None):
        self.info_delay = info_delay
        self.on_info = on_info
        self.closed_streams: list[str] = []  # subscriber ids whose Results generator has been closed

    async def GetStageInfo(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        if self.on_info is not None:
            self.on_info()
        if self.info_delay:
            await asyncio.sleep(self.info_delay)
        return stage_pb2.GetStageInfoResponse(stage_index=0, num_stages=2, layer_start=0, layer_end=15)

    async def OpenSession(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        if request.session_id == "abort":
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "aborted by the servicer")
        fail_for("session_id", request.session_id)
        log.info("session opened", session_id=request.session_id)
        return stage_pb2.OpenSessionResponse(max_context=2048)

    def Results(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        # Subscriber ids starting with "write-" use the context.write() style, the rest an async generator.
        if request.subscriber_id.startswith("write-"):
            return self._results_written(request.subscriber_id.removeprefix("write-"), context)
        return self._results_yielded(request.subscriber_id)

    async def _results_yielded(self, subscriber: str) -> AsyncIterator[Any]:
        try:
            yield _result(1)
            if subscriber == "hang":
                await asyncio.sleep(60)  # until the client cancels
            fail_for("subscriber_id", subscriber)
            yield _result(2)
        finally:
            self.closed_streams.append(subscriber)

    async def _results_written(self, subscriber: str, context: grpc.aio.ServicerContext) -> None:
        await context.write(_result(1))
        fail_for("subscriber_id", subscriber)
        await context.write(_result(2))

    async def Forward(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async for request in request_iterator:
            frame = request.frame
            fail_for("frame.session_id", frame.session_id)
            yield stage_pb2.ForwardResponse(session_id=frame.session_id, step_id=frame.step_id)


def _result(step: int) -> Any:
    return stage_pb2.ResultsResponse(result=activation_pb2.StepResult(session_id="s", step_id=step))
