"""``pipeshard coordinator``: serve Generate over a ring of stage services."""

from __future__ import annotations

import asyncio
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from pipeshard import allocator
from pipeshard.auth import Authenticator
from pipeshard.errors import FailedPrecondition, InvalidArgument, NotFound, PipeshardError
from pipeshard.grpc_server import GrpcServer, run_server
from pipeshard.metrics import (
    COORDINATOR_QUEUED,
    COORDINATOR_RUNNING,
    IDENTITY_LABEL_MODES,
    set_identity_labels,
)
from pipeshard.offline import set_offline_defaults
from pipeshard.ownership import new_secret
from pipeshard.precision import DEFAULT_PRECISION, PRECISIONS
from pipeshard.services.coordinator.draft_watch import DraftWatch, say_default
from pipeshard.services.coordinator.failover import Failover
from pipeshard.services.coordinator.fleet_kv import FleetKv
from pipeshard.services.coordinator.fleet_promise import fleet_promise
from pipeshard.services.coordinator.generation import DEFAULT_PREFILL_CHUNK, Chunk, Generation
from pipeshard.services.coordinator.grammar import Grammars
from pipeshard.services.coordinator.kv_mirror import KvMirror
from pipeshard.services.coordinator.kv_standby import KvStandby
from pipeshard.services.coordinator.local_stage import LocalEntry, LocalStageStub
from pipeshard.services.coordinator.prefix_cache import PrefixIndex
from pipeshard.services.coordinator.remote_stages import PendingSteps, RemoteStages
from pipeshard.services.coordinator.replicas import ReplicaLanes
from pipeshard.services.coordinator.ring import Ring
from pipeshard.services.coordinator.sampling import SamplingParams
from pipeshard.services.coordinator.scheduler import Scheduler
from pipeshard.services.coordinator.servicer import CoordinatorServicer
from pipeshard.services.coordinator.speculation.choice import AUTO, among
from pipeshard.services.coordinator.speculation.depth import AUTO_MAX_DEPTH, MAX_DEPTH
from pipeshard.services.coordinator.speculation.sources import MODES, DraftSources, parse_named
from pipeshard.services.stage.backends import KV_CHOICES
from pipeshard.services.stage.main import StageSettings, build_node
from pipeshard.services.stage.servicer import StageServicer
from pipeshard.settings import LOOPBACK, ServerSettings, load_settings, setting
from pipeshard.shard.manifest import load_manifest, verify_root_files, verify_shard
from pipeshard.shard.prompting import Prompter
from pipeshard.shard.pull import pull_root_files, pull_shard
from pipeshard.shard.runtime import WARMUP_PREFILL
from pipeshard.shard.serving import hold_serving_lock
from pipeshard.tls import TlsConfig
from pipeshard.topology import COORDINATOR_PORT, LANE_SEPARATOR, Topology, fleet_ports
from pipeshard.v1 import coordinator_pb2, coordinator_pb2_grpc, stage_pb2

log = structlog.get_logger(__name__)

PREFIX_CACHE_MODES = ("on", "off")


