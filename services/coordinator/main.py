"""``pipeshard coordinator``: serve Generate over a ring of stage services."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from pipeshard.errors import InvalidArgument
from pipeshard.grpc_server import run_server
from pipeshard.offline import set_offline_defaults
from pipeshard.services.coordinator.admission import Admission
from pipeshard.services.coordinator.generation import Generation
from pipeshard.services.coordinator.local_stage import LocalEntry, LocalStageStub
from pipeshard.services.coordinator.ring import Ring
from pipeshard.services.coordinator.servicer import CoordinatorServicer
from pipeshard.services.coordinator.speculation.sources import DraftSources
from pipeshard.services.stage.main import StageSettings, build_node
from pipeshard.services.stage.servicer import StageServicer
from pipeshard.settings import ServerSettings, load_settings, setting
from pipeshard.shard.prompting import Prompter
from pipeshard.topology import Topology
from pipeshard.v1 import coordinator_pb2_grpc


@dataclass
class CoordinatorSettings(ServerSettings):
    topology: Path | None = setting(
        None, "topology file (config/topology.yaml) giving ports, stages and shards"
    )
    stages: list[str] = setting(
        default_factory=list, help="stage addresses in pipeline order (host:port,...)"
    )
    shards: Path | None = setting(None, "export folder: its manifest and tokenizer files are read")
    step_timeout_s: float = setting(30.0, "a step with no result after this long fails as UNAVAILABLE")
    ready_timeout_s: float = setting(120.0, "how long to wait at start for every stage to answer")
    default_max_tokens: int = setting(256, "max_tokens of a request that does not set it")
    max_running: int = setting(8, "generations running at once (each holds a session on every stage)")
    max_queue: int = setting(32, "requests waiting for a slot; beyond it RESOURCE_EXHAUSTED")
    prefill_chunk: int = setting(256, "prompt tokens per prefill step (fixed: outputs never depend on load)")
    host_stage0: bool = setting(False, "run stage 0 in this process; --stages then lists stages 1..N-1")
    precision: str = setting("default", "inference precision of a hosted stage 0", choices=("default", "f32"))
    speculative: str = setting(
        "none", "speculation of requests that do not choose: none, ngram, self or a draft model folder"
    )
    self_draft: Path | None = setting(
        None, "self-draft export (pipeshard export --draft-layers K) used by `--speculative self`"
    )
    draft_cache: Path | None = setting(
        None, "where Hugging Face draft folders are exported on first use (default: <shards>/../.drafts)"
    )
    max_k: int = setting(10, "largest draft length adaptive K may choose")
    hop_delay_ms: float = setting(
        0.0, "emulated one-way latency added to every frame sent into the ring (benchmarks)"
    )


def resolve(settings: CoordinatorSettings) -> CoordinatorSettings:
    if settings.topology is not None:
        topo = Topology.load(settings.topology)
        settings.stages = settings.stages or topo.stage_addresses()
        settings.shards = settings.shards or Path(topo.shards)
        settings.port = settings.port or topo.coordinator.port
        settings.metrics_port = settings.metrics_port or topo.coordinator.metrics_port
    if not settings.stages:
        raise InvalidArgument("stages", "must list at least one stage address (or give --topology)")
    if settings.shards is None:
        raise InvalidArgument("shards", "is required (or give --topology)")
    if not 1 <= settings.max_k <= 32:
        raise InvalidArgument("max_k", f"must be in 1..32, got {settings.max_k}")
    if settings.speculative == "self" and settings.self_draft is None:
        raise InvalidArgument("speculative", "self needs --self-draft DIR")
    return settings


@dataclass
class Coordinator:
    """Everything one coordinator process holds; built inside the running event loop."""

    settings: CoordinatorSettings
    ring: Ring = field(init=False)
    servicer: CoordinatorServicer = field(init=False)

    async def start(self) -> None:
        manifest = json.loads((Path(self.settings.shards) / "manifest.json").read_text())
        remote = manifest["num_stages"] - (1 if self.settings.host_stage0 else 0)
        if remote != len(self.settings.stages):
            raise InvalidArgument(
                "stages",
                f"lists {len(self.settings.stages)} addresses; this {manifest['num_stages']}-stage export "
                f"needs {remote} remote stages"
                + (" (stage 0 hosted here)" if self.settings.host_stage0 else ""),
            )
        prompter = Prompter.from_dir(Path(self.settings.shards))
        local = self._local_stage0() if self.settings.host_stage0 else None
        self.ring = Ring(
            self.settings.stages,
            step_timeout_s=self.settings.step_timeout_s,
            local_stage0=local,
            hop_delay_s=self.settings.hop_delay_ms / 1000.0,
        )
        await self.ring.start()
        await self.ring.wait_ready(self.settings.ready_timeout_s)
        self.servicer = CoordinatorServicer(
            Generation(
                self.ring,
                prompter.tokenizer,
                prompter.eos_ids,
                prefill_chunk=self.settings.prefill_chunk,
                drafts=DraftSources(
                    Path(self.settings.shards),
                    self_draft=self.settings.self_draft,
                    draft_cache=self.settings.draft_cache,
                ),
                default_speculative=self.settings.speculative,
                max_k=self.settings.max_k,
            ),
            prompter,
            max_context=manifest["max_context"],
            vocab_size=manifest["model"]["vocab_size"],
            default_max_tokens=self.settings.default_max_tokens,
            admission=Admission(self.settings.max_running, self.settings.max_queue),
        )

    def _local_stage0(self) -> tuple[LocalEntry, LocalStageStub]:
        stage = StageSettings(
            stage=0,
            shards=self.settings.shards,
            next_hop=self.settings.stages[0],
            precision=self.settings.precision,
            hop_delay_ms=self.settings.hop_delay_ms,
        )
        node, info = build_node(stage)
        return LocalEntry(node), LocalStageStub(StageServicer(node, info))

    async def close(self) -> None:
        await self.ring.close()


def main(argv: list[str] | None = None) -> int:
    set_offline_defaults()
    settings = resolve(load_settings(CoordinatorSettings, argv, prog="pipeshard coordinator"))
    coordinator = Coordinator(settings)

    async def services():
        await coordinator.start()
        return [(coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server, coordinator.servicer)]

    return run_server(settings, services, name="coordinator", shutdown_hooks=[coordinator.close])
