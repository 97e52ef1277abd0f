"""``pipeshard up --ray``: the fleet's services as Ray actors, placed by the planner.

The exporter, coordinator and gateway run on the node of the machine that ran ``up`` (it holds the
exports); every stage runs in its lane's placement group and pulls only its own shard from the
exporter into its node's folder. The coordinator reads a topology file written from the stage
actors' reports, never by hand. Everything is a detached named actor in the ``pipeshard``
namespace, so it outlives ``up``; ``pipeshard down`` removes exactly those (names in run/ray.json).
With ``secure`` every link is mutual TLS as in ``make up SECURE=1``: a signer actor holding the
fleet CA on the head certifies the key each actor makes on its node (``certify``).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import ray
from ray.util.placement_group import (
    PlacementGroup,
    get_placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from pipeshard.errors import FailedPrecondition, InvalidArgument
from pipeshard.paths import DEFAULT_MODEL
from pipeshard.precision import DEFAULT_PRECISION
from pipeshard.services.launcher import stage_name
from pipeshard.services.raycluster.actors import NAMESPACE, ServiceActor, ServiceInfo, free_port
from pipeshard.services.raycluster.certify import SIGNER, Signer, verified
from pipeshard.services.raycluster.members import Member, members
from pipeshard.services.raycluster.placement import FleetPlan, choose_nodes, reserve_lane
from pipeshard.tls import CA_CERT
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
    certs: Path | None = None  # secured: the head's certs folder (fleet CA key, ca.pem, token)
    api_keys: Path | None = None  # secured: the head's `pipeshard keys` file for the coordinator and gateway

    @property
    def secure(self) -> bool:
        return self.certs is not None


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
        names += [SIGNER] if self.spec.secure else []
        return names + [s.name for lane in self.lanes for s in lane]


def head_strategy() -> NodeAffinitySchedulingStrategy:
    """This machine's node: the exporter, coordinator and gateway live where the exports are."""
    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)


def _port(port: int) -> int:
    return port or free_port()


def _metered(spec: RaySpec, port: int) -> list[str]:
    """Metrics on the node's address, where `pipeshard top` on another node reads them (plaintext
    and unauthenticated, as with `make up`: docs/RAY.md, "Security")."""
    if not spec.metrics:
        return []
    return ["--metrics-port", str(port + METRICS_OFFSET), "--metrics-host", "{host}"]


def _server_args(spec: RaySpec, port: int) -> list[str]:
    """Every service listens on its node's address: TLS when secured, else plaintext said so."""
    plain = [] if spec.secure else ["--allow-plaintext"]
    return ["--host", "{host}", "--port", str(port), *plain, *_metered(spec, port)]


def launch_actor(name: str, args: list[str], spec: RaySpec, strategy, role: str, *, restarts: int = 0):
    """Actor ``name`` starting ``pipeshard ARGS`` (not waited for); secured, with a certificate of
    ``role``."""
    signer = ray.get_actor(SIGNER, namespace=NAMESPACE) if spec.secure else None
    keys = {"PIPESHARD_API_KEYS": str(spec.api_keys)} if spec.api_keys and role != "stage" else {}
    actor = ServiceActor.options(  # type: ignore[attr-defined]  # ray.remote returns an ActorClass; its stubs say the class
        name=name,
        namespace=NAMESPACE,
        lifetime="detached",
        max_restarts=restarts,
        max_task_retries=-1 if restarts else 0,
        scheduling_strategy=strategy,
    ).remote(
        name,
        args,
        str(spec.work_dir),
        keys,
        spec.timeout_s,
        role if spec.secure else None,
        signer,
    )
    return actor


def start_actor(name: str, args: list[str], spec: RaySpec, strategy, role: str):
    """``launch_actor`` and wait until its service listens: (handle, where it runs)."""
    actor = launch_actor(name, args, spec, strategy, role)
    return actor, ray.get(actor.info.remote(), timeout=spec.timeout_s + 60)


