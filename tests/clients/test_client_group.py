"""The client side of a coordinator group (clients/group.py) against scripted coordinators: a
stream whose coordinator goes away continues on another after the tokens already streamed, and
requests go to the least busy one."""

from __future__ import annotations

import asyncio
from concurrent import futures

import grpc
import pytest

from pipeshard.clients.client import AsyncPipeshardClient, PipeshardClient
from pipeshard.clients.group import Coordinators, parse_addresses
from pipeshard.v1 import coordinator_pb2, coordinator_pb2_grpc


class Scripted(coordinator_pb2_grpc.CoordinatorServiceServicer):
    """Streams tokens 10, 11, ... after the resumed ones, one a chunk, up to max_tokens in all;
    ``fail_after`` tokens (of its own) then UNAVAILABLE, or a shutdown's CANCELLED summary."""

    def __init__(self, fail_after: int | None = None, shutdown: bool = False):
        self.requests: list[coordinator_pb2.GenerateRequest] = []
        self.fail_after = fail_after
        self.shutdown = shutdown

    def Generate(self, request, context):
        self.requests.append(request)
        done = list(request.resume_token_ids)
        for n, i in enumerate(range(len(done), request.params.max_tokens)):
            if n == self.fail_after:
                if self.shutdown:
                    yield _summary(coordinator_pb2.FINISH_REASON_CANCELLED, done)
                    return
                context.abort(grpc.StatusCode.UNAVAILABLE, "Socket closed")
            done.append(10 + i)
            yield coordinator_pb2.GenerateResponse(
                chunk=coordinator_pb2.TokenChunk(text=f"<{10 + i}>", token_ids=[10 + i])
            )
        yield _summary(coordinator_pb2.FINISH_REASON_LENGTH, done)


def _summary(reason, done: list[int]) -> coordinator_pb2.GenerateResponse:
    return coordinator_pb2.GenerateResponse(
        summary=coordinator_pb2.GenerateSummary(finish_reason=reason, completion_tokens=len(done))
    )


@pytest.fixture
def serve():
    servers = []

    def start(servicer: Scripted) -> str:
        server = grpc.server(futures.ThreadPoolExecutor(4))
        coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for server in servers:
        server.stop(None)


@pytest.mark.parametrize("shutdown", [False, True])
def test_a_stream_continues_on_the_other_coordinator_after_the_tokens_it_had(serve, shutdown):
    dying, other = Scripted(fail_after=3, shutdown=shutdown), Scripted()  # a fresh group starts at the first
    addresses = [serve(dying), serve(other)]
    with PipeshardClient(addresses) as client:
        result = client.generate("hi", max_tokens=8, seed=5)
    assert result.token_ids == list(range(10, 18)) and result.finish_reason == "length"
    assert [list(r.resume_token_ids) for r in other.requests] == [[10, 11, 12]]
    assert other.requests[0].params.seed == 5 and other.requests[0].messages[0].content == "hi"


def test_the_async_client_resumes_too(serve):
    dying, other = Scripted(fail_after=2), Scripted()
    addresses = [serve(dying), serve(other)]

    async def run():
        async with AsyncPipeshardClient(",".join(addresses)) as client:
            return await client.generate("hi", max_tokens=6)

    assert asyncio.run(run()).token_ids == list(range(10, 16))
    assert [list(r.resume_token_ids) for r in other.requests] == [[10, 11]]


def test_when_every_coordinator_fails_the_error_is_the_callers(serve):
    addresses = [serve(Scripted(fail_after=0)), serve(Scripted(fail_after=0))]
    with PipeshardClient(addresses) as client, pytest.raises(grpc.RpcError) as info:
        client.generate("hi", max_tokens=4)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_other_errors_are_not_retried(serve):
    class Refusing(Scripted):
        def Generate(self, request, context):
            self.requests.append(request)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "`max_tokens` bad")
            yield  # pragma: no cover

    first, second = Refusing(), Refusing()
    with PipeshardClient([serve(first), serve(second)]) as client, pytest.raises(grpc.RpcError) as info:
        client.generate("hi", max_tokens=4)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(first.requests) + len(second.requests) == 1


def test_requests_go_to_the_coordinator_with_the_fewest_outstanding():
    group = Coordinators(["a", "b", "c"])
    taken = [group.take() for _ in range(3)]
    assert sorted(taken) == [0, 1, 2]
    group.give(taken[1])
    assert group.take() == taken[1]
    assert group.take(avoid=0) != 0


def test_addresses_are_parsed_from_a_list_or_commas():
    assert parse_addresses("a:1, b:2") == ["a:1", "b:2"] == parse_addresses(["a:1", "b:2"])
    with pytest.raises(ValueError, match="no coordinator"):
        parse_addresses(" , ")
