"""Fixtures: a scaffold GrpcServer on port 0 (see scaffold_harness.ThreadedServer) and its clients."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import grpc
import pytest
import structlog
from scaffold_harness import DenyInterceptor, ThreadedServer
from scaffold_servicer import ScaffoldStage

from pipeshard.grpc_server import GrpcServer
from pipeshard.v1 import stage_pb2_grpc


@pytest.fixture(scope="session")
def scaffold_servicer() -> ScaffoldStage:
    return ScaffoldStage()


@pytest.fixture(scope="session")
def scaffold_server(scaffold_servicer: ScaffoldStage) -> Iterator[GrpcServer]:
    threaded = ThreadedServer(
        [(stage_pb2_grpc.add_StageServiceServicer_to_server, scaffold_servicer)],
        port=0,
        interceptors=[DenyInterceptor()],
    )
    server = threaded.start()
    try:
        yield server
    finally:
        threaded.stop()


@pytest.fixture(scope="session")
def channel(scaffold_server: GrpcServer) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(scaffold_server.address) as ch:
        grpc.channel_ready_future(ch).result(timeout=5)
        yield ch


@pytest.fixture
def stage(channel: grpc.Channel) -> stage_pb2_grpc.StageServiceStub:
    return stage_pb2_grpc.StageServiceStub(channel)


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """Undoes configure_logging() after a test so later tests see the default setup."""
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    yield
    structlog.reset_defaults()
    structlog.contextvars.clear_contextvars()
    for handler in list(root.handlers):
        if handler not in handlers:
            root.removeHandler(handler)
    root.setLevel(level)
