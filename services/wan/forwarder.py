"""User-space TCP forwarder that adds one-way latency: netem's job, which this kernel lacks.

``python -m pipeshard.services.wan.forwarder --delay-ms 50 LISTEN=UPSTREAM ...`` serves every route in one
process (so forwarding never shares a GIL with the benchmark). Each accepted connection gets its
own upstream connection; in each direction one task reads chunks into a :class:`DelayQueue` and
one task writes each chunk out ``delay`` after it arrived: order kept, many chunks in flight, so
a burst keeps its spacing instead of paying the delay once per chunk.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys

from pipeshard.services.transport.delay import DelayQueue

CHUNK_BYTES = 64 * 1024
QUEUE_CHUNKS = 1024  # at most 64 MiB held per direction; beyond it the reader waits (backpressure)


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


async def _pump(reader: asyncio.StreamReader, queue: DelayQueue[bytes]) -> None:
    while chunk := await reader.read(CHUNK_BYTES):
        await queue.put(chunk)
    await queue.put(b"")  # end of stream travels with the same delay


async def _release(queue: DelayQueue[bytes], writer: asyncio.StreamWriter) -> None:
    while chunk := await queue.get():
        writer.write(chunk)
        await writer.drain()
    if writer.can_write_eof():
        writer.write_eof()


async def _connect(
    client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter, upstream: tuple[str, int], delay_s: float
) -> None:
    try:
        up_r, up_w = await asyncio.open_connection(*upstream)
    except OSError:
        client_w.close()  # the peer sees a refused hop and redials, as it would without us
        return
    try:
        async with asyncio.TaskGroup() as group:
            for reader, writer in ((client_r, up_w), (up_r, client_w)):
                queue: DelayQueue[bytes] = DelayQueue(delay_s, QUEUE_CHUNKS)
                group.create_task(_pump(reader, queue))
                group.create_task(_release(queue, writer))
    except* OSError:
        pass  # a reset on either side ends both directions
    finally:
        for writer in (client_w, up_w):
            writer.close()


async def serve(routes: list[tuple[str, str]], delay_s: float) -> list[asyncio.Server]:
    """Listen on every route's address; returns the servers (their sockets give the bound ports)."""
    servers = []
    for listen, upstream in routes:
        target = split_address(upstream)

        async def handle(r, w, _target=target) -> None:
            await _connect(r, w, _target, delay_s)

        servers.append(await asyncio.start_server(handle, *split_address(listen)))
    return servers


async def _main(routes: list[tuple[str, str]], delay_s: float) -> None:
    servers = await serve(routes, delay_s)
    bound = [":".join(map(str, s.sockets[0].getsockname()[:2])) for s in servers]
    for address, (_, upstream) in zip(bound, routes, strict=True):
        print(f"route {address} -> {upstream}, {delay_s * 1000:g} ms one way", flush=True)
    print(f"forwarder listening on {bound[0]}", flush=True)  # the launcher waits for this line
    await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeshard.services.wan.forwarder", description=__doc__)
    parser.add_argument("--delay-ms", type=float, required=True, help="one-way delay in each direction")
    parser.add_argument("routes", nargs="+", metavar="LISTEN=UPSTREAM", help="host:port=host:port")
    args = parser.parse_args(argv)
    routes = [tuple(r.split("=", 1)) for r in args.routes]
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_main(routes, args.delay_ms / 1000.0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
