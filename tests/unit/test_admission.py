"""Admission: capacity, a bounded queue in arrival order, RESOURCE_EXHAUSTED beyond it, deadlines."""

from __future__ import annotations

import asyncio

import pytest

from pipeshard.errors import DeadlineExceeded, ResourceExhausted
from pipeshard.services.coordinator.admission import Admission


def test_capacity_queue_and_rejection():
    async def scenario():
        admission = Admission(capacity=1, max_queue=1)
        order: list[str] = []
        release = asyncio.Event()

        async def request(name: str):
            async with admission.slot(timeout_s=5):
                order.append(name)
                await release.wait()

        first = asyncio.create_task(request("first"))
        await asyncio.sleep(0.01)
        second = asyncio.create_task(request("second"))
        await asyncio.sleep(0.01)
        assert (admission.running, admission.queued) == (1, 1)
        with pytest.raises(ResourceExhausted, match="capacity 1"):
            async with admission.slot():
                pass
        release.set()
        await asyncio.gather(first, second)
        assert order == ["first", "second"]
        assert (admission.running, admission.queued) == (0, 0)

    asyncio.run(scenario())


def test_deadline_while_queued():
    async def scenario():
        admission = Admission(capacity=1, max_queue=4)
        hold = asyncio.Event()

        async def holder():
            async with admission.slot():
                await hold.wait()

        task = asyncio.create_task(holder())
        await asyncio.sleep(0.01)
        with pytest.raises(DeadlineExceeded, match="queue"):
            async with admission.slot(timeout_s=0.05):
                pass
        assert admission.queued == 0
        hold.set()
        await task
        async with admission.slot(timeout_s=0.05):
            assert admission.running == 1

    asyncio.run(scenario())
