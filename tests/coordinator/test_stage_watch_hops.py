"""The coordinator's watch over each stage's report of its next hop (health service
NEXT_HOP_HEALTH), against real grpc.health.v1 servers: a lost hop makes the next stage unreachable
with a reason naming the hop, a restored hop brings it back unless the stage is down itself, and a
stage that reports nothing (an older stage) changes nothing. Each next hop of a stage with several
(next_hop_health(j)) is watched on its own and blocks only the routes over it."""

from __future__ import annotations

import asyncio

from pipeshard.grpc_server import GrpcServer
from pipeshard.services.coordinator.stage_watch import StageWatch
from pipeshard.services.transport.channels import open_channel
from pipeshard.services.transport.hop import NEXT_HOP_HEALTH, next_hop_health


async def _until(condition, timeout_s: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "the watch never saw it"
        await asyncio.sleep(0.05)


async def _watched(reports_hop: bool = True, **options):
    servers = [GrpcServer([], port=0) for _ in range(2)]
    for server in servers:
        await server.start()
    if reports_hop:
        servers[0].set_serving(NEXT_HOP_HEALTH, True)
    channels = [open_channel(s.address) for s in servers]
    changes: list[tuple[int, bool, str]] = []
    watch = StageWatch(
        dict(enumerate(channels)), [s.address for s in servers], lambda *c: changes.append(c), **options
    )
    watch.start()
    return servers, channels, watch, changes


async def _close(servers, channels, watch) -> None:
    await watch.close()
    for channel in channels:
        await channel.close()
    for server in servers:
        await server.stop(0)


def test_a_lost_hop_makes_the_next_stage_unreachable_until_it_is_back():
    async def run() -> None:
        servers, channels, watch, changes = await _watched()
        await asyncio.sleep(0.5)
        assert not watch.down
        servers[0].set_serving(NEXT_HOP_HEALTH, False)
        await _until(lambda: 1 in watch.down)
        assert "stage 0's next hop to it is down" in watch.describe(1)
        assert 0 not in watch.down
        assert changes[-1][:2] == (1, False)
        servers[0].set_serving(NEXT_HOP_HEALTH, True)
        await _until(lambda: not watch.down)
        assert changes[-1][:2] == (1, True)
        await _close(servers, channels, watch)

    asyncio.run(run())


def test_a_restored_hop_does_not_bring_back_a_stage_that_is_down_itself():
    async def run() -> None:
        servers, channels, watch, changes = await _watched()
        await asyncio.sleep(0.5)
        servers[0].set_serving(NEXT_HOP_HEALTH, False)
        await _until(lambda: 1 in watch.down)
        servers[1].set_serving("", False)  # stage 1 drains: its own cause
        await _until(lambda: "draining" in watch.down.get(1, ""))
        servers[0].set_serving(NEXT_HOP_HEALTH, True)
        await asyncio.sleep(0.5)
        assert 1 in watch.down and "draining" in watch.describe(1)
        assert [c for c in changes if c[0] == 1 and c[1]] == []  # never reported up meanwhile
        await _close(servers, channels, watch)

    asyncio.run(run())


def test_a_stage_that_reports_no_hop_changes_nothing():
    async def run() -> None:
        servers, channels, watch, changes = await _watched(reports_hop=False)
        await asyncio.sleep(1.0)
        assert not watch.down and not changes
        await _close(servers, channels, watch)

    asyncio.run(run())


def test_wait_serving_waits_for_a_hop_still_reconnecting_and_names_it_on_timeout():
    """What a lane added at run time waits for: a stage reporting its next hop down keeps the
    new lane out of rotation until the hop is back (a fresh watch has heard nothing yet)."""

    async def run() -> None:
        servers = [GrpcServer([], port=0) for _ in range(2)]
        for server in servers:
            await server.start()
        servers[0].set_serving(NEXT_HOP_HEALTH, False)  # reconnecting to a restarted stage 1
        channels = [open_channel(s.address) for s in servers]
        watch = StageWatch(dict(enumerate(channels)), [s.address for s in servers], lambda *c: None)
        watch.start()
        try:
            await watch.wait_serving(1.0)
        except TimeoutError as exc:
            assert "stage 1" in str(exc) and "next hop" in str(exc)
        else:
            raise AssertionError("wait_serving returned while stage 0's hop was down")
        waiter = asyncio.ensure_future(watch.wait_serving(20.0))
        await asyncio.sleep(0.3)
        assert not waiter.done()
        servers[0].set_serving(NEXT_HOP_HEALTH, True)
        await asyncio.wait_for(waiter, 20.0)
        assert not watch.down
        await _close(servers, channels, watch)

    asyncio.run(run())


def test_wait_serving_returns_for_a_stage_that_reports_no_hop():
    async def run() -> None:
        servers, channels, watch, _ = await _watched(reports_hop=False)
        await watch.wait_serving(20.0)
        assert not watch.down
        await _close(servers, channels, watch)

    asyncio.run(run())


def test_each_next_hop_is_watched_on_its_own_and_blocks_only_its_routes():
    """Per-hop routes: stage 0 forwards to two replicas of stage 1 (next_hop_health(0) and (1));
    hop 1 down blocks the routes over it only, the next stage and hop 0's routes stay up."""

    async def run() -> None:
        hop_changes: list[tuple[int, int, bool]] = []
        servers, channels, watch, _ = await _watched(
            on_hop_change=lambda index, hop, up, reason: hop_changes.append((index, hop, up))
        )
        for j in (0, 1):
            servers[0].set_serving(next_hop_health(j), True)
        await asyncio.sleep(0.5)
        assert not watch.hops_down
        servers[0].set_serving(next_hop_health(1), False)
        await _until(lambda: (0, 1) in watch.hops_down)
        assert list(watch.hops_down) == [(0, 1)]
        assert watch.route_blocked(0, 0) is None and watch.route_blocked(1, None) is None
        assert "its next hop 1 is down" in (watch.route_blocked(0, 1) or "")
        assert not watch.down  # not the whole next stage: hop 0, its lane's, is up
        assert hop_changes == [(0, 1, False)]
        servers[0].set_serving(next_hop_health(1), True)
        await _until(lambda: not watch.hops_down)
        assert hop_changes[-1] == (0, 1, True)
        await _close(servers, channels, watch)

    asyncio.run(run())


def test_a_stage_down_itself_blocks_every_route_through_it():
    async def run() -> None:
        servers, channels, watch, _ = await _watched()
        servers[1].set_serving("", False)
        await _until(lambda: 1 in watch.down)
        assert "draining" in (watch.route_blocked(1, None) or "")
        assert watch.route_blocked(0, 0) is None
        await _close(servers, channels, watch)

    asyncio.run(run())
