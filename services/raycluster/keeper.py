"""Membership changes of a Ray fleet, handled by one detached actor beside the coordinator.

Ray restarts a dead node's stage actors on nodes with room (``max_restarts``, the lane's placement
group rescheduled); the coordinator's failover carries the running requests meanwhile. The keeper
only keeps the coordinator's lanes equal to where the actors now are (topology file + SIGHUP: a
moved stage's lane is replaced), adds a lane when a joining node makes room for one (``--replicas
auto``, or ``replan``), and drains a node's lanes. Each change is logged and counted
(``pipeshard_ray_fleet_changes_total`` in Ray's metrics, on its dashboard).
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import cast

import grpc
import ray
import structlog
from ray.util.placement_group import get_placement_group, remove_placement_group

from pipeshard.services.launcher import stage_name
from pipeshard.services.raycluster.actors import NAMESPACE, ServiceInfo
from pipeshard.services.raycluster.fleet import (
    COORDINATOR,
    LANE_GROUP,
    RayFleet,
    endpoint,
    fleet_topology,
    head_strategy,
    start_lane,
)
from pipeshard.services.raycluster.members import members
from pipeshard.v1 import stage_pb2, stage_pb2_grpc

log = structlog.get_logger(__name__)
KEEPER = "keeper"


@dataclass(frozen=True)
class Change:
    """One membership change, as the keeper logged and counted it."""

    at: float
    kind: str  # stage_moved | stage_restarted | lane_added | lane_drained
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
        self.nodes = len(members())
        self.lock = threading.Lock()
        self.interval_s = interval_s
        threading.Thread(target=self._watch, daemon=True).start()

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
        changed = False
        for r, lane in list(self.lanes.items()):
            now: list[ServiceInfo] = []
            for info in lane:
                try:
                    actor = ray.get_actor(info.name, namespace=NAMESPACE)
                    now.append(cast(ServiceInfo, ray.get(actor.info.remote(), timeout=2)))
                except Exception:
                    now = []  # restarting: look again next time
                    break
            if not now:
                continue
            for old, new in zip(lane, now, strict=True):
                if old.node_id != new.node_id:
                    detail = f"{new.name} from node {old.node_id[:8]} to {new.node_id[:8]} at {new.address}"
                    self._record("stage_moved", detail)
            moved = [k for k in range(len(now)) if now[k].address != lane[k].address]
            if moved:
                changed = True
                # the stages before it forward to its old address: Ray restarts them (same ports),
                # and each asks its next stage's actor where that is now
                for j in reversed(range(max(moved))):
                    ray.kill(ray.get_actor(stage_name(j, r), namespace=NAMESPACE), no_restart=False)
                    self._record("stage_restarted", f"{stage_name(j, r)}: its next hop moved")
            self.lanes[r] = now
        alive = len(members())
        if self.fleet.spec.auto_replicas and alive > self.nodes:
            changed |= self._add_lane()
        self.nodes = alive
        if changed:
            self._publish()

    def _add_lane(self, avoid: str | None = None) -> bool:
        """One more lane where the cluster has room; with ``avoid`` (a node id prefix), none that
        would have a stage there."""
        f = self.fleet
        r = max(self.lanes, default=-1) + 1
        lane = start_lane(f.spec, f.plan, f.shards, f.exporter.address, r)
        if lane is None:
            return False
        if avoid is not None and any(s.node_id.startswith(avoid) for s in lane):
            self._remove_lane(r)
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
            while self._add_lane():
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
                self._add_lane(avoid=node)
            gone = [s.address for r in hit for s in self.lanes.pop(r)]
            for r in hit:
                self._record("lane_drained", f"lane {r} off node {node}")
            self._publish()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(_sessions(a) for a in gone):
            time.sleep(1.0)
        for r in hit:
            self._remove_lane(r)
        return hit

    def history(self) -> list[Change]:
        return list(self.changes)

    def lane_infos(self) -> dict[int, list[ServiceInfo]]:
        return dict(self.lanes)


def _sessions(address: str) -> int:
    """Sessions the stage at ``address`` holds (0 once it does not answer)."""
    with grpc.insecure_channel(address) as channel:
        try:
            info = stage_pb2_grpc.StageServiceStub(channel).GetStageInfo(
                stage_pb2.GetStageInfoRequest(), timeout=5
            )
        except grpc.RpcError:
            return 0
    return info.live_sessions


def start_keeper(fleet: RayFleet):
    """The fleet's keeper, on this machine's node beside the coordinator."""
    return Keeper.options(  # type: ignore[attr-defined]  # ray.remote returns an ActorClass; its stubs say the class
        name=KEEPER, namespace=NAMESPACE, lifetime="detached", scheduling_strategy=head_strategy()
    ).remote(fleet)


def keeper():
    return ray.get_actor(KEEPER, namespace=NAMESPACE)
