"""Which stages are reachable, learned from a grpc.health.v1 Watch stream held open to each.

A stage that dies breaks its Watch stream at once (the socket closes), so the ring fails the
affected steps within moments instead of waiting out the step deadline. A stage that drains
reports NOT_SERVING on the same stream. A frozen stage keeps its socket open, so the ring
reports it via :meth:`StageWatch.mark_down` after a step deadline; the watch then probes it
until it answers again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

log = structlog.get_logger(__name__)

_SERVING = health_pb2.HealthCheckResponse.SERVING


class StageWatch:
    """Reachability of the stages on ``channels`` (``index`` = stage index of each channel)."""

    def __init__(
        self,
        channels: dict[int, grpc.aio.Channel],
        addresses: list[str],
        on_change: Callable[[int, bool, str], None],
        *,
        probe_interval_s: float = 1.0,
        probe_timeout_s: float = 2.0,
    ):
        self._stubs = {i: health_pb2_grpc.HealthStub(c) for i, c in channels.items()}
        self._addresses = addresses
        self._on_change = on_change
        self._probe_interval_s = probe_interval_s
        self._probe_timeout_s = probe_timeout_s
        self.down: dict[int, str] = {}  # stage index -> why it is unreachable
        self._tasks: list[asyncio.Task] = []
        self._probes: dict[int, asyncio.Task] = {}

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._watch(i), name=f"watch-stage{i}") for i in sorted(self._stubs)
        ]

    async def close(self) -> None:
        tasks = [*self._tasks, *self._probes.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def describe(self, index: int) -> str:
        return f"stage {index} at {self._addresses[index]} is unreachable ({self.down[index]})"

    def mark_down(self, index: int, reason: str) -> None:
        """Records a stage as unreachable; a Watch stream that stays open cannot tell (frozen)."""
        if index not in self._stubs:
            return  # stage 0 hosted in this process
        self._set(index, False, reason)
        if index not in self._probes:
            self._probes[index] = asyncio.create_task(self._probe_until_up(index), name=f"probe-stage{index}")

    def _set(self, index: int, up: bool, reason: str) -> None:
        was_up = index not in self.down
        if up:
            self.down.pop(index, None)
        else:
            self.down[index] = reason
        if up != was_up:
            log.warning(
                "stage_reachability", stage=index, address=self._addresses[index], up=up, reason=reason
            )
            self._on_change(index, up, reason)

    async def _watch(self, index: int) -> None:
        stub = self._stubs[index]
        while True:
            reason = "health stream ended"
            call = stub.Watch(health_pb2.HealthCheckRequest(service=""), wait_for_ready=True)
            try:
                async for response in call:
                    serving = response.status == _SERVING
                    if serving and index in self._probes:
                        continue  # frozen-then-thawed is confirmed by the probe, not the stream
                    self._set(index, serving, "serving" if serving else "not serving (draining)")
            except grpc.aio.AioRpcError as exc:
                reason = f"connection lost: {exc.code().name}"
            finally:
                call.cancel()
            self._set(index, False, reason)
            await asyncio.sleep(0.2)

    async def _probe_until_up(self, index: int) -> None:
        try:
            while True:
                await asyncio.sleep(self._probe_interval_s)
                try:
                    response = await self._stubs[index].Check(
                        health_pb2.HealthCheckRequest(service=""), timeout=self._probe_timeout_s
                    )
                except grpc.aio.AioRpcError:
                    continue
                if response.status == _SERVING:
                    self._set(index, True, "answers again")
                    return
        finally:
            self._probes.pop(index, None)
