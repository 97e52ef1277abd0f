"""The delay primitive behind ``--hop-delay-ms`` and the forwarder: netem-like one-way latency."""

from __future__ import annotations

import asyncio
import time

from pipeshard.services.stage.results import ResultBroker
from pipeshard.services.transport.delay import DelayQueue
from pipeshard.services.transport.hop import HopStream
from pipeshard.v1 import activation_pb2

DELAY_S = 0.05
# The machine is shared: allow for a busy event loop (a first item once arrived 36 ms late on an
# idle CI-like run), yet stay under a second delay, so a delay applied twice still fails.
EPS_S = 0.045


async def _collect(queue, n: int) -> list[tuple[int, float]]:
    return [(await queue.get(), time.monotonic()) for _ in range(n)]


def _check(sent: dict[int, float], got: list[tuple[int, float]], n: int) -> None:
    assert [i for i, _ in got] == list(range(n))  # order kept
    for i, at in got:
        assert DELAY_S - 0.002 <= at - sent[i] <= DELAY_S + EPS_S, (i, at - sent[i])
    # many in flight: the whole burst takes one delay plus its own spread, not n delays
    assert got[-1][1] - sent[0] < DELAY_S + n * 0.005 + EPS_S


def test_items_leave_one_delay_after_put_in_order_with_many_in_flight():
    n = 20

    async def run():
        queue: DelayQueue[int] = DelayQueue(DELAY_S)
        consumer = asyncio.create_task(_collect(queue, n))
        sent = {}
        for i in range(n):
            sent[i] = time.monotonic()
            queue.put_nowait(i)
            await asyncio.sleep(0.005)
        return sent, await consumer

    _check(*asyncio.run(run()), n)


def test_awaited_put_stamps_the_hand_over_time():
    async def run():
        queue: DelayQueue[int] = DelayQueue(DELAY_S, maxsize=4)
        t0 = time.monotonic()
        for i in range(4):
            await queue.put(i)
        got = await _collect(queue, 4)
        return t0, got

    t0, got = asyncio.run(run())
    assert [i for i, _ in got] == [0, 1, 2, 3]
    assert got[-1][1] - t0 < DELAY_S + EPS_S


def test_results_are_delayed_at_the_final_stage():
    n = 10

    async def run():
        broker = ResultBroker(DELAY_S)
        queue = broker.subscribe("owner", "coordinator")
        consumer = asyncio.create_task(_collect(queue, n))
        sent = {}
        for i in range(n):
            sent[i] = time.monotonic()
            broker.publish(activation_pb2.StepResult(session_id="s", step_id=i), "owner")
            await asyncio.sleep(0.005)
        return sent, [(result.step_id, at) for result, at in await consumer]

    _check(*asyncio.run(run()), n)


def test_zero_delay_keeps_the_plain_queues():
    async def run():
        hop, delayed = HopStream("127.0.0.1:9"), HopStream("127.0.0.1:9", delay_s=DELAY_S)
        kinds = type(hop._queue), type(delayed._queue), type(ResultBroker().subscribe("o", "c")._queue)
        await hop.close()
        await delayed.close()
        return kinds

    assert asyncio.run(run()) == (asyncio.Queue, DelayQueue, asyncio.Queue)