@dataclass
class CoordinatorSettings(ServerSettings):
    port: int | None = setting(None, "gRPC port (default: the topology's, else 50051; 0 = ephemeral)")
    metrics_port: int | None = setting(
        None,
        "Prometheus /metrics port, read by `pipeshard top` (default: the topology's, else 9151; off "
        "when --port is given; 0 = off)",
    )
    topology: Path | None = setting(
        None,
        "topology file (config/topology.yaml) giving ports, stages and shards; re-read on SIGHUP for "
        "its replica lanes (removed ones drain, new ones join)",
    )
    stages: list[str] = setting(
        default_factory=list,
        help="stage addresses in pipeline order (host:port,...); replicas of a stage joined by | "
        "(A0|A1,B0|B1: replica r of every stage is lane r, docs/RELIABILITY.md)",
    )
    shards: Path | None = setting(None, "export folder: its manifest and tokenizer files are read")
    exporter: str | None = setting(
        None,
        "exporter (host:port) to pull the export's manifest and tokenizer from when --shards lacks "
        "them (with --host-stage0, stage 0's shard), the export named as the --shards folder is; "
        "with --topology, the topology's exporter",
    )
    step_timeout_s: float = setting(
        30.0,
        "a step with no result after this long fails as UNAVAILABLE (per 256 rows of a prefill; "
        "longer when the ring's measured time per row asks for it, docs/RELIABILITY.md)",
    )
    control_timeout_s: float = setting(
        30.0,
        "a control call (open, release, prefix keep) a stage has not answered after this long fails "
        "as UNAVAILABLE naming the stage and the call; on a loaded machine a stage busy computing "
        "answers late",
    )
    ready_timeout_s: float = setting(120.0, "how long to wait at start for every stage to answer")
    default_max_tokens: int = setting(256, "max_tokens of a request that does not set it")
    max_running: int = setting(
        16,
        "generations running at once (each holds a session on every stage; capped by the sessions a "
        "stage lets this coordinator hold); on paged stages also only as many as their KV pools hold",
    )
    max_queue: int = setting(128, "requests waiting for a slot, all identities; beyond it RESOURCE_EXHAUSTED")
    max_running_per_identity: int = setting(
        12,
        "generations one identity runs at once while another waits (its share); alone it may run up "
        "to --max-running, and gives the excess back as its requests end; an API key's own "
        "max_running overrides it and is a hard limit",
    )
    max_queued_per_identity: int = setting(
        32,
        "requests of one identity waiting for a slot; beyond it RESOURCE_EXHAUSTED naming this limit; "
        "an API key's own max_queued overrides it",
    )
    max_prompt_bytes: int = setting(
        256 * 1024, "largest prompt (or sum of message contents) in UTF-8 bytes, checked before tokenizing"
    )
    prefill_chunk: int = setting(
        DEFAULT_PREFILL_CHUNK,
        "prompt tokens per prefill step, fixed so outputs never depend on load; the default is one "
        "pass per prompt on stateful stages and becomes 256-token chunks on paged stages",
    )
    host_stage0: bool = setting(False, "run stage 0 in this process; --stages then lists stages 1..N-1")
    precision: str = setting(DEFAULT_PRECISION, "inference precision of a hosted stage 0", choices=PRECISIONS)
    speculative: str = setting(
        "none",
        "speculation of requests that do not choose: auto (each request gets the source measured "
        "fastest on this fleet, or plain: mix, feature and ngram as offered), none, ngram, self, "
        "feature, mix (prompt lookup where it finds a match, else the feature draft), medusa (the "
        "final stage's --draft-heads) or a --draft name",
    )
    draft: list[str] = setting(
        default_factory=list,
        help="draft folders clients may pick by name: NAME=DIR,... (an export or a same-tokenizer HF folder)",
    )
    self_draft: Path | None = setting(
        None, "self-draft export (pipeshard export --draft-layers K) used by `--speculative self`"
    )
    feature_draft: Path | None = setting(
        None,
        "trained feature draft (pipeshard distil --kind eagle) offered as `feature`; refused at start "
        "when trained for other weights",
    )
    feature_draft_watch: Path | None = setting(
        None,
        "a folder a feature draft is being trained into (`make up`'s background training): once "
        "the trainer has written it whole it is checked against these weights, loaded and made "
        "the default of new requests (running ones keep theirs); a draft failing a check is "
        "refused with a log naming why",
    )
    feature_draft_poll_s: float = setting(10.0, "seconds between looks at --feature-draft-watch")
    draft_cache: Path | None = setting(
        None, "where Hugging Face draft folders are exported on first use (default: <shards>/../.drafts)"
    )
    max_k: int = setting(10, "largest draft length adaptive K may choose")
    spec_depth: int = setting(
        0,
        "speculative steps of one request in flight at once (each built on the one before it being "
        "accepted whole): 0 chooses it from the measured round trip over the stages' compute "
        f"(at most {AUTO_MAX_DEPTH}; 1 on one node or a LAN); 1 sends one at a time",
    )
    final_stage_sampling: bool = setting(
        True, "temperature > 0: the final stage draws the tokens (ids back, not 49152 logits per position)"
    )
    tree_prune: bool = setting(
        True, "tree=auto: drop draft-tree nodes whose path probability does not pay for their position"
    )
    hop_delay_ms: float = setting(
        0.0, "emulated one-way latency added to every frame sent into the ring (benchmarks)"
    )
    prefix_cache: str = setting(
        "on",
        "reuse the KV of earlier requests' prompts that share a prefix (the stages keep it); a warm "
        "turn equals a cold one at exact precision (the default), at fast up to near-ties",
        choices=PREFIX_CACHE_MODES,
    )
    prefix_cache_scope: str = setting(
        "identity",
        "whose cached prefixes a request may reuse: its identity's own, or every identity's "
        "(shared: a common system prompt is cached once, but a hit's shorter TTFT tells one user "
        "what another has sent; docs/SECURITY.md)",
        choices=("identity", "shared"),
    )
    prefix_cache_entries: int = setting(
        16384,
        "blocks (32 tokens each) the prefix index remembers (LRU); the stages' eviction reports "
        "usually drop them sooner",
    )
    prefix_min_tokens: int = setting(64, "shortest shared prefix worth restoring instead of prefilling")
    prefix_restore_timeout_s: float = setting(
        5.0, "a prefix restore (or keep) not done on every stage by then is dropped: cold prefill"
    )
    standby_kv_bytes: int = setting(
        1 << 30,
        "replica lanes: bytes of running sessions' KV this coordinator keeps captured from their lanes, "
        "block by block, so a failover restores it instead of replaying it (0: off, every failover replays)",
    )
    metrics_identity_labels: str = setting(
        "kind",
        "what the per-identity metrics' label shows: kind (key, token or peer; the default) or names "
        "(key:NAME, peer:HOST: API-key names and callers' hosts appear in /metrics)",
        choices=IDENTITY_LABEL_MODES,
    )
    kv: str = setting(
        "auto",
        "the stages' KV backend: paged batches every running session into one plan frame per step, "
        "stateful runs each session's frames alone, static batches like paged in rows of the shards' "
        "chunk; auto follows what the stages report",
        choices=KV_CHOICES,
    )
    inflight: int = setting(
        1,
        "with --kv paged: the most batched steps travelling the stages at once, each stage working "
        "on a different one (0: one per stage; pays only where a stage's compute rivals the hop "
        "latency on its own machine: on shared cores and at 50 ms per hop it measured slower)",
    )

    @property
    def shards_dir(self) -> Path:
        """The export folder, once :func:`resolve` has filled ``shards`` in."""
        if self.shards is None:
            raise InvalidArgument("shards", "is required (or give --topology)")
        return self.shards


