"""Membership changes of a Ray fleet, handled by one detached actor beside the coordinator.

Ray restarts a stage whose process died in place (``max_restarts``: its bundle is pinned to its
node, so it keeps node and port). A lane with a stage on a node that died is placed again by the
keeper on members with room, and the coordinator's failover carries the running requests
meanwhile. A node counts as dead when Ray says so, or sooner when a stage there has neither
answered its health check nor its actor a call for ``DEAD_AFTER_LOOKS`` looks in a row (Ray's own
verdict waits for its node health checks). The keeper keeps the coordinator's lanes equal to where
the actors are (topology file + SIGHUP), adds a lane when a joining node makes room for one
(``--replicas auto``, or ``replan``), and drains a node's lanes. Each change is logged and counted
(``pipeshard_ray_fleet_changes_total`` in Ray's metrics, on its dashboard).
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass

import grpc
import ray
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from ray.util.placement_group import get_placement_group, remove_placement_group

from pipeshard.services.launcher import stage_name
from pipeshard.services.raycluster.actors import NAMESPACE, ServiceInfo, node_run_dir
from pipeshard.services.raycluster.certify import SIGNER, request_certificate
from pipeshard.services.raycluster.fleet import (
    COORDINATOR,
    LANE_GROUP,
    RayFleet,
    endpoint,
    fleet_members,
    fleet_topology,
    head_strategy,
    start_lane,
)
from pipeshard.services.raycluster.members import Member
from pipeshard.tls import TlsConfig
from pipeshard.v1 import stage_pb2, stage_pb2_grpc

log = structlog.get_logger(__name__)
KEEPER = "keeper"
DEAD_AFTER_LOOKS = (
    3  # looks (one a second) a stage and its actor may both be silent before its node counts as dead
)
# looks a join keeps asking for a lane: a node is listed alive before all of its resources are
JOIN_LOOKS = 10


@dataclass(frozen=True)
class Change:
    """One membership change, as the keeper logged and counted it."""

    at: float
    kind: str  # stage_moved | lane_lost | lane_added | lane_drained
    detail: str


@ray.remote(num_cpus=0)
class Keeper:
    def __init__(self, fleet: RayFleet, interval_s: float = 1.0):
        from ray.util.metrics import Counter

        self.fleet = fleet
        self.lanes: dict[int, list[ServiceInfo]] = dict(enumerate(fleet.lanes))
        self.changes: list[Change] = []
        self.counter = Counter(
            "pipeshard_ray_fleet_changes", "membership changes of the Ray fleet", tag_keys=("kind",)
        )
        self.trusted: set[str] = set()
        self.nodes = len(self._members())
        self.join_looks = 0  # looks left in which a recent join may still make room for a lane
        self.silent: dict[str, int] = {}  # stage name -> looks in a row it did not answer
        self.tls = self._identity()
        self.lock = threading.Lock()
        self.interval_s = interval_s
        threading.Thread(target=self._watch, daemon=True).start()

    def _identity(self) -> TlsConfig | None:
        """Secured: the keeper's own certificate (a coordinator's role: it reads stages' sessions)."""
        spec = self.fleet.spec
        if not spec.secure:
            return None
        node = ray.get_runtime_context().get_node_id()
        folder = node_run_dir(str(spec.work_dir), node) / "tls" / KEEPER
        host = ray.util.get_node_ip_address()
        request_certificate(ray.get_actor(SIGNER, namespace=NAMESPACE), folder, KEEPER, "coordinator", host)
        return TlsConfig.from_dir(folder, KEEPER)

    def _members(self) -> list[Member]:
        return fleet_members(self.fleet.spec, self.trusted)[0]

    def _record(self, kind: str, detail: str) -> None:
        self.changes.append(Change(time.time(), kind, detail))
        self.counter.inc(tags={"kind": kind})
        log.info("ray_fleet_change", kind=kind, detail=detail)

    def _publish(self) -> None:
        """The coordinator re-reads its lanes: removed ones drain, new ones join once they answer."""
        f = self.fleet
        host = f.coordinator.address.rpartition(":")[0]
        c_port = int(f.coordinator.address.rpartition(":")[2])
        e_port = int(f.exporter.address.rpartition(":")[2])
        lanes = [self.lanes[r] for r in sorted(self.lanes)]
        ends = endpoint(f.spec, host, c_port), endpoint(f.spec, host, e_port)
        topo = fleet_topology(f.spec, f.shards, *ends, lanes)
        topo.save(f.spec.topology)
        coordinator = ray.get_actor(COORDINATOR, namespace=NAMESPACE)
        ray.get(coordinator.signal_reload.remote(str(f.spec.topology), f.spec.topology.read_text()))

    def _watch(self) -> None:
        while True:
            time.sleep(self.interval_s)
            try:
                with self.lock:
                    self.step()
            except Exception as exc:  # one failed look must not end the watch
                log.warning("ray_fleet_watch_failed", error=str(exc))

    def step(self) -> None:
        alive = self._members()
        ids = {m.node_id for m in alive}
        changed = False
        for r, lane in list(self.lanes.items()):
            gone = [s.node_id for s in lane if s.node_id not in ids or self._silent(s)]
            if gone:
                changed = True
                self._place_again(r, lane, [m for m in alive if m.node_id not in gone])
        if len(alive) > self.nodes:
            self.join_looks = JOIN_LOOKS
        if self.fleet.spec.auto_replicas and self.join_looks > 0:
            added = self._add_lane(alive)
            changed |= added
            self.join_looks = 0 if added else self.join_looks - 1
        self.nodes = len(alive)
        if changed:
            self._publish()

    def _silent(self, stage: ServiceInfo) -> bool:
        """True once neither the stage nor its actor answered for DEAD_AFTER_LOOKS looks."""
        quiet = not _serving(stage.address, self.tls)
        if quiet:
            try:
                actor = ray.get_actor(stage.name, namespace=NAMESPACE)
                ray.get(actor.info.remote(), timeout=1)
                quiet = False
            except Exception:  # no answer: its node may be gone
                pass
        self.silent[stage.name] = self.silent.get(stage.name, 0) + 1 if quiet else 0
        return self.silent[stage.name] >= DEAD_AFTER_LOOKS

    def _place_again(self, r: int, lane: list[ServiceInfo], alive: list[Member]) -> None:
        """Lane ``r`` lost a node: its actors and group go, and it starts again on ``alive``."""
        f = self.fleet
        self._remove_lane(r)
        for s in lane:
            self.silent.pop(s.name, None)
        now = start_lane(f.spec, f.plan, f.shards, f.exporter.address, r, alive)
        if now is None:
            del self.lanes[r]
            self._record("lane_lost", f"lane {r}: no room for it on the nodes left")
            return
        for old, new in zip(lane, now, strict=True):
            if old.node_id != new.node_id:
                detail = f"{new.name} from node {old.node_id[:8]} to {new.node_id[:8]} at {new.address}"
                self._record("stage_moved", detail)
        self.lanes[r] = now

    def _add_lane(self, alive: list[Member], avoid: str | None = None) -> bool:
        """One more lane where the cluster has room; with ``avoid`` (a node id prefix), none that
        would have a stage there."""
        f = self.fleet
        r = max(self.lanes, default=-1) + 1
        lane = start_lane(f.spec, f.plan, f.shards, f.exporter.address, r, alive, avoid)
        if lane is None:
            return False
        self.lanes[r] = lane
        self._record("lane_added", f"lane {r} on nodes {', '.join(s.node_id[:8] for s in lane)}")
        return True

    def _remove_lane(self, r: int) -> None:
        """Lane ``r``'s actors (not restarted) and its placement group."""
        for k in range(len(self.fleet.plan.plan.stages)):
            with contextlib.suppress(ValueError):
                ray.kill(ray.get_actor(stage_name(k, r), namespace=NAMESPACE), no_restart=True)
        with contextlib.suppress(ValueError):
            remove_placement_group(get_placement_group(f"{LANE_GROUP}{r}"))

    def replan(self) -> int:
        """Add lanes while the cluster has room for one; returns how many were added."""
        with self.lock:
            added = 0
            while self._add_lane(self._members()):
                added += 1
            if added:
                self._publish()
            return added

    def drain(self, node: str, timeout_s: float = 600.0) -> list[int]:
        """Take every lane with a stage on ``node`` (a node id or its prefix) out: a replacement lane
        first where there is room, then the coordinator stops sending it sessions and closes it once
        its requests end; once its stages hold no session (or after ``timeout_s``) its actors and
        placement group go. Returns the lanes drained."""
        with self.lock:
            hit = [r for r, lane in self.lanes.items() if any(s.node_id.startswith(node) for s in lane)]
            if not hit:
                return []
            for _ in hit:
                self._add_lane(self._members(), avoid=node)
            gone = [s.address for r in hit for s in self.lanes.pop(r)]
            for r in hit:
                self._record("lane_drained", f"lane {r} off node {node}")
            self._publish()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(_sessions(a, self.tls) for a in gone):
            time.sleep(1.0)
        for r in hit:
            self._remove_lane(r)
        return hit

    def history(self) -> list[Change]:
        return list(self.changes)

    def lane_infos(self) -> dict[int, list[ServiceInfo]]:
        return dict(self.lanes)


def _channel(address: str, tls: TlsConfig | None) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, tls.channel_credentials())


def _sessions(address: str, tls: TlsConfig | None) -> int:
    """Sessions the stage at ``address`` holds (0 once it does not answer)."""
    with _channel(address, tls) as channel:
        try:
            info = stage_pb2_grpc.StageServiceStub(channel).GetStageInfo(
                stage_pb2.GetStageInfoRequest(), timeout=5
            )
        except grpc.RpcError:
            return 0
    return info.live_sessions


def _serving(address: str, tls: TlsConfig | None) -> bool:
    with _channel(address, tls) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def start_keeper(fleet: RayFleet):
    """The fleet's keeper, on this machine's node beside the coordinator."""
    return Keeper.options(  # type: ignore[attr-defined]  # ray.remote returns an ActorClass; its stubs say the class
        name=KEEPER, namespace=NAMESPACE, lifetime="detached", scheduling_strategy=head_strategy()
    ).remote(fleet)


def keeper():
    return ray.get_actor(KEEPER, namespace=NAMESPACE)
