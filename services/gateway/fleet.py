"""The fleet view of the /ui page: ``pipeshard top``'s snapshot (fleet_status.py) as JSON.

The gateway knows only its coordinator; the stages, lanes and metrics ports are in the topology
file `make up` writes (``--topology``). Reads go through the same public interfaces as `pipeshard
top` (GetStageInfo, health, /metrics), in a worker thread, at most once per ``min_interval_s``
however many pages poll: rates (tok/s, step time) are over the interval between two reads.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from pipeshard.errors import PipeshardError
from pipeshard.services.fleet_status import FleetReader, FleetSnapshot
from pipeshard.services.gateway.errors import GatewayError
from pipeshard.shard.manifest import load_manifest
from pipeshard.topology import Topology


@dataclass
class ModelFacts:
    """What the page says about the served model (from the export's manifest, when readable)."""

    name: str
    family: str = ""
    layers: int = 0
    weights: str = ""
    max_context: int = 0
    split: tuple[int, ...] = ()


def model_facts(topo: Topology, fallback: str) -> ModelFacts:
    try:
        manifest = load_manifest(Path(topo.shards))
    except (OSError, PipeshardError):  # the export lives on another host
        return ModelFacts(fallback)
    m = manifest.model
    family = str(m.spec.get("family", ""))
    return ModelFacts(
        m.name, family, m.num_layers, manifest.weights.format, manifest.max_context, manifest.split
    )


class FleetWatch:
    """Reads the fleet for /fleet, sharing one read among the pages polling it."""

    def __init__(self, topology: Path | None, model_name: str, min_interval_s: float = 1.0):
        self.topology = topology
        self.model_name = model_name
        self.min_interval_s = min_interval_s
        self._view: FleetReader | None = None
        self._read_at = -1  # the topology file's mtime when read
        self._model: ModelFacts | None = None
        self._last: tuple[float, dict] | None = None
        self._lock = asyncio.Lock()

    def _read(self) -> dict:
        if self.topology is None:
            raise GatewayError(
                404,
                "this gateway has no fleet view: start it with --topology (the file `make up` writes)",
                param="topology",
                code="no_topology",
            )
        try:
            changed = self.topology.stat().st_mtime_ns
        except OSError:
            changed = -1
        if self._view is None or changed != self._read_at:  # `pipeshard fleet drain|add` rewrites it
            try:
                topo = Topology.load(self.topology)
            except PipeshardError as exc:
                raise GatewayError(503, str(exc), param="topology") from None
            self._view, self._read_at = FleetReader(topo), changed
            self._model = model_facts(topo, self.model_name)
        snapshot: FleetSnapshot = self._view.snapshot()
        return {
            "model": asdict(self._model) if self._model else {"name": self.model_name},
            "precision": self._view.topo.precision,
            "lanes": len(self._view.topo.lanes),
            "stages": [
                {"label": s.label, "stage": s.stage, "lane": s.lane, "node": s.node, **asdict(s.row)}
                for s in snapshot.stages
            ],
            "coordinators": [asdict(c) for c in snapshot.coordinators],
        }

    async def read(self) -> dict:
        async with self._lock:
            now = time.monotonic()
            if self._last is None or now - self._last[0] >= self.min_interval_s:
                self._last = (now, await asyncio.to_thread(self._read))
            return self._last[1]