def resolve(settings: CoordinatorSettings) -> CoordinatorSettings:
    if settings.topology is not None:
        topo = Topology.load(settings.topology)
        settings.stages = settings.stages or topo.stage_addresses()
        settings.shards = settings.shards or Path(topo.shards)
        settings.exporter = settings.exporter or topo.exporter.address
        me = topo.coordinator
        settings.host = me.host if settings.host == LOOPBACK else settings.host
        settings.port = me.port if settings.port is None else settings.port
        settings.metrics_port = me.metrics_port if settings.metrics_port is None else settings.metrics_port
    settings.port, settings.metrics_port = fleet_ports(settings.port, settings.metrics_port, COORDINATOR_PORT)
    if not settings.stages:
        raise InvalidArgument("stages", "must list at least one stage address (or give --topology)")
    if settings.shards is None:
        raise InvalidArgument("shards", "is required (or give --topology)")
    lanes = stage_lanes(settings.stages)
    if len(lanes) > 1 and settings.host_stage0:
        raise InvalidArgument("host_stage0", "cannot be combined with replica stages (--stages A0|A1,...)")
    if settings.control_timeout_s <= 0:
        raise InvalidArgument("control_timeout_s", f"must be above 0, got {settings.control_timeout_s:g}")
    if settings.prefill_chunk < 1:
        raise InvalidArgument("prefill_chunk", f"must be at least 1, got {settings.prefill_chunk}")
    if settings.standby_kv_bytes < 0:
        raise InvalidArgument("standby_kv_bytes", f"must be 0 (off) or more, got {settings.standby_kv_bytes}")
    if settings.inflight < 0:
        raise InvalidArgument("inflight", f"must be 0 (one per stage) or more, got {settings.inflight}")
    if settings.max_running_per_identity < 1:
        raise InvalidArgument(
            "max_running_per_identity", f"must be at least 1, got {settings.max_running_per_identity}"
        )
    if settings.max_queued_per_identity < 0:
        raise InvalidArgument(
            "max_queued_per_identity", f"must be 0 or more, got {settings.max_queued_per_identity}"
        )
    if not 1 <= settings.max_k <= 32:
        raise InvalidArgument("max_k", f"must be in 1..32, got {settings.max_k}")
    if not 0 <= settings.spec_depth <= MAX_DEPTH:
        raise InvalidArgument("spec_depth", f"must be 0 (auto) or 1..{MAX_DEPTH}, got {settings.spec_depth}")
    if settings.speculative == "self" and settings.self_draft is None:
        raise InvalidArgument("speculative", "self needs --self-draft DIR")
    if settings.speculative in ("feature", "mix") and settings.feature_draft is None:
        raise InvalidArgument("speculative", f"{settings.speculative} needs --feature-draft DIR")
    if settings.feature_draft_watch is not None and settings.feature_draft is not None:
        raise InvalidArgument("feature_draft_watch", "is for a coordinator started without --feature-draft")
    if settings.feature_draft_poll_s <= 0:
        raise InvalidArgument("feature_draft_poll_s", f"must be above 0, got {settings.feature_draft_poll_s}")
    set_identity_labels(settings.metrics_identity_labels)
    named = parse_named(settings.draft)
    if settings.speculative not in (*MODES, *named):
        raise InvalidArgument(
            "speculative",
            "must be auto, none, ngram, self, feature, mix, medusa or a name given with --draft",
        )
    return settings


