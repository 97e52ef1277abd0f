"""A next-hop stream through a link that stalls: keepalive (1 s, 2 s timeout here) breaks it and
the hop reports itself down; while the link stays stalled the re-dialled call may look connected
but the hop does not report itself up (no acknowledgement crosses); healed, it does."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pipeshard.errors import InvalidArgument
from pipeshard.grpc_server import GrpcServer
from pipeshard.services.transport.channels import channel_options
from pipeshard.services.transport.hop import HopStream
from pipeshard.services.wan.faults import LinkFaults
from pipeshard.services.wan.forwarder import bound_address, serve
from pipeshard.v1 import stage_pb2, stage_pb2_grpc


class _Acks(stage_pb2_grpc.StageServiceServicer):
    """A next stage that only acknowledges what asks for it."""

    async def Forward(self, request_iterator, context: grpc.aio.ServicerContext):
        async for request in request_iterator:
            if request.ack_id:
                yield stage_pb2.ForwardResponse(ack_id=request.ack_id)


async def _until(states: list, value: bool, timeout_s: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not states or states[-1][0] != value:
        assert asyncio.get_running_loop().time() < deadline, states
        await asyncio.sleep(0.05)


def test_a_stalled_hop_reports_down_stays_down_while_stalled_and_up_once_healed(monkeypatch):
    monkeypatch.setenv("PIPESHARD_KEEPALIVE_S", "1")
    monkeypatch.setenv("PIPESHARD_KEEPALIVE_TIMEOUT_S", "2")

    async def run() -> None:
        server = GrpcServer([(stage_pb2_grpc.add_StageServiceServicer_to_server, _Acks())], port=0)
        await server.start()
        faults = LinkFaults()
        (forwarder,) = await serve([("127.0.0.1:0", server.address)], 0.0, [faults])
        hop = HopStream(bound_address(forwarder))
        states: list[tuple[bool, str]] = []
        hop.on_state = lambda up, reason: states.append((up, reason))
        hop.start()
        await _until(states, True)  # the connect probe acknowledged
        faults.stall(0)
        await _until(states, False)
        assert "UNAVAILABLE" in states[-1][1]
        await asyncio.sleep(4.0)  # two keepalive bounds: re-dialled meanwhile, never acknowledged
        assert states[-1][0] is False and [s for s, _ in states].count(True) == 1
        faults.heal()
        await _until(states, True)
        await hop.close()
        forwarder.close()
        await server.stop(0)

    asyncio.run(run())


def test_keepalive_comes_from_the_environment_and_a_bad_value_is_named(monkeypatch):
    monkeypatch.setenv("PIPESHARD_KEEPALIVE_S", "1.5")
    monkeypatch.delenv("PIPESHARD_KEEPALIVE_TIMEOUT_S", raising=False)
    options = dict(channel_options())
    assert options["grpc.keepalive_time_ms"] == 1500
    assert options["grpc.keepalive_timeout_ms"] == options["grpc.http2.ping_timeout_ms"] == 5000
    for bad in ("soon", "0.1"):
        monkeypatch.setenv("PIPESHARD_KEEPALIVE_TIMEOUT_S", bad)
        with pytest.raises(InvalidArgument, match="PIPESHARD_KEEPALIVE_TIMEOUT_S"):
            channel_options()
