"""Fan-out of the final stage's results to subscribed coordinators (the ring's return path).

With ``delay_s`` > 0 (the final stage's ``--hop-delay-ms``) each subscription is a
:class:`DelayQueue`, so results reach the coordinator one emulated hop late: the return leg is
delayed where it is sent, like every other hop.
"""

from __future__ import annotations

import asyncio

import structlog

from pipeshard.services.transport.delay import DelayQueue
from pipeshard.v1 import activation_pb2

log = structlog.get_logger(__name__)


class ResultBroker:
    def __init__(self, delay_s: float = 0.0) -> None:
        self._delay_s = delay_s
        self._queues: dict[str, asyncio.Queue | DelayQueue] = {}

    def subscribe(self, subscriber_id: str) -> asyncio.Queue | DelayQueue:
        """A new subscription replaces an older one with the same id (a reconnecting coordinator)."""
        queue = DelayQueue(self._delay_s) if self._delay_s > 0 else asyncio.Queue()
        self._queues[subscriber_id] = queue
        return queue

    def unsubscribe(self, subscriber_id: str, queue: asyncio.Queue | DelayQueue) -> None:
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
