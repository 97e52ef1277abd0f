"""Which stages are reachable, learned from a grpc.health.v1 Watch stream held open to each.

A stage that dies breaks its Watch stream at once (the socket closes), so the ring fails the
affected steps within moments instead of waiting out the step deadline. A stage that drains
reports NOT_SERVING on the same stream. A frozen stage keeps its socket open, so the ring
reports it via :meth:`StageWatch.mark_down` after a step deadline; the watch then probes it
until it answers again.

A stage also reports its next hop's stream on the health service ``NEXT_HOP_HEALTH`` (a second
Watch per stage that has a next stage in this ring): when that stream breaks, for a dead next
stage or a link that stalled without closing (found by keepalive, transport/channels.py), the
next stage counts as unreachable *from its predecessor*, so the ring fails its steps and a
replica lane leaves rotation, until the hop reconnects.

With per-hop routing a stage forwards to every replica of the next stage, and reports each of its
next hops on its own service (``next_hop_health(j)``, j indexing its GetStageInfo ``next_hops``).
The watch follows each of them (:attr:`StageWatch.hops_down`), so a route is down by the hop that
is down (:meth:`StageWatch.route_blocked`): a partition between one replica and one replica of the
next stage takes out the routes over that link only, not the next stage.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pipeshard.services.transport.hop import NEXT_HOP_HEALTH, next_hop_health

log = structlog.get_logger(__name__)

_SERVING = health_pb2.HealthCheckResponse.SERVING
_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


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
        on_hop_change: Callable[[int, int, bool, str], None] = lambda index, hop, up, reason: None,
    ):
        """``on_hop_change(index, hop, up, reason)`` hears stage ``index``'s next hop ``hop`` (an
        index into its ``next_hops``) go down or come back."""
        self._stubs = {i: health_pb2_grpc.HealthStub(c) for i, c in channels.items()}
        self._addresses = addresses
        self._on_change = on_change
        self._probe_interval_s = probe_interval_s
        self._probe_timeout_s = probe_timeout_s
        self._own: dict[int, str] = {}  # stage index -> why it is unreachable itself
        self._hops: dict[int, str] = {}  # stage index -> why its predecessor's hop to it is down
        self.on_hop_change = on_hop_change  # settable: the replica lanes' routing hears it
        self._links: dict[tuple[int, int], str] = {}  # (stage, its next hop) -> why that hop is down
        self._tasks: list[asyncio.Task] = []
        self._probes: dict[int, asyncio.Task] = {}
        self._streams = {("stage", i) for i in self._stubs} | {
            ("hop", i) for i in self._stubs if i + 1 in self._stubs
        }
        self._heard: set[tuple[str, int]] = set()  # streams that have answered at least once
        self._changed = asyncio.Event()

    @property
    def down(self) -> dict[int, str]:
        """Stage index -> why it is unreachable (itself, or from the stage before it over this
        ring's own hop: its lane)."""
        return {**self._hops, **self._own}

    @property
    def unreachable(self) -> dict[int, str]:
        """Stage index -> why the stage itself is unreachable (whether a replica of the stage
        before reaches it is a hop's question: :attr:`hops_down`)."""
        return dict(self._own)

    @property
    def hops_down(self) -> dict[tuple[int, int], str]:
        """(stage index, next-hop index) -> why that stage's hop to that replica of the next stage
        is down (broken or stalled), for every next hop of every watched stage."""
        return dict(self._links)

    def route_blocked(self, index: int, hop: int | None) -> str | None:
        """Why a session that runs on stage ``index`` and forwards over its next hop ``hop`` (None:
        the final stage) cannot step now, or None: the stage itself is unreachable, or that one
        hop is down. Another hop of the same stage being down does not block it."""
        if index in self._own:
            return self.describe_own(index)
        if hop is not None and (index, hop) in self._links:
            why = self._links[index, hop]
            return f"stage {index} at {self._addresses[index]}: its next hop {hop} is down ({why})"
        return None

    def describe_own(self, index: int) -> str:
        return f"stage {index} at {self._addresses[index]} is unreachable ({self._own[index]})"

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._watch(i), name=f"watch-stage{i}") for i in sorted(self._stubs)
        ]
        self._tasks += [
            asyncio.create_task(self._watch_hop(i), name=f"watch-hop{i}")
            for i in sorted(self._stubs)
            if i + 1 in self._stubs
        ]
        self._tasks += [
            asyncio.create_task(self._watch_link(i, 0), name=f"watch-link{i}.0") for i in sorted(self._stubs)
        ]

    async def close(self) -> None:
        tasks = [*self._tasks, *self._probes.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def wait_serving(self, timeout_s: float) -> None:
        """Waits until every stream has answered once and no stage is down: a fresh watch knows
        nothing yet, and a stage may still report its next hop reconnecting. Raises
        :class:`TimeoutError` naming what is still down or silent."""
        try:
            async with asyncio.timeout(timeout_s):
                while self._heard != self._streams or self.down:
                    self._changed.clear()
                    await self._changed.wait()
        except TimeoutError:
            down = [self.describe(i) for i in sorted(self.down)]
            silent = [
                f"{kind} {i} has not answered its health watch"
                for kind, i in sorted(self._streams - self._heard)
            ]
            raise TimeoutError("; ".join(down + silent)) from None

    def _hear(self, stream: tuple[str, int]) -> None:
        self._heard.add(stream)
        self._changed.set()

    def describe(self, index: int) -> str:
        return f"stage {index} at {self._addresses[index]} is unreachable ({self.down[index]})"

    def mark_down(self, index: int, reason: str) -> None:
        """Records a stage as unreachable; a Watch stream that stays open cannot tell (frozen)."""
        if index not in self._stubs:
            return  # stage 0 hosted in this process
        self._set(index, False, reason)
        if index not in self._probes:
            self._probes[index] = asyncio.create_task(self._probe_until_up(index), name=f"probe-stage{index}")

    def _set(self, index: int, up: bool, reason: str, *, hop: bool = False) -> None:
        was_up = index not in self.down
        causes = self._hops if hop else self._own
        if up:
            causes.pop(index, None)
        else:
            causes[index] = reason
        up = index not in self.down
        reason = self.down.get(index, reason)
        if up != was_up:
            log.warning(
                "stage_reachability", stage=index, address=self._addresses[index], up=up, reason=reason
            )
            self._on_change(index, up, reason)
        self._changed.set()

    async def _watch(self, index: int) -> None:
        stub = self._stubs[index]
        while True:
            reason = "health stream ended"
            call = stub.Watch(health_pb2.HealthCheckRequest(service=""), wait_for_ready=True)
            try:
                async for response in call:
                    self._hear(("stage", index))
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

    async def _watch_hop(self, index: int) -> None:
        """Stage ``index``'s report of its hop to ``index + 1``; a stage that reports none (an
        older stage: SERVICE_UNKNOWN) or that is itself gone leaves the next stage's state alone."""
        stub, after = self._stubs[index], index + 1
        while True:
            call = stub.Watch(health_pb2.HealthCheckRequest(service=NEXT_HOP_HEALTH), wait_for_ready=True)
            try:
                async for response in call:
                    lost = response.status == health_pb2.HealthCheckResponse.NOT_SERVING
                    why = f"stage {index}'s next hop to it is down: broken or stalled"
                    self._set(after, not lost, why if lost else "next hop up", hop=True)
                    self._hear(("hop", index))
            except grpc.aio.AioRpcError:
                pass
            finally:
                call.cancel()
            self._set(after, True, "predecessor gone", hop=True)
            await asyncio.sleep(0.2)

    async def _watch_link(self, index: int, hop: int) -> None:
        """Stage ``index``'s report of its next hop ``hop``; the first report of a hop that exists
        starts the watch of the one after it (a stage without it answers SERVICE_UNKNOWN: the final
        stage, a stage with fewer next hops, or an older stage that reports its first only)."""
        stub, key, followed = self._stubs[index], (index, hop), False
        service = next_hop_health(hop)
        while True:
            call = stub.Watch(health_pb2.HealthCheckRequest(service=service), wait_for_ready=True)
            try:
                async for response in call:
                    if response.status == _UNKNOWN:
                        self._set_link(key, True, "no such next hop")
                        continue
                    if not followed:
                        followed = True
                        self._tasks.append(
                            asyncio.create_task(
                                self._watch_link(index, hop + 1), name=f"watch-link{index}.{hop + 1}"
                            )
                        )
                    up = response.status == _SERVING
                    self._set_link(key, up, "next hop up" if up else "broken or stalled")
            except grpc.aio.AioRpcError:
                pass
            finally:
                call.cancel()
            self._set_link(key, True, "stage gone: its own watch names it")
            await asyncio.sleep(0.2)

    def _set_link(self, key: tuple[int, int], up: bool, reason: str) -> None:
        was_up = key not in self._links
        if up:
            self._links.pop(key, None)
        else:
            self._links[key] = reason
        if up != was_up:
            index, hop = key
            log.warning(
                "next_hop_reachability",
                stage=index,
                address=self._addresses[index],
                hop=hop,
                up=up,
                reason=reason,
            )
            self.on_hop_change(index, hop, up, reason)

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
