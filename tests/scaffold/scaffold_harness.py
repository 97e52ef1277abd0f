"""Test harness: a GrpcServer on its own event loop in a background thread, so plain synchronous
grpc clients can call it (no pytest-asyncio needed), and a stand-in for a future auth interceptor."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Sequence
from typing import Any

import grpc

from pipeshard.errors import PipeshardError
from pipeshard.grpc_server import GrpcServer, ServiceSpec


class ThreadedServer:
    """A :class:`GrpcServer` built and started inside a private event loop thread."""

    def __init__(self, services: Sequence[ServiceSpec], **kwargs: Any):
        self._services = services
        self._kwargs = kwargs
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="grpc-test-loop", daemon=True)
        self.server: GrpcServer | None = None

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 10) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> GrpcServer:
        self._thread.start()

        async def build() -> GrpcServer:
            server = GrpcServer(self._services, **self._kwargs)
            await server.start()
            return server

        self.server = self.run(build())
        return self.server

    def stop(self) -> None:
        if self.server is not None:
            self.run(self.server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.loop.close()


class Unauthenticated(PipeshardError):
    code = "UNAUTHENTICATED"


class DenyInterceptor(grpc.aio.ServerInterceptor):
    """Stands in for a future auth interceptor: refuses calls carrying ``x-deny`` metadata."""

    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        if any(key == "x-deny" for key, _ in details.invocation_metadata or ()):
            raise Unauthenticated("`authorization` token missing")
        return await continuation(details)
