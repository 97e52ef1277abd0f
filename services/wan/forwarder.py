"""User-space TCP forwarder that adds one-way latency: netem's job, which this kernel lacks.

``python -m pipeshard.services.wan.forwarder --delay-ms 50 LISTEN=UPSTREAM ...`` serves every route in one
process (so forwarding never shares a GIL with the benchmark). Each accepted connection gets its
own upstream connection; in each direction one task reads chunks into a :class:`DelayQueue` and
one task writes each chunk out ``delay`` after it arrived: order kept, many chunks in flight, so
a burst keeps its spacing instead of paying the delay once per chunk.

With ``--control PATH`` each route can also be stalled or reset at run time (faults.py): the
bench and tests break one link between two stages while everything else keeps running.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from pathlib import Path

from pipeshard.services.transport.delay import DelayQueue
from pipeshard.services.wan.faults import LinkFaults, abort, serve_control

CHUNK_BYTES = 64 * 1024
QUEUE_CHUNKS = 1024  # at most 64 MiB held per direction; beyond it the reader waits (backpressure)


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


async def _pump(reader: asyncio.StreamReader, queue: DelayQueue[bytes]) -> None:
    while chunk := await reader.read(CHUNK_BYTES):
        await queue.put(chunk)
    await queue.put(b"")  # end of stream travels with the same delay


async def _release(queue: DelayQueue[bytes], writer: asyncio.StreamWriter, faults: LinkFaults) -> None:
    while chunk := await queue.get():
        await faults.flowing.wait()  # a stalled link holds every byte, the connection stays open
        writer.write(chunk)
        await writer.drain()
    if writer.can_write_eof():
        writer.write_eof()


async def _connect(
    client_r: asyncio.StreamReader,
    client_w: asyncio.StreamWriter,
    upstream: tuple[str, int],
    delay_s: float,
    faults: LinkFaults,
) -> None:
    if faults.resetting:
        abort(client_w)
        return
    try:
        up_r, up_w = await asyncio.open_connection(*upstream)
    except OSError:
        client_w.close()  # the peer sees a refused hop and redials, as it would without us
        return
    faults.connections.update((client_w, up_w))
    try:
        async with asyncio.TaskGroup() as group:
            for reader, writer in ((client_r, up_w), (up_r, client_w)):
                queue: DelayQueue[bytes] = DelayQueue(delay_s, QUEUE_CHUNKS)
                group.create_task(_pump(reader, queue))
                group.create_task(_release(queue, writer, faults))
    except* OSError:
        pass  # a reset on either side ends both directions
    finally:
        faults.connections.difference_update((client_w, up_w))
        for writer in (client_w, up_w):
            writer.close()


async def serve(
    routes: list[tuple[str, str]], delay_s: float, faults: list[LinkFaults] | None = None
) -> list[asyncio.Server]:
    """Listen on every route's address; returns the servers (their sockets give the bound ports).
    ``faults``: one per route (default: links that never fail)."""
    servers = []
    for (listen, upstream), link in zip(routes, faults or [LinkFaults() for _ in routes], strict=True):
        target = split_address(upstream)

        async def handle(r, w, _target=target, _link=link) -> None:
            await _connect(r, w, _target, delay_s, _link)

        servers.append(await asyncio.start_server(handle, *split_address(listen)))
    return servers


def bound_address(server: asyncio.Server) -> str:
    return ":".join(map(str, server.sockets[0].getsockname()[:2]))


async def _main(routes: list[tuple[str, str]], delay_s: float, control: Path | None) -> None:
    faults = [LinkFaults() for _ in routes]
    servers = await serve(routes, delay_s, faults)
    bound = [bound_address(s) for s in servers]
    for address, (_, upstream) in zip(bound, routes, strict=True):
        print(f"route {address} -> {upstream}, {delay_s * 1000:g} ms one way", flush=True)
    if control is not None:
        await serve_control(control, dict(zip(bound, faults, strict=True)))
        print(f"faults controlled at {control}", flush=True)
    print(f"forwarder listening on {bound[0]}", flush=True)  # the launcher waits for this line
    await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeshard.services.wan.forwarder", description=__doc__)
    parser.add_argument("--delay-ms", type=float, required=True, help="one-way delay in each direction")
    parser.add_argument(
        "--control", type=Path, default=None, help="Unix socket taking fault commands (faults.py)"
    )
    parser.add_argument("routes", nargs="+", metavar="LISTEN=UPSTREAM", help="host:port=host:port")
    args = parser.parse_args(argv)
    routes = [tuple(r.split("=", 1)) for r in args.routes]
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_main(routes, args.delay_ms / 1000.0, args.control))
    return 0


if __name__ == "__main__":
    sys.exit(main())
