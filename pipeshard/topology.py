"""config/topology.yaml: where every process of a fleet listens and which shards it serves.

``make up`` writes it; ``make run-stage STAGE=k`` and the coordinator read it. Default ports
(docs/SERVICES.md): coordinator 50051, stage k 50061+k, exporter 50071; metrics 9100 + the same
offset. Each stage may name its OpenVINO device (``device``, default CPU). ``invariant_ladder``
(optional, empty: each backend's default) is what every stage at ``invariant`` tries, fastest
first (``pipeshard up --invariant-ladder``), so a stage started from the file alone gets it too.

Replicas: ``replicas`` lists further lanes, each one process per stage (replica r of stage k on
50061 + k + 20r by default); ``stages`` is lane 0. Replica r of a stage may forward to every
replica of the next, its own lane's first (per-hop routing: the coordinator routes each session
per stage, docs/ARCHITECTURE.md), so a lane is only the route sessions start on.

Coordinators in a group: ``group`` lists the coordinators after the first (``coordinator``), each
over the same stages (coordinator c on 50051 + c by default, metrics beside it); ``pipeshard top``
and the gateway's /ui list every one (``coordinators``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import yaml

from pipeshard.errors import InvalidArgument
from pipeshard.precision import DEFAULT_PRECISION, ladder
from pipeshard.shard.device import DEFAULT_DEVICE

COORDINATOR_PORT = 50051
STAGE_PORT_BASE = 50061
EXPORTER_PORT = 50071
METRICS_OFFSET = 9100 - 50000
REPLICA_PORT_STRIDE = 20  # replica r of stage k listens on STAGE_PORT_BASE + k + 20r
LANE_SEPARATOR = "|"  # `--stages A0|A1,B0|B1`: stage k's replicas, one per lane


@dataclass
class Endpoint:
    host: str
    port: int
    metrics_port: int

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass
class StageEndpoint(Endpoint):
    device: str = DEFAULT_DEVICE  # the OpenVINO device this stage compiles for
    node: str = ""  # the machine it runs on when known (a Ray fleet's node id, docs/RAY.md)


def fleet_ports(port: int | None, metrics_port: int | None, default: int) -> tuple[int, int]:
    """A fleet process's gRPC and metrics ports: unset, the fleet's ``default`` port and the
    metrics port beside it (50061 -> 9161, for `pipeshard top`); a port given (0: ephemeral)
    leaves unset metrics off, so no two processes meet on a derived metrics port."""
    if port is None:
        return default, default + METRICS_OFFSET if metrics_port is None else metrics_port
    return port, 0 if metrics_port is None else metrics_port


def _endpoint(host: str, port: int) -> Endpoint:
    return Endpoint(host=host, port=port, metrics_port=port + METRICS_OFFSET)


@dataclass
class Topology:
    shards: str  # export folder (manifest.json and one folder per stage)
    coordinator: Endpoint
    exporter: Endpoint
    stages: list[StageEndpoint] = field(default_factory=list)
    precision: str = DEFAULT_PRECISION
    replicas: list[list[StageEndpoint]] = field(default_factory=list)  # lanes 1.., each one per stage
    invariant_ladder: str = ""  # the configurations stages at `invariant` try (precision.ladder)
    group: list[Endpoint] = field(default_factory=list)  # the group's coordinators 1.. (docs/RELIABILITY.md)

    @classmethod
    def loopback(
        cls,
        shards: str,
        num_stages: int,
        precision: str = DEFAULT_PRECISION,
        host: str = "127.0.0.1",
        device: str = DEFAULT_DEVICE,
        replicas: int = 1,
        stage_port_base: int = STAGE_PORT_BASE,
        invariant_ladder: str = "",
        coordinators: int = 1,
    ):
        if replicas < 1:
            raise InvalidArgument("replicas", f"must be at least 1, got {replicas}")
        if coordinators < 1:
            raise InvalidArgument("coordinators", f"must be at least 1, got {coordinators}")

        def lane(r: int) -> list[StageEndpoint]:
            ports = [stage_port_base + k + REPLICA_PORT_STRIDE * r for k in range(num_stages)]
            return [StageEndpoint(host, port, port + METRICS_OFFSET, device) for port in ports]

        return cls(
            shards=shards,
            coordinator=_endpoint(host, COORDINATOR_PORT),
            exporter=_endpoint(host, EXPORTER_PORT),
            stages=lane(0),
            precision=precision,
            replicas=[lane(r) for r in range(1, replicas)],
            invariant_ladder=invariant_ladder,
            group=[_endpoint(host, COORDINATOR_PORT + c) for c in range(1, coordinators)],
        )

    @property
    def coordinators(self) -> list[Endpoint]:
        """Every coordinator of the group, the first (``coordinator``) first."""
        return [self.coordinator, *self.group]

    @property
    def lanes(self) -> list[list[StageEndpoint]]:
        """Every lane (one replica of each stage, in pipeline order); lane 0 is ``stages``."""
        return [self.stages, *self.replicas]

    def stage_addresses(self) -> list[str]:
        """Each stage's addresses for ``--stages``: its replicas joined by ``|``, one per lane."""
        return [LANE_SEPARATOR.join(lane[k].address for lane in self.lanes) for k in range(len(self.stages))]

    def next_hop(self, stage: int, replica: int = 0) -> str | None:
        """Where replica ``replica`` of ``stage`` forwards (``--next-hop``): every replica of the
        next stage, comma-separated, the same lane's first; None for the final stage."""
        self.stage(stage, replica)  # both in range
        if stage + 1 >= len(self.stages):
            return None
        lanes = [self.lanes[replica], *(lane for r, lane in enumerate(self.lanes) if r != replica)]
        return ",".join(lane[stage + 1].address for lane in lanes)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(asdict(self), sort_keys=False))

    @classmethod
    def load(cls, path: Path) -> Topology:
        if not path.is_file():
            raise InvalidArgument("topology", f"no topology file at {path} (run `make up` to write one)")
        raw = yaml.safe_load(path.read_text())
        try:
            topo = cls(
                shards=raw["shards"],
                coordinator=Endpoint(**raw["coordinator"]),
                exporter=Endpoint(**raw["exporter"]),
                stages=[StageEndpoint(**s) for s in raw["stages"]],
                precision=raw.get("precision", DEFAULT_PRECISION),
                replicas=[[StageEndpoint(**s) for s in lane] for lane in raw.get("replicas", [])],
                invariant_ladder=str(raw.get("invariant_ladder") or ""),
                group=[Endpoint(**c) for c in raw.get("group") or []],
            )
        except (KeyError, TypeError) as exc:
            raise InvalidArgument("topology", f"{path} is malformed ({exc})") from None
        ladder(topo.invariant_ladder)  # an unknown configuration is refused, naming invariant_ladder
        for r, lane in enumerate(topo.replicas, start=1):
            if len(lane) != len(topo.stages):
                raise InvalidArgument(
                    "replicas", f"lane {r} of {path} lists {len(lane)} stages, not {len(topo.stages)}"
                )
        return topo

    def without_lane(self, address: str) -> Topology:
        """This topology less the lane holding the stage at ``address`` (``pipeshard fleet drain``)."""
        lanes = [lane for lane in self.lanes if address not in (s.address for s in lane)]
        if len(lanes) == len(self.lanes):
            raise InvalidArgument("stage_addr", f"no lane of the topology has a stage at {address}")
        if not lanes:
            raise InvalidArgument("stage_addr", f"{address} is in the only lane left; stop the fleet instead")
        return replace(self, stages=lanes[0], replicas=lanes[1:])

    def with_lane(self, addresses: list[str]) -> Topology:
        """This topology plus a lane: one replica of every stage, ``host:port`` in pipeline order."""
        if len(addresses) != len(self.stages):
            raise InvalidArgument("stages", f"must list {len(self.stages)} addresses, got {len(addresses)}")
        lane = []
        for k, address in enumerate(addresses):
            host, _, port = address.rpartition(":")
            if not host or not port.isdigit():
                raise InvalidArgument("stages", f"must be host:port, got {address!r}")
            if any(address in (s.address for s in known) for known in self.lanes):
                raise InvalidArgument("stages", f"{address} is already in the topology")
            lane.append(StageEndpoint(host, int(port), int(port) + METRICS_OFFSET, self.stages[k].device))
        return replace(self, replicas=[*self.replicas, lane])

    def stage(self, index: int, replica: int = 0) -> StageEndpoint:
        if not 0 <= index < len(self.stages):
            raise InvalidArgument("stage", f"must be in [0, {len(self.stages) - 1}], got {index}")
        if not 0 <= replica < len(self.lanes):
            raise InvalidArgument("replica", f"must be in [0, {len(self.lanes) - 1}], got {replica}")
        return self.lanes[replica][index]