def ensure_export_files(settings: CoordinatorSettings) -> None:
    """Pull what this coordinator reads from the exporter when ``--shards`` lacks it (or holds a
    damaged copy) and an exporter is known: the root files, or stage 0's shard when it hosts stage 0."""
    shards = settings.shards_dir
    try:
        if settings.host_stage0:
            verify_shard(shards, 0)
        else:
            verify_root_files(shards)
    except (FailedPrecondition, NotFound, InvalidArgument, FileNotFoundError) as exc:
        if not settings.exporter:
            raise
        log.info("pulling_export", exporter=settings.exporter, stage0=settings.host_stage0, reason=str(exc))
        tls = None
        if settings.tls_dir is not None:
            tls = TlsConfig.from_dir(settings.tls_dir, settings.tls_name or "coordinator")
        if settings.host_stage0:
            pull_shard(settings.exporter, shards, 0, tls=tls, token=settings.token)
        else:
            pull_root_files(settings.exporter, shards, tls=tls, token=settings.token)


def stage_lanes(stages: list[str]) -> list[list[str]]:
    """The lanes of ``--stages`` (each entry a stage's replicas joined by ``|``): lane r is replica
    r of every stage; every stage must list as many replicas."""
    replicas = [entry.split(LANE_SEPARATOR) for entry in stages]
    counts = {len(r) for r in replicas}
    if len(counts) > 1:
        raise InvalidArgument(
            "stages", f"every stage must list as many replicas; got {[len(r) for r in replicas]} ({stages})"
        )
    return [list(lane) for lane in zip(*replicas, strict=True)]


