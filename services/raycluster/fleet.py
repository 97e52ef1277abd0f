"""``pipeshard up --ray``: the fleet's services as Ray actors, placed by the planner.

The exporter, coordinator and gateway run on the node of the machine that ran ``up`` (it holds the
exports); every stage runs in its lane's placement group and pulls only its own shard from the
exporter into its node's folder. The coordinator reads a topology file written from the stage
actors' reports, never by hand. Everything is a detached named actor in the ``pipeshard``
namespace, so it outlives ``up``; ``pipeshard down`` removes exactly those (names in run/ray.json).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import ray
from ray.util.placement_group import get_placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from pipeshard.errors import InvalidArgument
from pipeshard.paths import DEFAULT_MODEL
from pipeshard.precision import DEFAULT_PRECISION
from pipeshard.services.launcher import stage_name
from pipeshard.services.raycluster.actors import NAMESPACE, ServiceActor, ServiceInfo, free_port
from pipeshard.services.raycluster.placement import FleetPlan, reserve_lane
from pipeshard.topology import METRICS_OFFSET, REPLICA_PORT_STRIDE, Endpoint, StageEndpoint, Topology

EXPORTER, COORDINATOR, GATEWAY = "exporter", "coordinator", "gateway"
LANE_GROUP = "pipeshard-lane"  # lane r's placement group is pipeshard-lane<r>


@dataclass(frozen=True)
class RaySpec:
    """What to start: ports 0 pick free ones; ``stage_port_base`` 0 likewise for every stage."""

    shards_root: Path  # the exports on this (the head's) machine, served by the exporter
    work_dir: Path  # each node's folder (logs, pulled shards) goes under it
    topology: Path  # the coordinator's topology file, on this machine
    model: str = DEFAULT_MODEL
    export: Path | None = None  # serve this export folder (under shards_root) instead of the plan's
    weights: str = "int4"
    precision: str = DEFAULT_PRECISION
    replicas: int = 1  # lanes to start
    auto_replicas: bool = False  # the keeper adds a lane when a joining node makes room for one
    stage_port_base: int = 0
    coordinator_port: int = 0
    exporter_port: int = 0
    gateway_port: int | None = None  # None: no gateway
    metrics: bool = False  # each service also serves /metrics on its port + METRICS_OFFSET
    lane_timeout_s: float = 20.0  # how long a lane's placement group may take to be placed
    timeout_s: float = 300.0  # how long a service may take to start
    extra_stage_args: tuple[str, ...] = ()
    extra_coordinator_args: tuple[str, ...] = ()


@dataclass
class RayFleet:
    """A started fleet: where each service runs, and the names ``down`` removes."""

    spec: RaySpec
    plan: FleetPlan
    shards: Path
    exporter: ServiceInfo
    coordinator: ServiceInfo
    gateway: ServiceInfo | None
    lanes: list[list[ServiceInfo]] = field(default_factory=list)

    @property
    def actor_names(self) -> list[str]:
        names = [EXPORTER, COORDINATOR, *([GATEWAY] if self.gateway else [])]
        return names + [s.name for lane in self.lanes for s in lane]


def head_strategy() -> NodeAffinitySchedulingStrategy:
    """This machine's node: the exporter, coordinator and gateway live where the exports are."""
    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)


def _port(port: int) -> int:
    return port or free_port()


def _metered(spec: RaySpec, port: int) -> list[str]:
    """Metrics on the node's address, where `pipeshard top` on another node reads them (the Ray
    fleet is plaintext throughout until it is secured: docs/RAY.md, "Limits")."""
    if not spec.metrics:
        return []
    return ["--metrics-port", str(port + METRICS_OFFSET), "--metrics-host", "{host}"]


def _server_args(spec: RaySpec, port: int) -> list[str]:
    """Every service listens on its node's address: plaintext there needs saying so."""
    return ["--host", "{host}", "--port", str(port), "--allow-plaintext", *_metered(spec, port)]


def start_actor(
    name: str, args: list[str], spec: RaySpec, strategy, *, next_of: str | None = None, restarts: int = 0
):
    actor = ServiceActor.options(  # type: ignore[attr-defined]  # ray.remote returns an ActorClass; its stubs say the class
        name=name,
        namespace=NAMESPACE,
        lifetime="detached",
        max_restarts=restarts,
        max_task_retries=-1 if restarts else 0,
        scheduling_strategy=strategy,
    ).remote(name, args, str(spec.work_dir), None, next_of, spec.timeout_s)
    return actor, ray.get(actor.info.remote(), timeout=spec.timeout_s + 60)


def stage_port(spec: RaySpec, k: int, r: int) -> int:
    """Replica r of stage k keeps one port wherever Ray restarts it (its lane's next hop stays)."""
    return spec.stage_port_base + k + REPLICA_PORT_STRIDE * r if spec.stage_port_base else free_port()


