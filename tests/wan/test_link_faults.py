"""Each link fault of the forwarder measured on loopback sockets: it does what faults.py claims.

stall: no byte moves either way, the connection stays open (no EOF, no error), a connection made
meanwhile carries nothing either; on heal everything held arrives intact and in order. reset: an
open connection ends in ECONNRESET and new ones are reset until the fault's time is over. The
control socket refuses a malformed command by name and leaves the link as it was.
"""

from __future__ import annotations

import asyncio
import os

import pytest

from pipeshard.services.wan.faults import LinkFaults, apply, command, serve_control
from pipeshard.services.wan.forwarder import bound_address, serve

HELD_S = 0.5  # how long a stalled link is watched for a byte that must not come


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()
    writer.close()


async def _link() -> tuple[str, LinkFaults, list[asyncio.Server]]:
    """An echo server behind a forwarder route with fault control; returns (port, faults, servers)."""
    target = await asyncio.start_server(_echo, "127.0.0.1", 0)
    faults = LinkFaults()
    (forwarder,) = await serve([("127.0.0.1:0", bound_address(target))], 0.0, [faults])
    return bound_address(forwarder).rpartition(":")[2], faults, [target, forwarder]


async def _silent(reader: asyncio.StreamReader) -> bool:
    """True if nothing (no byte, no EOF, no error) comes within HELD_S."""
    try:
        await asyncio.wait_for(reader.read(1), HELD_S)
    except TimeoutError:
        return True
    return False


def test_stall_holds_every_byte_keeps_the_connection_and_releases_it_intact_on_heal():
    async def run() -> None:
        port, faults, servers = await _link()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"before")
        assert await reader.readexactly(6) == b"before"
        faults.stall(0)
        payload = os.urandom(300_000)  # several chunks of the forwarder's
        writer.write(payload)
        assert await _silent(reader), "a stalled link let a byte through"
        late_r, late_w = await asyncio.open_connection("127.0.0.1", port)  # accepted, then held
        late_w.write(b"late")
        assert await _silent(late_r)
        assert not writer.is_closing() and not reader.at_eof()
        faults.heal()
        assert await asyncio.wait_for(reader.readexactly(len(payload)), 30) == payload
        assert await asyncio.wait_for(late_r.readexactly(4), 30) == b"late"
        for w in (writer, late_w):
            w.close()
        for server in servers:
            server.close()

    asyncio.run(run())


def test_a_timed_stall_heals_by_itself():
    async def run() -> None:
        port, faults, servers = await _link()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        faults.stall(HELD_S * 2)
        writer.write(b"x")
        assert await _silent(reader)
        assert await asyncio.wait_for(reader.readexactly(1), 30) == b"x"
        writer.close()
        for server in servers:
            server.close()

    asyncio.run(run())


def test_reset_aborts_open_connections_and_new_ones_until_its_time_is_over():
    async def run() -> None:
        port, faults, servers = await _link()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"ok")
        assert await reader.readexactly(2) == b"ok"
        faults.reset(0)
        with pytest.raises(ConnectionResetError):
            await asyncio.wait_for(reader.read(1), 30)
        new_r, new_w = await asyncio.open_connection("127.0.0.1", port)
        with pytest.raises(ConnectionResetError):
            await asyncio.wait_for(new_r.read(1), 30)
        faults.heal()
        again_r, again_w = await asyncio.open_connection("127.0.0.1", port)
        again_w.write(b"back")
        assert await asyncio.wait_for(again_r.readexactly(4), 30) == b"back"
        for w in (writer, new_w, again_w):
            w.close()
        for server in servers:
            server.close()

    asyncio.run(run())


def test_the_control_socket_switches_a_route_and_refuses_bad_commands_by_name(tmp_path):
    async def run() -> None:
        port, faults, servers = await _link()
        sock = tmp_path / "link.sock"
        control = await serve_control(sock, {f"127.0.0.1:{port}": faults})
        await asyncio.to_thread(command, sock, f"stall 0 127.0.0.1:{port}")
        assert not faults.flowing.is_set()
        for bad, named in (
            ("shake 1", "command"),
            ("stall", "SECONDS"),
            ("stall -1", "SECONDS"),
            ("reset 1 10.0.0.1:1", "route"),
        ):
            with pytest.raises(RuntimeError, match=named):
                await asyncio.to_thread(command, sock, bad)
        assert not faults.flowing.is_set() and not faults.resetting  # left as it was
        await asyncio.to_thread(command, sock, "heal")
        assert faults.flowing.is_set()
        control.close()
        for server in servers:
            server.close()

    asyncio.run(run())


def test_apply_names_every_route_when_none_is_given():
    async def run() -> None:
        links = {"a:1": LinkFaults(), "b:2": LinkFaults()}
        assert apply(links, "stall 0") == "ok"
        assert not any(link.flowing.is_set() for link in links.values())
        assert apply(links, "heal b:2") == "ok"
        assert links["b:2"].flowing.is_set() and not links["a:1"].flowing.is_set()

    asyncio.run(run())
