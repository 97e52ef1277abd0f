"""Fan-out of the final stage's results to subscribed coordinators (the ring's return path)."""

from __future__ import annotations

import asyncio

import structlog

from pipeshard.v1 import activation_pb2

log = structlog.get_logger(__name__)


class ResultBroker:
    def __init__(self) -> None:
        self._queues: dict[str, asyncio.Queue] = {}

    def subscribe(self, subscriber_id: str) -> asyncio.Queue:
        """A new subscription replaces an older one with the same id (a reconnecting coordinator)."""
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[subscriber_id] = queue
        return queue

    def unsubscribe(self, subscriber_id: str, queue: asyncio.Queue) -> None:
        if self._queues.get(subscriber_id) is queue:
            del self._queues[subscriber_id]

    def close(self) -> None:
        """Ends every subscription (a None tells the stream to finish)."""
        for queue in self._queues.values():
            queue.put_nowait(None)

    def publish(self, result: activation_pb2.StepResult) -> None:
        if not self._queues:
            log.warning("result_dropped_no_subscriber", session_id=result.session_id, step_id=result.step_id)
        for queue in self._queues.values():
            queue.put_nowait(result)