@dataclass
class Coordinator:
    """Everything one coordinator process holds; built inside the running event loop."""

    settings: CoordinatorSettings
    # who callers are: the server's auth interceptor and the servicer share this one
    authenticator: Authenticator
    stages: RemoteStages | ReplicaLanes = field(init=False)
    ring: Ring = field(init=False)
    _reloads: set[asyncio.Task] = field(init=False, default_factory=set)  # SIGHUP topology reloads
    _draft_watch: asyncio.Task | None = field(init=False, default=None)  # --feature-draft-watch
    servicer: CoordinatorServicer = field(init=False)
    generation: Generation = field(init=False)  # its engine task ends with close()
    # Every lane's: one owner on every replica, so a session routed across lanes is one owner's,
    # and one table of pending steps, which any final replica's results resolve.
    _secret: str = field(init=False, default_factory=new_secret)
    _pending: PendingSteps = field(init=False, default_factory=PendingSteps)

    async def start(self) -> None:
        self._serving = hold_serving_lock(self.settings.shards_dir)  # see pipeshard.shard.serving
        manifest = load_manifest(self.settings.shards_dir)
        remote = manifest.num_stages - (1 if self.settings.host_stage0 else 0)
        if remote != len(self.settings.stages):
            raise InvalidArgument(
                "stages",
                f"lists {len(self.settings.stages)} addresses; this {manifest.num_stages}-stage export "
                f"needs {remote} remote stages"
                + (" (stage 0 hosted here)" if self.settings.host_stage0 else ""),
            )
        prompter = Prompter.from_dir(self.settings.shards_dir)
        local = self._local_stage0() if self.settings.host_stage0 else None
        lanes = [self._lane(addresses, local) for addresses in stage_lanes(self.settings.stages)]
        # Replicas, or a topology whose lanes SIGHUP may change: a transport per lane behind ReplicaLanes.
        replicated = len(lanes) > 1 or self.settings.topology is not None
        self.stages = ReplicaLanes(lanes) if replicated else lanes[0]
        await self.stages.start()
        await self.stages.wait_ready(self.settings.ready_timeout_s)
        infos = await self.stages.stage_infos()
        fleet_kv = FleetKv.agreed(self.settings.kv, infos)  # what the stages say they run
        log.info("kv_backend", backend=fleet_kv.backend, traits=fleet_kv.describe())
        promise = fleet_promise(infos)
        log.info(
            "fleet_promise",
            precision=promise.precision,
            invariant=promise.invariant,
            configurations=list(promise.configurations),
            summary=promise.describe(),
        )
        if promise.fallbacks:  # a stage could not prove a faster configuration on its CPU
            log.warning("invariant_fallback", stages=list(promise.fallbacks))
        prefix = self.settings.prefix_cache == "on"
        log.info("prefix_cache", enabled=prefix)
        scheduler = self._scheduler(infos)
        self.ring = Ring(
            self.stages,
            fleet_kv,
            accounts=scheduler.accounts(),
            inflight=self.settings.inflight or None,
        )
        chunk = self.settings.prefill_chunk
        if fleet_kv.batches_steps and chunk == DEFAULT_PREFILL_CHUNK:
            chunk = self.ring.prefill_chunk  # the same chunks as `generate --local --kv paged`
        max_k = self.settings.max_k
        if fleet_kv.row_tokens:  # a row holds at most the shards' chunk: prefill and verify fit in it
            chunk = min(chunk, self.ring.prefill_chunk)
            max_k = max(1, min(max_k, self.ring.prefill_chunk - 1))
        heads = infos[-1].draft_heads

        def draft_sources(feature: Path | None) -> DraftSources:
            return DraftSources(
                self.settings.shards_dir,
                self_draft=self.settings.self_draft,
                feature=feature,
                heads=heads,
                named=parse_named(self.settings.draft),
                draft_cache=self.settings.draft_cache,
            )

        drafts = draft_sources(self.settings.feature_draft)
        auto = {"auto_among": among(drafts.names)} if self.settings.speculative == AUTO else {}
        log.info("draft_sources", offered=drafts.names, default=self.settings.speculative, **auto)
        say_default(self.settings.speculative)
        if self.settings.speculative != "none":
            drafts.validate(self.settings.speculative)  # medusa: only once the final stage has heads
        grammars = Grammars(prompter.tokenizer, manifest.model.vocab_size, prompter.eos_ids)
        # The grammar engine's view of the vocabulary takes seconds: built while the fleet warms up.
        self._grammar_ready = asyncio.get_running_loop().run_in_executor(None, grammars.prepare)
        self.generation = generation = Generation(
            self.ring,
            prompter.tokenizer,
            prompter.eos_ids,
            prefill_chunk=chunk,
            drafts=drafts,
            default_speculative=self.settings.speculative,
            max_k=max_k,
            final_stage_sampling=self.settings.final_stage_sampling,
            tree_prune=self.settings.tree_prune,
            prefix=(
                PrefixIndex(self.settings.prefix_cache_entries, self.settings.prefix_min_tokens)
                if prefix
                else None
            ),
            restore_timeout_s=self.settings.prefix_restore_timeout_s,
            failover=self._failover(infos),
            grammars=grammars,
            spec_depth=self.settings.spec_depth,
        )
        if self.settings.feature_draft_watch is not None:
            watch = DraftWatch(
                self.settings.feature_draft_watch,
                self.settings.shards_dir,
                generation,
                draft_sources,
                self.settings.feature_draft_poll_s,
            )
            self._draft_watch = asyncio.get_running_loop().create_task(watch.run(), name="draft-watch")
        # Static stages run one shape whatever the prompt: one chunk warms every hop's frames.
        warm_context = self.ring.prefill_chunk + 4 if fleet_kv.row_tokens else manifest.max_context
        await self._warmup(generation, prompter, warm_context)
        COORDINATOR_RUNNING.set_function(lambda: scheduler.running)
        COORDINATOR_QUEUED.set_function(lambda: scheduler.queued)
        self.servicer = CoordinatorServicer(
            generation,
            prompter,
            max_context=manifest.max_context,
            vocab_size=manifest.model.vocab_size,
            default_max_tokens=self.settings.default_max_tokens,
            scheduler=scheduler,
            max_prompt_bytes=self.settings.max_prompt_bytes,
            authenticator=self.authenticator,
            prefix_cache_scope=self.settings.prefix_cache_scope,
            system_fingerprint=promise.system_fingerprint,
        )

    def _failover(self, infos: list[stage_pb2.GetStageInfoResponse]) -> Failover | None:
        """Failover of running requests on replica lanes, with standby KV copies unless switched off."""
        if not isinstance(self.stages, ReplicaLanes):
            return None
        limit = self.settings.standby_kv_bytes
        block = max((info.kv_block_tokens for info in infos), default=0)
        standby = KvStandby(self.stages, block, limit) if limit else None
        log.info("failover", standby_kv_bytes=limit)
        return Failover(self.stages, standby, restore_timeout_s=self.settings.step_timeout_s)

    def _lane(
        self, addresses: list[str], local: tuple[LocalEntry, LocalStageStub] | None = None
    ) -> RemoteStages:
        return RemoteStages(
            addresses,
            step_timeout_s=self.settings.step_timeout_s,
            control_timeout_s=self.settings.control_timeout_s,
            local_stage0=local,
            hop_delay_s=self.settings.hop_delay_ms / 1000.0,
            tls=self._tls(),
            secret=self._secret,
            pending=self._pending,
        )

    def watch_topology(self) -> None:
        """SIGHUP re-reads --topology: lanes it no longer lists drain (no new sessions; closed
        once their running ones end), lanes it newly lists join once they answer and agree."""
        if not isinstance(self.stages, ReplicaLanes):
            return
        loop = asyncio.get_running_loop()

        def reload() -> None:
            task = loop.create_task(self.reload())
            self._reloads.add(task)
            task.add_done_callback(self._reloads.discard)

        loop.add_signal_handler(signal.SIGHUP, reload)

    async def reload(self) -> None:
        stages = self.stages
        if self.settings.topology is None or not isinstance(stages, ReplicaLanes):
            return  # nothing to re-read (the stages were given as flags), or no lanes to change
        try:
            wanted = stage_lanes(Topology.load(self.settings.topology).stage_addresses())
        except PipeshardError as exc:
            log.error("topology_reload_failed", error=str(exc))
            return
        current = {tuple(lane.addresses): lane for lane in stages.lanes if lane not in stages.draining}
        for key, lane in current.items():
            if list(key) not in wanted:
                stages.drain_lane(lane)
        for addresses in wanted:
            if tuple(addresses) not in current:
                try:
                    await stages.add_lane(self._lane(addresses), self.settings.ready_timeout_s)
                except PipeshardError as exc:
                    log.error("lane_refused", stages=addresses, error=str(exc))

    def _scheduler(self, infos: list[stage_pb2.GetStageInfoResponse]) -> Scheduler:
        """The scheduler over the stages' budgets for this coordinator: their KV pools (paged), the
        sessions each lets it hold (every backend) and a static stage's slots, which cap --max-running
        (a request beyond them waits in the queue)."""
        sessions = min(
            min(info.max_sessions_per_owner or self.settings.max_running, info.static_slots or 1 << 30)
            for info in infos
        )
        capacity = min(self.settings.max_running, sessions)
        kv = KvMirror.from_infos(infos)
        log.info(
            "scheduler",
            max_running=capacity,
            kv_share_blocks=[b.share_blocks for b in kv.budgets],
            kv_held_blocks=kv.held,
        )
        return Scheduler(
            capacity,
            self.settings.max_queue,
            max_running_per_identity=self.settings.max_running_per_identity,
            max_queued_per_identity=self.settings.max_queued_per_identity,
            kv=kv,
        )

    async def _warmup(self, generation: Generation, prompter: Prompter, max_context: int) -> None:
        """One throwaway greedy generation over the whole ring before the server reports SERVING:
        the tokenizer, the template, every hop's stream and every stage's session path get their
        first use here instead of in the first user's TTFT, at the stages' warm-up prompt length, so
        the hops' large frames are warmed too (stages warm their shards themselves)."""
        started = time.perf_counter()
        text = prompter.user_text("Warm up.")
        ids = (text * (WARMUP_PREFILL // len(text) + 1))[: min(WARMUP_PREFILL, max_context - 4)]
        tokens = 0
        warm = SamplingParams(max_tokens=2, ignore_eos=True)
        async for event in generation.run(ids, warm, metered=False, cache=False):
            if isinstance(event, Chunk):
                tokens += len(event.token_ids)
        log.info(
            "warmup done",
            prompt_tokens=len(ids),
            tokens=tokens,
            seconds=round(time.perf_counter() - started, 3),
        )

    def _tls(self) -> TlsConfig | None:
        """The coordinator's fleet certificate, presented to the stages (None = plaintext)."""
        if self.settings.tls_dir is None:
            return None
        return TlsConfig.from_dir(self.settings.tls_dir, self.settings.tls_name or "coordinator")

    def _local_stage0(self) -> tuple[LocalEntry, LocalStageStub]:
        stage = StageSettings(
            stage=0,
            shards=self.settings.shards,
            next_hop=self.settings.stages[0],
            precision=self.settings.precision,
            kv=self.settings.kv,  # auto: the manifest's (static for a static export, else paged)
            hop_delay_ms=self.settings.hop_delay_ms,
            tls_dir=self.settings.tls_dir,
            tls_name=self.settings.tls_name or "coordinator",
        )
        node, info = build_node(stage)
        return LocalEntry(node), LocalStageStub(StageServicer(node, info))

    def report_health(self, server: GrpcServer) -> None:
        """Health ("" and the service) follows the ring: NOT_SERVING while any stage is unreachable."""
        names = ("", coordinator_pb2.DESCRIPTOR.services_by_name["CoordinatorService"].full_name)

        def report(serving: bool) -> None:
            for name in names:
                server.set_serving(name, serving)

        self.stages.on_health = report
        report(self.stages.healthy)

    async def close(self) -> None:
        """Graceful stop: no new requests, running ones get the grace period, the rest are ended
        with a final CANCELLED summary; then the ring closes with no session left on a stage."""
        if self._draft_watch is not None:
            self._draft_watch.cancel()
        if hasattr(self, "servicer"):  # started
            grace = self.settings.grace_seconds
            if not await self.servicer.drain(grace):
                self.stages.stop_steps(
                    f"coordinator shut down; generation stopped after its {grace:g} s grace"
                )
                await self.servicer.drain(5.0)  # their final messages go out
            await self.servicer.released()
            await self.generation.close("the coordinator shut down")  # its engine task ends
        if hasattr(self, "ring"):
            await self.ring.close()  # its batcher, then the stages
        elif hasattr(self, "stages"):
            await self.stages.close()


def main(argv: list[str] | None = None) -> int:
    set_offline_defaults()
    allocator.bound_heap()  # before gRPC's threads make malloc arenas of their own, as the stage does
    settings = resolve(load_settings(CoordinatorSettings, argv, prog="pipeshard coordinator"))
    authenticator = Authenticator.from_settings(settings.token, settings.api_keys)
    coordinator = Coordinator(settings, authenticator)

    async def services():
        ensure_export_files(settings)
        await coordinator.start()
        coordinator.watch_topology()
        return [(coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server, coordinator.servicer)]

    return run_server(
        settings,
        services,
        name="coordinator",
        shutdown_hooks=[coordinator.close],
        peers="clients",
        node_name="coordinator",
        authenticator=authenticator,
        on_started=coordinator.report_health,
    )