def start_signer(spec: RaySpec):
    """The fleet CA's signer on this (the head's) node: it reads the CA key from ``spec.certs``."""
    signer = Signer.options(  # type: ignore[attr-defined]  # ray.remote returns an ActorClass; its stubs say the class
        name=SIGNER, namespace=NAMESPACE, lifetime="detached", scheduling_strategy=head_strategy()
    ).remote(str(spec.certs))
    ray.get(signer.prove.remote("ready"), timeout=spec.timeout_s)
    return signer


def stage_port(spec: RaySpec, k: int, r: int) -> int:
    """Replica r of stage k keeps one port wherever Ray restarts it (its lane's next hop stays)."""
    return spec.stage_port_base + k + REPLICA_PORT_STRIDE * r if spec.stage_port_base else free_port()


@dataclass(frozen=True)
class Planned:
    """Where a stage that is starting will listen, known before it starts."""

    address: str
    node_id: str


@dataclass
class Launch:
    """A lane whose actors are starting: its group, and each stage's actor in pipeline order."""

    r: int
    group: PlacementGroup
    actors: list
    planned: list[Planned]  # where each stage will listen: its pinned node's address and its port

    def wait(self, spec: RaySpec) -> list[ServiceInfo]:
        """Each stage's report once it listens; on a failure the lane is removed and it raises."""
        try:
            return ray.get([a.info.remote() for a in self.actors], timeout=spec.timeout_s + 60)
        except BaseException:
            for actor in self.actors:
                ray.kill(actor, no_restart=True)
            remove_placement_group(self.group)
            raise


def launch_lane(
    spec: RaySpec,
    fp: FleetPlan,
    shards: Path,
    exporter: str,
    r: int,
    alive: list[Member],
    avoid: str | None = None,
) -> Launch | None:
    """Lane ``r`` in its own placement group pinned to nodes of ``alive`` (``choose_nodes``), every
    stage started at once: each one's node and port, so its next hop, are known before any starts.
    None when the cluster has no room for it now."""
    nodes = choose_nodes(fp, alive, avoid)
    pg = None if nodes is None else reserve_lane(fp, f"{LANE_GROUP}{r}", nodes, spec.lane_timeout_s)
    if pg is None or nodes is None:
        return None
    ip = {m.node_id: m.ip for m in alive}
    ports = [stage_port(spec, k, r) for k in range(len(nodes))]
    planned = [Planned(f"{ip[node]}:{port}", node) for node, port in zip(nodes, ports, strict=True)]
    hops = [p.address for p in planned[1:]]
    actors = []
    for k, port in enumerate(ports):
        args = ["stage", "--stage", str(k), "--shards", f"{{run}}/shards/{shards.name}"]
        args += ["--exporter", exporter, "--precision", spec.precision, "--log-format", "json"]
        args += [*spec.extra_stage_args, *_server_args(spec, port)]
        args += ["--next-hop", hops[k]] if k < len(hops) else []
        strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=k)
        actors.append(launch_actor(stage_name(k, r), args, spec, strategy, "stage", restarts=-1))
    return Launch(r, pg, actors, planned)


def start_lane(
    spec: RaySpec,
    fp: FleetPlan,
    shards: Path,
    exporter: str,
    r: int,
    alive: list[Member],
    avoid: str | None = None,
) -> list[ServiceInfo] | None:
    """``launch_lane`` and wait for its stages; None when the cluster has no room for it now."""
    launch = launch_lane(spec, fp, shards, exporter, r, alive, avoid)
    return None if launch is None else launch.wait(spec)


def endpoint(spec: RaySpec, host: str, port: int) -> Endpoint:
    return Endpoint(host, port, port + METRICS_OFFSET if spec.metrics else 0)


