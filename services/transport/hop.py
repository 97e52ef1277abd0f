"""A persistent Forward stream to the next hop, re-opened whenever it breaks.

Frames go into a queue; one task keeps a stream open (``wait_for_ready`` lets gRPC dial
with backoff until the hop is up, so start order does not matter) and feeds it from the
queue. A frame lost with a broken stream is not resent: the coordinator's step deadline
notices, names the stage and releases the session.

With ``delay_s`` > 0 (``--hop-delay-ms``, the in-process WAN emulation) the queue is a
:class:`DelayQueue`: each frame leaves ``delay_s`` after ``send``, in order, many in flight.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import grpc
import structlog

from pipeshard.services.transport.channels import open_channel
from pipeshard.services.transport.delay import DelayQueue
from pipeshard.v1 import activation_pb2, stage_pb2, stage_pb2_grpc

log = structlog.get_logger(__name__)


class HopStream:
    """Sends activation frames to ``address`` over one long-lived bidirectional stream."""

    def __init__(
        self,
        address: str,
        *,
        on_error: Callable[[stage_pb2.ForwardResponse], None] | None = None,
        queue_size: int = 1024,
        delay_s: float = 0.0,
    ):
        self.address = address
        self._on_error = on_error
        self._queue: asyncio.Queue | DelayQueue = (
            DelayQueue(delay_s, queue_size) if delay_s > 0 else asyncio.Queue(maxsize=queue_size)
        )
        self._channel = open_channel(address)
        self._stub = stage_pb2_grpc.StageServiceStub(self._channel)
        self._task: asyncio.Task | None = None
        self.connected = asyncio.Event()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"hop->{self.address}")

    async def send(self, frame: activation_pb2.ActivationFrame) -> None:
        self.start()
        await self._queue.put(frame)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._channel.close()

    async def _requests(self) -> AsyncIterator[stage_pb2.ForwardRequest]:
        while True:
            frame = await self._queue.get()
            yield stage_pb2.ForwardRequest(frame=frame)

    async def _run(self) -> None:
        while True:
            call = self._stub.Forward(self._requests(), wait_for_ready=True)
            try:
                await call.wait_for_connection()
                self.connected.set()
                log.info("hop_connected", address=self.address)
                async for response in call:
                    if response.HasField("error") and self._on_error is not None:
                        self._on_error(response)
            except grpc.aio.AioRpcError as exc:
                log.warning(
                    "hop_stream_broken", address=self.address, code=exc.code().name, details=exc.details()
                )
            finally:
                self.connected.clear()
                call.cancel()
            await asyncio.sleep(0.2)
