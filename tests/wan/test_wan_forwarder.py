"""The delay forwarder on loopback: one-way delay each way, many chunks in flight, bytes intact."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable

from pipeshard.services.wan.forwarder import serve

DELAY_S = 0.05
EPS_S = 0.025  # the machine is shared: allow for a busy event loop


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()
    writer.close()


async def _through_forwarder(
    handler: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
    body: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[object]],
) -> object:
    """Serves ``handler`` on loopback, forwards to it with DELAY_S and runs ``body`` on a client."""
    target = await asyncio.start_server(handler, "127.0.0.1", 0)
    upstream = f"127.0.0.1:{target.sockets[0].getsockname()[1]}"
    (forwarder,) = await serve([("127.0.0.1:0", upstream)], DELAY_S)
    reader, writer = await asyncio.open_connection("127.0.0.1", forwarder.sockets[0].getsockname()[1])
    try:
        return await body(reader, writer)
    finally:
        writer.close()
        forwarder.close()
        target.close()


def test_round_trip_costs_two_delays():
    async def body(reader, writer):
        rtts = []
        for _ in range(5):
            t0 = time.monotonic()
            writer.write(b"ping")
            await reader.readexactly(4)
            rtts.append(time.monotonic() - t0)
        return rtts

    rtts = asyncio.run(_through_forwarder(_echo, body))
    # Every ping pays both delays; the first may also wait for the forwarder's own connection
    # upstream (a quiet CI machine saw 0.21 s there), so the bound above applies from the second.
    assert all(rtt >= 2 * DELAY_S for rtt in rtts), rtts
    assert all(rtt <= 2 * DELAY_S + EPS_S for rtt in rtts[1:]), rtts


def test_spaced_chunks_keep_their_spacing_and_pay_the_delay_once():
    n, gap_s = 20, 0.005
    arrivals: dict[int, float] = {}

    async def run():
        finished = asyncio.Event()

        async def sink(reader, writer):
            buffer = b""
            while data := await reader.read(65536):
                now = time.monotonic()
                *lines, buffer = (buffer + data).split(b"\n")
                arrivals.update((int(line), now) for line in lines)
                if len(arrivals) == n:
                    finished.set()
            writer.close()

        async def body(reader, writer):
            sent = {}
            for i in range(n):
                sent[i] = time.monotonic()
                writer.write(b"%d\n" % i)
                await writer.drain()
                await asyncio.sleep(gap_s)
            await asyncio.wait_for(finished.wait(), 5)
            return sent

        return await _through_forwarder(sink, body)

    sent = asyncio.run(run())
    assert sorted(arrivals) == list(range(n))
    for i in range(n):
        assert DELAY_S - 0.002 <= arrivals[i] - sent[i] <= DELAY_S + EPS_S, (i, arrivals[i] - sent[i])
    assert max(arrivals.values()) - sent[0] < DELAY_S + n * gap_s + EPS_S  # not n delays


def test_bytes_arrive_identical_and_in_order():
    payload = os.urandom(4 * 1024 * 1024)

    async def body(reader, writer):
        async def send():
            for i in range(0, len(payload), 50_000):  # many writes, so many chunks in flight
                writer.write(payload[i : i + 50_000])
                await writer.drain()
            writer.write_eof()

        sender = asyncio.create_task(send())
        echoed = await reader.read(-1)  # until the forwarded end of stream
        await sender
        return echoed

    assert asyncio.run(_through_forwarder(_echo, body)) == payload
