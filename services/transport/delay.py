"""A FIFO whose items come out a fixed delay after they went in: one-way latency, like netem.

Each item is stamped with a monotonic release time when it is put; ``get`` waits for the head's
release time only. Items put 1 ms apart therefore come out 1 ms apart, each ``delay_s`` late,
with any number in flight (sleeping ``delay_s`` per item would serialise them instead). One
consumer per queue: ``get`` holds the head while it sleeps.
"""

from __future__ import annotations

import asyncio
import time
from typing import Generic, TypeVar

T = TypeVar("T")


class DelayQueue(Generic[T]):
    def __init__(self, delay_s: float, maxsize: int = 0):
        self.delay_s = delay_s
        self._queue: asyncio.Queue[tuple[float, T]] = asyncio.Queue(maxsize)

    async def put(self, item: T) -> None:
        # Stamped before waiting for room: the delay counts from the hand-over, as on a wire.
        release = time.monotonic() + self.delay_s
        await self._queue.put((release, item))

    def put_nowait(self, item: T) -> None:
        self._queue.put_nowait((time.monotonic() + self.delay_s, item))

    async def get(self) -> T:
        release, item = await self._queue.get()
        wait = release - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        return item
