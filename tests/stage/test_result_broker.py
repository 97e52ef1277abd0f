"""The final stage's result fan-out holds at most max_pending steps' results for a subscriber that lags."""

from __future__ import annotations

import asyncio

import pytest

from pipeshard.errors import ResourceExhausted
from pipeshard.services.stage.results import ResultBroker
from pipeshard.v1 import activation_pb2


def _result(i: int) -> activation_pb2.StepResult:
    return activation_pb2.StepResult(session_id="s", step_id=i)


def test_a_reader_that_keeps_up_gets_every_result_in_order():
    async def run():
        broker = ResultBroker(max_pending=4)
        sub = broker.subscribe("o", "c")
        got = []
        for i in range(20):
            broker.publish([_result(i)], "o")
            got.append((await sub.get())[0].step_id)
        broker.close()
        return got, await sub.get()

    assert asyncio.run(run()) == (list(range(20)), None)


def test_a_stuck_reader_is_disconnected_not_buffered():
    async def run():
        broker = ResultBroker(max_pending=4)
        slow, fast = broker.subscribe("o", "slow"), broker.subscribe("o", "fast")
        for i in range(10):
            broker.publish([_result(i)], "o")
            assert (await fast.get())[0].step_id == i  # the other subscriber is unaffected
        assert slow._queue.qsize() == 4
        with pytest.raises(ResourceExhausted, match="'slow' fell 4 steps' results behind"):
            await slow.get()
        broker.publish([_result(10)], "o")  # no longer subscribed: nothing more is queued for it
        assert slow._queue.qsize() == 4 and (await fast.get())[0].step_id == 10

    asyncio.run(run())