def fleet_topology(spec: RaySpec, shards: Path, coordinator: Endpoint, exporter: Endpoint, lanes) -> Topology:
    """The coordinator's topology file from the stage actors' reports (or their planned places)."""

    def end(info: ServiceInfo | Planned) -> StageEndpoint:
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
    """Start the fleet of ``fp`` on its members; on any failure what was started is removed again."""
    names: list[str] = []
    try:
        head = head_strategy()
        if spec.secure and not _alive(SIGNER):
            start_signer(spec)
            names.append(SIGNER)
        exporter_port = _port(spec.exporter_port)
        ex_args = ["exporter-service", "--shards-dir", str(spec.shards_root), "--log-format", "json"]
        ex_args += _server_args(spec, exporter_port)
        exporter, ex_info = start_actor(EXPORTER, ex_args, spec, head, "exporter")
        names.append(EXPORTER)
        shards = ensure_export(spec, fp, exporter)
        launched: list[Launch] = []
        while len(launched) < spec.replicas:  # every lane reserved, then all their stages start at once
            launch = launch_lane(spec, fp, shards, ex_info.address, len(launched), list(fp.members))
            if launch is None:
                break
            launched.append(launch)
            names += [stage_name(k, launch.r) for k in range(len(launch.actors))]
        if not launched:
            raise InvalidArgument(
                "ray", f"no room for a lane: its stages need {fp.stage_memory} bytes on distinct nodes"
            )
        if len(launched) < spec.replicas:
            raise InvalidArgument(
                "replicas", f"is {spec.replicas}, but the cluster has room for {len(launched)} lane(s)"
            )
        # the coordinator starts beside the stages: it knows where they will listen and waits for them
        c_port = _port(spec.coordinator_port)
        ex_host = ex_info.address.rpartition(":")[0]
        ends = endpoint(spec, ex_host, c_port), endpoint(spec, ex_host, exporter_port)
        fleet_topology(spec, shards, *ends, [launch.planned for launch in launched]).save(spec.topology)
        c_args = ["coordinator", "--topology", str(spec.topology.resolve()), "--log-format", "json"]
        c_args += ["--speculative", "auto"]  # as `make up`: the source measured fastest, or plain
        c_args += [*spec.extra_coordinator_args, *_server_args(spec, c_port)]
        coordinator = launch_actor(COORDINATOR, c_args, spec, head, "coordinator")
        names.append(COORDINATOR)
        lanes = [launch.wait(spec) for launch in launched]
        for launch, lane in zip(launched, lanes, strict=True):
            if [s.address for s in lane] != [p.address for p in launch.planned]:
                raise FailedPrecondition(
                    f"lane {launch.r} listens on {[s.address for s in lane]}, not where it was placed "
                    f"({[p.address for p in launch.planned]}): Ray's node addresses disagree"
                )
        c_info = ray.get(coordinator.info.remote(), timeout=spec.timeout_s + 60)
        g_info = None
        if spec.gateway_port is not None:
            model_name = json.loads((shards / "manifest.json").read_text())["model"]["name"]
            g_args = ["serve-openai", "--coordinator", c_info.address, "--model-name", model_name]
            g_args += ["--host", "{host}", "--port", str(_port(spec.gateway_port)), "--log-format", "json"]
            if spec.secure:  # HTTPS with the certificate the signer issued to it on this node
                g_args += ["--tls-cert", "{tls}/gateway.pem", "--tls-key", "{tls}/gateway.key"]
            else:  # on the node's address, plaintext like the rest of this fleet
                g_args += ["--allow-plaintext"]
            _, g_info = start_actor(GATEWAY, g_args, spec, head, "gateway")
            names.append(GATEWAY)
    except BaseException:
        remove(names)
        raise
    return RayFleet(spec, fp, shards, ex_info, c_info, g_info, lanes)


def fleet_members(spec: RaySpec, trusted: set[str] | None = None) -> tuple[list[Member], list[Member]]:
    """The alive nodes that may take stages, and those refused: secured, only the nodes that prove
    they hold the fleet's CA and token (``certify``); those in ``trusted`` (node ids) proved it
    before, and ``trusted`` gains the new ones."""
    found = members()
    if not spec.secure or spec.certs is None:
        return found, []
    known = trusted if trusted is not None else set()
    signer = ray.get_actor(SIGNER, namespace=NAMESPACE)
    ca_pem = (spec.certs / CA_CERT).read_bytes()
    good, bad = verified(signer, [m for m in found if m.node_id not in known], ca_pem)
    known.update(m.node_id for m in good)
    return [m for m in found if m.node_id in known], bad


def _alive(name: str) -> bool:
    try:
        ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return False
    return True


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
