"""Fan-out of the final stage's results to subscribed coordinators (the ring's return path).

A subscription belongs to an owner (pipeshard.ownership) and receives only the results of that
owner's sessions. Every stage accepts subscriptions: on a non-final stage one carries no results
but is the owner's lease, so the stage can release an owner's sessions soon after its last
subscription closes (see StageNode.start_reaper).

A step's results are published together, as one item: the subscription's stream sends them in
one message (one write and one read per step, not per row). Each subscription's queue is
bounded: a subscriber that falls ``max_pending`` steps behind is disconnected (its stream ends
with RESOURCE_EXHAUSTED) rather than buffered without limit.

With ``delay_s`` > 0 (the final stage's ``--hop-delay-ms``) each subscription is a
:class:`DelayQueue`, so results reach the coordinator one emulated hop late: the return leg is
delayed where it is sent, like every other hop.
"""

from __future__ import annotations

import asyncio

import structlog

from pipeshard.errors import ResourceExhausted
from pipeshard.services.transport.delay import DelayQueue
from pipeshard.v1 import activation_pb2

log = structlog.get_logger(__name__)


class Subscription:
    """One subscriber's queue of steps' results; ``None`` ends it, an overflow ends it with an error."""

    def __init__(self, subscriber_id: str, delay_s: float, max_pending: int):
        self.subscriber_id = subscriber_id
        self.max_pending = max_pending
        self._queue: asyncio.Queue | DelayQueue = (
            DelayQueue(delay_s, max_pending) if delay_s > 0 else asyncio.Queue(max_pending)
        )
        self._overflowed = False

    def put(self, item: list[activation_pb2.StepResult] | None) -> bool:
        """False when the subscriber is too far behind (it is then ended, see :meth:`get`)."""
        try:
            self._queue.put_nowait(item)
        except asyncio.QueueFull:
            self._overflowed = True
            return False
        return True

    async def get(self) -> list[activation_pb2.StepResult] | None:
        # A full queue means the reader is stuck: the flag is seen at its next read, at the latest.
        if self._overflowed:
            raise self._overflow_error()
        return await self._queue.get()

    def _overflow_error(self) -> ResourceExhausted:
        return ResourceExhausted(
            f"results subscriber {self.subscriber_id!r} fell {self.max_pending} steps' results behind and "
            "was disconnected; read faster and subscribe again"
        )


MAX_SUBSCRIPTIONS_PER_OWNER = 16  # a coordinator holds one per lane it runs on this stage
MAX_SUBSCRIPTIONS = 256


class ResultBroker:
    def __init__(
        self,
        delay_s: float = 0.0,
        max_pending: int = 4096,
        *,
        max_per_owner: int = MAX_SUBSCRIPTIONS_PER_OWNER,
        max_total: int = MAX_SUBSCRIPTIONS,
    ) -> None:
        self._delay_s = delay_s
        self._max_pending = max_pending
        self._max_per_owner = max_per_owner
        self._max_total = max_total
        self._subscriptions: dict[tuple[str, str], Subscription] = {}

    def subscribe(self, owner: str, subscriber_id: str) -> Subscription:
        """A new subscription replaces the owner's older one with the same id (a reconnecting
        coordinator); another owner's subscriptions are untouched whatever their ids. Each
        subscription holds a queue: an owner and the stage have a bounded number."""
        if (owner, subscriber_id) not in self._subscriptions:
            held = sum(1 for o, _ in self._subscriptions if o == owner)
            if held >= self._max_per_owner:
                raise ResourceExhausted(
                    f"results subscriptions: this owner holds {held}, the max_subscriptions_per_owner"
                )
            if len(self._subscriptions) >= self._max_total:
                raise ResourceExhausted(
                    f"results subscriptions: the stage holds {len(self._subscriptions)}, "
                    "its max_subscriptions"
                )
        subscription = Subscription(subscriber_id, self._delay_s, self._max_pending)
        self._subscriptions[(owner, subscriber_id)] = subscription
        return subscription

    def unsubscribe(self, owner: str, subscriber_id: str, subscription: Subscription) -> None:
        if self._subscriptions.get((owner, subscriber_id)) is subscription:
            del self._subscriptions[(owner, subscriber_id)]

    def subscribed(self, owner: str) -> bool:
        return any(o == owner for o, _ in self._subscriptions)

    def close(self) -> None:
        """Ends every subscription (a None tells the stream to finish)."""
        for subscription in self._subscriptions.values():
            subscription.put(None)

    def publish(self, results: list[activation_pb2.StepResult], owner: str) -> None:
        """Deliver a step's results to ``owner``'s subscriptions only; one too far behind is
        disconnected."""
        mine = [(key, s) for key, s in self._subscriptions.items() if key[0] == owner]
        if not mine:
            first = results[0]
            log.warning(
                "result_dropped_no_subscriber",
                session_id=first.session_id,
                step_id=first.step_id,
                rows=len(results),
            )
        for (_, subscriber_id), subscription in mine:
            if not subscription.put(results):
                log.warning("results_subscriber_too_slow", subscriber_id=subscriber_id)
                self.unsubscribe(owner, subscriber_id, subscription)
