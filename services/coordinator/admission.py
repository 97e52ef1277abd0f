"""Admission control: at most ``capacity`` generations run; a bounded queue waits for a slot.

Beyond the queue a request is refused at once with RESOURCE_EXHAUSTED; a queued request whose
deadline passes leaves the queue with DEADLINE_EXCEEDED. Slots are handed out in arrival order.
One client (pipeshard.auth.client_identity) holds at most ``max_per_client`` of the running and
queued places, so a single client cannot fill the coordinator for everyone else.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from pipeshard.errors import DeadlineExceeded, ResourceExhausted


class Admission:
    def __init__(self, capacity: int, max_queue: int, max_per_client: int | None = None):
        if capacity < 1 or max_queue < 0:
            raise ValueError("capacity must be >= 1 and max_queue >= 0")
        self.capacity = capacity
        self.max_queue = max_queue
        self.max_per_client = capacity + max_queue + 1 if max_per_client is None else max_per_client
        if self.max_per_client < 1:
            raise ValueError("max_per_client must be >= 1")
        self._per_client: dict[str, int] = {}
        self._slots = asyncio.Semaphore(capacity)
        self.running = 0
        self.queued = 0

    @contextlib.asynccontextmanager
    async def slot(self, timeout_s: float | None = None, client: str = "") -> AsyncIterator[None]:
        """Hold one generation slot for the body; waits in the queue up to ``timeout_s``."""
        held = self._per_client.get(client, 0)
        if held >= self.max_per_client:
            raise ResourceExhausted(
                f"this client already has {held} generations running or queued "
                f"(max_per_client {self.max_per_client}); retry later"
            )
        self._per_client[client] = held + 1
        try:
            async with self._slot(timeout_s):
                yield
        finally:
            left = self._per_client[client] - 1
            if left:
                self._per_client[client] = left
            else:
                del self._per_client[client]

    @contextlib.asynccontextmanager
    async def _slot(self, timeout_s: float | None) -> AsyncIterator[None]:
        if self._slots.locked():
            if self.queued >= self.max_queue:
                raise ResourceExhausted(
                    f"coordinator is full: {self.running} generations running (capacity {self.capacity}) "
                    f"and {self.queued} queued (max_queue {self.max_queue}); retry later"
                )
            self.queued += 1
            try:
                await asyncio.wait_for(self._slots.acquire(), timeout_s)
            except TimeoutError:
                raise DeadlineExceeded(
                    f"deadline passed after waiting {timeout_s:.1f} s in the queue"
                ) from None
            finally:
                self.queued -= 1
        else:
            await self._slots.acquire()
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1
            self._slots.release()
