"""Replica lanes without processes: parsing and topology, the agreement check, lane choice."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from pipeshard.errors import FailedPrecondition, InvalidArgument, Unavailable
from pipeshard.services.coordinator.main import stage_lanes
from pipeshard.services.coordinator.replicas import ReplicaLanes, check_replicas_agree
from pipeshard.services.coordinator.ring import SessionTerms
from pipeshard.topology import Topology
from pipeshard.v1 import activation_pb2, stage_pb2


def test_stage_lanes_transposes_replicas_and_refuses_uneven_counts():
    assert stage_lanes(["a0|a1", "b0|b1"]) == [["a0", "b0"], ["a1", "b1"]]
    assert stage_lanes(["a", "b"]) == [["a", "b"]]
    with pytest.raises(InvalidArgument, match="as many replicas"):
        stage_lanes(["a0|a1", "b0"])


def test_loopback_topology_places_replica_r_twenty_ports_up_and_round_trips(tmp_path: Path):
    topo = Topology.loopback("shards", 2, replicas=2)
    assert [[s.port for s in lane] for lane in topo.lanes] == [[50061, 50062], [50081, 50082]]
    assert [s.metrics_port for s in topo.replicas[0]] == [9181, 9182]
    assert topo.stage_addresses() == ["127.0.0.1:50061|127.0.0.1:50081", "127.0.0.1:50062|127.0.0.1:50082"]
    # every replica of the next stage, its own lane's first (per-hop routing)
    assert (topo.next_hop(0, 1), topo.next_hop(1, 1)) == ("127.0.0.1:50082,127.0.0.1:50062", None)
    assert topo.next_hop(0, 0) == "127.0.0.1:50062,127.0.0.1:50082"
    assert topo.stage(1, 1).port == 50082
    with pytest.raises(InvalidArgument, match="replica"):
        topo.stage(0, 2)
    topo.save(tmp_path / "t.yaml")
    assert Topology.load(tmp_path / "t.yaml") == topo


def test_fleet_drain_and_add_edit_the_topology_lanes():
    topo = Topology.loopback("shards", 2, replicas=2)
    drained = topo.without_lane("127.0.0.1:50082")
    assert drained.stage_addresses() == ["127.0.0.1:50061", "127.0.0.1:50062"]
    with pytest.raises(InvalidArgument, match="only lane"):
        drained.without_lane("127.0.0.1:50061")
    with pytest.raises(InvalidArgument, match="no lane"):
        drained.without_lane("127.0.0.1:1")
    added = drained.with_lane(["127.0.0.1:50101", "127.0.0.1:50102"])
    assert added.stage_addresses() == ["127.0.0.1:50061|127.0.0.1:50101", "127.0.0.1:50062|127.0.0.1:50102"]
    assert added.replicas[0][1].metrics_port == 9202
    with pytest.raises(InvalidArgument, match="already"):
        added.with_lane(["127.0.0.1:50101", "127.0.0.1:50103"])
    with pytest.raises(InvalidArgument, match="must list 2"):
        added.with_lane(["127.0.0.1:50103"])


def _info(**fields) -> stage_pb2.GetStageInfoResponse:
    base = dict(model_fingerprint="f1", precision="exact", kv_backend="paged", kv_block_tokens=32)
    return stage_pb2.GetStageInfoResponse(**{**base, **fields})


def test_replicas_that_disagree_are_refused_naming_both():
    check_replicas_agree([[_info()], [_info()]], [["a:1"], ["b:1"]])
    for field, value in (("model_fingerprint", "f2"), ("precision", "fast"), ("kv_block_tokens", 16)):
        with pytest.raises(FailedPrecondition) as info:
            check_replicas_agree([[_info()], [_info(**{field: value})]], [["a:1"], ["b:1"]])
        assert field in str(info.value) and "a:1" in str(info.value) and "b:1" in str(info.value)


class _Watch:
    """What a StageWatch knows, as a test sets it: stages unreachable themselves, and the hops
    (stage, next-hop index) that are down."""

    def __init__(self):
        self.down: dict[int, str] = {}
        self.hops_down: dict[tuple[int, int], str] = {}
        self.on_hop_change = lambda index, hop, up, reason: None

    @property
    def unreachable(self) -> dict[int, str]:
        return self.down

    def describe(self, index: int) -> str:
        return f"stage {index} is unreachable ({self.down[index]})"

    describe_own = describe

    def route_blocked(self, index: int, hop: int | None) -> str | None:
        if index in self.down:
            return self.describe(index)
        if hop is not None and (index, hop) in self.hops_down:
            return f"stage {index}: its next hop {hop} is down ({self.hops_down[index, hop]})"
        return None


class _Lane:
    """A ring stand-in: records the sessions opened and the plan rows it was sent."""

    def __init__(self):
        self.watch = _Watch()
        self.opened: list[str] = []
        self.rows: list[str] = []
        self.on_health = lambda serving: None
        self.fail_plans = False
        self.addresses = ["x:1", "x:2"]
        self.num_stages = 2
        self.closed = False

        self.aborted: list[str] = []
        self.restored: list[str] = []

    async def close(self):
        self.closed = True

    async def abort_session(self, session_id, reason, stages=None):
        self.aborted.append(session_id)

    async def keep_kv(self, session_id, scope, token_ids):
        return set()

    async def restore_kv(self, session_id, scope, token_ids, positions, timeout_s):
        self.restored.append(session_id)
        return set()

    @property
    def healthy(self) -> bool:
        return not self.watch.down and not self.watch.hops_down

    async def open_session(self, session_id, terms=None):
        self.opened.append(session_id)
        return 100

    async def release_session(self, session_id):
        pass

    async def run(self, frames, checked=True):
        self.rows += [f.session_id for f in frames]
        if self.fail_plans:
            raise Unavailable("stage 1 is unreachable")
        return [f.session_id for f in frames]


def test_sessions_spread_over_healthy_lanes_and_a_failed_lane_fails_only_its_rows():
    async def run():
        a, b = _Lane(), _Lane()
        ring = ReplicaLanes([a, b])
        for sid in ("s1", "s2", "s3"):
            await ring.open_session(sid)
        assert (a.opened, b.opened) == (["s1", "s3"], ["s2"])
        b.fail_plans = True
        frames = [activation_pb2.ActivationFrame(session_id=s) for s in ("s1", "s2", "s3")]
        answers = await ring.run(frames)
        assert answers[0] == "s1" and answers[2] == "s3" and isinstance(answers[1], Unavailable)
        a.watch.down[1] = "connection lost"  # lane a out of rotation
        await ring.open_session("s4")
        assert b.opened == ["s2", "s4"]
        b.watch.down[0] = "connection lost"
        with pytest.raises(Unavailable, match="stage 0"):
            await ring.open_session("s5")
        a.watch.down.clear()  # back: rejoins rotation
        await ring.release_session("s1")
        await ring.open_session("s6")
        assert a.opened[-1] == "s6"

    asyncio.run(run())


def test_a_draining_lane_takes_no_new_sessions_and_closes_once_its_sessions_end():
    async def run():
        a, b = _Lane(), _Lane()
        ring = ReplicaLanes([a, b])
        await ring.open_session("s1")
        ring.drain_lane(a)
        await ring.open_session("s2")
        await ring.open_session("s3")
        assert (a.opened, b.opened) == (["s1"], ["s2", "s3"])
        await asyncio.sleep(0.5)
        assert not a.closed and a in ring.lanes  # s1 still runs there
        await ring.release_session("s1")
        for _ in range(50):
            if a.closed:
                break
            await asyncio.sleep(0.1)
        assert a.closed and ring.lanes == [b]

    asyncio.run(run())


def test_a_restore_moves_an_empty_session_to_the_lane_that_kept_the_prefix_while_it_serves():
    async def run():
        a, b = _Lane(), _Lane()
        ring = ReplicaLanes([a, b])
        prefix = list(range(64))
        await ring.open_session("kept")  # a
        await ring.keep_kv("kept", "me", prefix)
        await ring.open_session("busy")  # b
        await ring.open_session("new", SessionTerms(200))  # a: one each, the first lane wins the tie
        await ring.release_session("busy")
        await ring.open_session("s")  # b, the least loaded
        await ring.restore_kv("s", "me", prefix, 64, 1.0)
        assert (b.aborted, a.opened[-1], a.restored) == (["s"], "s", ["s"])
        await ring.open_session("t")  # b
        a.watch.down[0] = "connection lost"  # the holder is out: restored where the session is
        await ring.restore_kv("t", "me", prefix, 64, 1.0)
        assert b.restored == ["t"] and "t" not in a.opened

    asyncio.run(run())


class _StageLane(_Lane):
    """A lane whose replicas are also called one stage at a time (routes across lanes)."""

    def __init__(self, name: str, other: str):
        super().__init__()
        self.addresses = [f"{name}0:1", f"{name}1:1"]
        self.next_hops = [f"{name}1:1", f"{other}1:1"]  # its own lane's first, as the launcher starts it
        self.calls: list[tuple] = []

    async def stage_infos(self, stages=None):
        infos = [_info(next_hops=self.next_hops), _info()]
        return infos if stages is None else [infos[k] for k in stages]

    async def open_stage(self, k, session_id, terms, next_hop):
        self.calls.append(("open", k, session_id, next_hop))
        return 100

    async def route_stage(self, k, session_id, next_hop, keep_positions):
        self.calls.append(("route", k, session_id, next_hop, keep_positions))
        return keep_positions

    async def abort_session(self, session_id, reason, stages=None):
        self.calls.append(("abort", stages, session_id))


def test_with_no_whole_lane_a_session_is_routed_across_lanes_over_the_live_replicas():
    async def run():
        a, b = _StageLane("a", "b"), _StageLane("b", "a")
        ring = ReplicaLanes([a, b])
        await ring.stage_infos()
        a.watch.down[1] = "connection lost"
        b.watch.down[0] = "connection lost"
        assert ring.healthy and not ring.live_lanes()
        await ring.open_session("s")
        assert ring.route_of("s") == [0, 1]
        assert a.calls == [("open", 0, "s", 1)] and b.calls == [("open", 1, "s", None)]
        # Stage 0's replica of lane a restarted knowing its own lane's next hop only (its health
        # changes: the ring asks again what it forwards to), lane b's stage 0 still down: no route.
        a.next_hops = a.next_hops[:1]
        a.on_health(True)
        for _ in range(5):
            await asyncio.sleep(0)
        assert not ring.healthy
        with pytest.raises(Unavailable, match="stage"):
            await ring.open_session("t")

    asyncio.run(run())


def test_a_dead_replica_moves_only_its_stage_and_fails_only_the_steps_routed_through_it():
    async def run():
        a, b = _StageLane("a", "b"), _StageLane("b", "a")
        ring = ReplicaLanes([a, b])
        await ring.stage_infos()
        await ring.open_session("t")  # lane a, whole: the lane's own open
        await ring.open_session("u")  # lane b
        assert (a.opened, b.opened) == (["t"], ["u"])
        a.watch.down[1] = "connection lost"
        # A's stage 1 lost: only "t" passes through it.
        assert a.routes_through("t", 1) and not a.routes_through("u", 1) and not b.routes_through("t", 1)
        assert ring.broken("t") == [1] and ring.broken("u") == []
        await ring.move_stages("t", [1], "moved to another replica of its stage")
        assert ring.route_of("t") == [0, 1]
        assert a.calls == [("abort", [1], "t")] and b.calls == [("open", 1, "t", None)]
        await ring.reroute("t", [1], 64)
        assert a.calls[-1] == ("route", 0, "t", 1, 64)  # cut back, forwarding to lane b's stage 1
        assert a.routes_through("t", 0) and b.routes_through("t", 1) and not a.routes_through("t", 1)
        # Stage 1 has no other live replica: the move is refused naming the stage.
        b.watch.down[1] = "connection lost"
        with pytest.raises(Unavailable, match="no other replica of stage 1"):
            await ring.move_stages("u", [1], "moved")

    asyncio.run(run())


def test_a_moved_stage_0_part_makes_its_new_replica_the_sessions_entry():
    async def run():
        a, b = _StageLane("a", "b"), _StageLane("b", "a")
        ring = ReplicaLanes([a, b])
        await ring.stage_infos()
        await ring.open_session("t")  # lane a
        a.watch.down[0] = "connection lost"
        frame = activation_pb2.ActivationFrame(session_id="t")
        (answer,) = await ring.run([frame])
        assert isinstance(answer, Unavailable) and not a.rows  # its route is down: not sent
        await ring.move_stages("t", [0], "moved")
        assert b.calls == [("open", 0, "t", 1)]  # lane b's stage 0, forwarding to lane a's stage 1
        await ring.reroute("t", [0], 32)
        assert a.calls[-1] == ("route", 1, "t", None, 32)  # the final stage: cut back only
        assert await ring.run([frame]) == ["t"] and b.rows == ["t"] and not a.rows

    asyncio.run(run())


def test_a_partitioned_hop_blocks_only_the_routes_over_it_and_moves_the_part_after_it():
    """Lane a's link from its stage 0 to its stage 1 stalls, both replicas alive: only the routes
    over that link stop; the session on it moves its stage 1 part to the replica stage 0 reaches
    over its other hop, and a new session may still use both of lane a's replicas on other routes."""

    async def run():
        a, b = _StageLane("a", "b"), _StageLane("b", "a")
        ring = ReplicaLanes([a, b])
        health: list[bool] = []
        ring.on_health = health.append
        await ring.stage_infos()
        await ring.open_session("t")  # lane a, whole: a0 -> a1 over a0's hop 0
        await ring.open_session("u")  # lane b
        a.watch.hops_down[0, 0] = "broken or stalled"
        a.watch.on_hop_change(0, 0, False, "broken or stalled")
        assert health == [True]  # b0 -> b1 and a0 -> b1 remain
        t, u = (activation_pb2.ActivationFrame(session_id=s) for s in ("t", "u"))
        blocked, answered = await ring.run([t, u])
        assert isinstance(blocked, Unavailable) and "next hop 0 is down" in str(blocked)
        assert answered == "u" and a.rows == [] and b.rows == ["u"]  # not sent over the stalled link
        assert ring.broken("t") == [1] and ring.broken("u") == []
        await ring.move_stages("t", ring.broken("t"), "moved to another replica of its stage")
        assert ring.route_of("t") == [0, 1]  # a0 -> b1, over a0's hop 1
        assert b.calls == [("open", 1, "t", None)]
        await ring.reroute("t", [1], 64)
        assert a.calls[-1] == ("route", 0, "t", 1, 64)
        assert await ring.run([t]) == ["t"]
        # With b's stage 0 gone too, a new session crosses from a0 to b1, never over the stalled link.
        b.watch.down[0] = "connection lost"
        await ring.open_session("w")
        assert ring.route_of("w") == [0, 1] and a.calls[-1] == ("open", 0, "w", 1)
        # a0's other hop stalls as well: no route is left, and a move says which hop is down.
        a.watch.hops_down[0, 1] = "broken or stalled"
        assert not ring.healthy
        with pytest.raises(Unavailable, match="the hop from stage 0 to stage 1 at b1:1 is down"):
            await ring.move_stages("w", [1], "moved")
        with pytest.raises(Unavailable):
            await ring.open_session("x")

    asyncio.run(run())
