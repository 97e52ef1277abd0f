"""config/topology.yaml: where every process of a fleet listens and which shards it serves.

``make up`` writes it; ``make run-stage STAGE=k`` and the coordinator read it. Default ports
(docs/SERVICES.md): coordinator 50051, stage k 50061+k, exporter 50071; metrics 9100 + the same
offset. Each stage may name its OpenVINO device (``device``, default CPU).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from pipeshard.errors import InvalidArgument
from pipeshard.precision import DEFAULT_PRECISION
from pipeshard.shard.device import DEFAULT_DEVICE

COORDINATOR_PORT = 50051
STAGE_PORT_BASE = 50061
EXPORTER_PORT = 50071
METRICS_OFFSET = 9100 - 50000


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


def _endpoint(host: str, port: int) -> Endpoint:
    return Endpoint(host=host, port=port, metrics_port=port + METRICS_OFFSET)


@dataclass
class Topology:
    shards: str  # export folder (manifest.json and one folder per stage)
    coordinator: Endpoint
    exporter: Endpoint
    stages: list[StageEndpoint] = field(default_factory=list)
    precision: str = DEFAULT_PRECISION

    @classmethod
    def loopback(
        cls,
        shards: str,
        num_stages: int,
        precision: str = DEFAULT_PRECISION,
        host: str = "127.0.0.1",
        device: str = DEFAULT_DEVICE,
    ):
        ports = [STAGE_PORT_BASE + k for k in range(num_stages)]
        return cls(
            shards=shards,
            coordinator=_endpoint(host, COORDINATOR_PORT),
            exporter=_endpoint(host, EXPORTER_PORT),
            stages=[StageEndpoint(host, port, port + METRICS_OFFSET, device) for port in ports],
            precision=precision,
        )

    def stage_addresses(self) -> list[str]:
        return [s.address for s in self.stages]

    def next_hop(self, stage: int) -> str | None:
        return self.stages[stage + 1].address if stage + 1 < len(self.stages) else None

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(asdict(self), sort_keys=False))

    @classmethod
    def load(cls, path: Path) -> Topology:
        if not path.is_file():
            raise InvalidArgument("topology", f"no topology file at {path} (run `make up` to write one)")
        raw = yaml.safe_load(path.read_text())
        try:
            return cls(
                shards=raw["shards"],
                coordinator=Endpoint(**raw["coordinator"]),
                exporter=Endpoint(**raw["exporter"]),
                stages=[StageEndpoint(**s) for s in raw["stages"]],
                precision=raw.get("precision", DEFAULT_PRECISION),
            )
        except (KeyError, TypeError) as exc:
            raise InvalidArgument("topology", f"{path} is malformed ({exc})") from None

    def stage(self, index: int) -> StageEndpoint:
        if not 0 <= index < len(self.stages):
            raise InvalidArgument("stage", f"must be in [0, {len(self.stages) - 1}], got {index}")
        return self.stages[index]