def start_lane(spec: RaySpec, fp: FleetPlan, shards: Path, exporter: str, r: int) -> list[ServiceInfo] | None:
    """Lane ``r`` in its own placement group, last stage first (each asks the next's address);
    None when the cluster has no room for it now."""
    pg = reserve_lane(fp, f"{LANE_GROUP}{r}", spec.lane_timeout_s)
    if pg is None:
        return None
    infos: list[ServiceInfo] = []
    n = len(fp.plan.stages)
    for k in reversed(range(n)):
        args = [
            "stage",
            "--stage",
            str(k),
            "--shards",
            f"{{run}}/shards/{shards.name}",
            "--exporter",
            exporter,
        ]
        args += ["--precision", spec.precision, "--log-format", "json", *spec.extra_stage_args]
        args += _server_args(spec, stage_port(spec, k, r))
        strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=k)
        nxt = stage_name(k + 1, r) if k + 1 < n else None
        _, info = start_actor(stage_name(k, r), args, spec, strategy, next_of=nxt, restarts=-1)
        infos.insert(0, info)
    return infos


def endpoint(spec: RaySpec, host: str, port: int) -> Endpoint:
    return Endpoint(host, port, port + METRICS_OFFSET if spec.metrics else 0)


def fleet_topology(spec: RaySpec, shards: Path, coordinator: Endpoint, exporter: Endpoint, lanes) -> Topology:
    """The coordinator's topology file from the stage actors' reports."""

    def end(info: ServiceInfo) -> StageEndpoint:
        host, _, port = info.address.rpartition(":")
        metrics = int(port) + METRICS_OFFSET if spec.metrics else 0
        return StageEndpoint(host, int(port), metrics, node=info.node_id)

    ends = [[end(s) for s in lane] for lane in lanes]
    return Topology(str(shards), coordinator, exporter, ends[0], spec.precision, ends[1:])


def ensure_export(spec: RaySpec, fp: FleetPlan, exporter) -> Path:
    """The plan's export, made once by the exporter actor when no export of this split exists."""
    shards = spec.export or fp.export_dir(spec.shards_root, Path(spec.model).name, spec.weights)
    if not (shards / "manifest.json").exists():
        argv = ["export", "--model", spec.model, "--split", fp.plan.ranges, "--weights", spec.weights]
        ray.get(exporter.run.remote([*argv, "--out", str(shards)]))
    return shards


def up(spec: RaySpec, fp: FleetPlan) -> RayFleet:
    """Start the fleet of ``fp``; on any failure what was started is removed again."""
    names: list[str] = []
    try:
        head = head_strategy()
        exporter_port = _port(spec.exporter_port)
        ex_args = ["exporter-service", "--shards-dir", str(spec.shards_root), "--log-format", "json"]
        exporter, ex_info = start_actor(EXPORTER, ex_args + _server_args(spec, exporter_port), spec, head)
        names.append(EXPORTER)
        shards = ensure_export(spec, fp, exporter)
        lanes: list[list[ServiceInfo]] = []
        while len(lanes) < spec.replicas:
            lane = start_lane(spec, fp, shards, ex_info.address, len(lanes))
            if lane is None:
                break
            lanes.append(lane)
            names += [s.name for s in lane]
        if not lanes:
            raise InvalidArgument(
                "ray", f"no room for a lane: its stages need {fp.stage_memory} bytes on distinct nodes"
            )
        if len(lanes) < spec.replicas:
            raise InvalidArgument(
                "replicas", f"is {spec.replicas}, but the cluster has room for {len(lanes)} lane(s)"
            )
        c_port = _port(spec.coordinator_port)
        ex_host = ex_info.address.rpartition(":")[0]
        topo = fleet_topology(
            spec, shards, endpoint(spec, ex_host, c_port), endpoint(spec, ex_host, exporter_port), lanes
        )
        topo.save(spec.topology)
        c_args = ["coordinator", "--topology", str(spec.topology.resolve()), "--log-format", "json"]
        c_args += [*spec.extra_coordinator_args, *_server_args(spec, c_port)]
        _, c_info = start_actor(COORDINATOR, c_args, spec, head)
        names.append(COORDINATOR)
        g_info = None
        if spec.gateway_port is not None:
            model_name = json.loads((shards / "manifest.json").read_text())["model"]["name"]
            g_args = ["serve-openai", "--coordinator", c_info.address, "--model-name", model_name]
            g_args += ["--host", "{host}", "--port", str(_port(spec.gateway_port)), "--log-format", "json"]
            g_args += ["--allow-plaintext"]  # on the node's address, plaintext like the rest of this fleet
            _, g_info = start_actor(GATEWAY, g_args, spec, head)
            names.append(GATEWAY)
    except BaseException:
        remove(names)
        raise
    return RayFleet(spec, fp, shards, ex_info, c_info, g_info, lanes)


def remove(names: list[str]) -> list[str]:
    """Stop and remove the named actors of the fleet and the lanes' placement groups; returns
    the names that were running."""
    stopped = []
    for name in dict.fromkeys(names):
        try:
            actor = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            continue
        with contextlib.suppress(Exception):  # gone already: killing it below is all that is left
            ray.get(actor.stop.remote(), timeout=30)
        ray.kill(actor, no_restart=True)
        stopped.append(name)
    for pg in placement_group_table().values():
        if pg.get("name", "").startswith(LANE_GROUP) and pg.get("state") != "REMOVED":
            with contextlib.suppress(ValueError):
                remove_placement_group(get_placement_group(pg["name"]))
    return stopped


def save_state(fleet: RayFleet, path: Path, address: str) -> None:
    """What ``down`` needs: the cluster's address and the actors' names."""
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"address": address, "actors": fleet.actor_names, "coordinator": asdict(fleet.coordinator)}
    path.write_text(json.dumps(state, indent=1))
