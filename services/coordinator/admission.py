"""Admission control: at most ``capacity`` generations run; a bounded queue waits for a slot.

Beyond the queue a request is refused at once with RESOURCE_EXHAUSTED; a queued request whose
deadline passes leaves the queue with DEADLINE_EXCEEDED. Slots are handed out in arrival order.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from pipeshard.errors import DeadlineExceeded, ResourceExhausted


class Admission:
    def __init__(self, capacity: int, max_queue: int):
        if capacity < 1 or max_queue < 0:
            raise ValueError("capacity must be >= 1 and max_queue >= 0")
        self.capacity = capacity
        self.max_queue = max_queue
        self._slots = asyncio.Semaphore(capacity)
        self.running = 0
        self.queued = 0

    @contextlib.asynccontextmanager
    async def slot(self, timeout_s: float | None = None) -> AsyncIterator[None]:
        """Hold one generation slot for the body; waits in the queue up to ``timeout_s``."""
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
