"""``pipeshard stage``: serve one stage of an export (``make run-stage STAGE=k``)."""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass
from pathlib import Path

import openvino as ov
import structlog

from pipeshard import allocator, headroom
from pipeshard.errors import FailedPrecondition, InvalidArgument, NotFound
from pipeshard.grpc_server import GrpcServer, run_server
from pipeshard.link_model import AUTO, CODEC_NAMES, CodecChooser, check_wire_dtype
from pipeshard.offline import set_offline_defaults
from pipeshard.precision import (
    DEFAULT_PRECISION,
    INVARIANT_LADDER,
    PRECISIONS,
    SINGLE_ROW_LADDER,
    canonical,
    is_invariant,
    ladder,
)
from pipeshard.services.stage.backends import (
    AUTO_KV,
    KV_CHOICES,
    AnyBackend,
    SessionLimits,
    ShardSpec,
    StatefulBackend,
    choose_backend,
)
from pipeshard.services.stage.meters import StageMeters
from pipeshard.services.stage.node import StageNode
from pipeshard.services.stage.prefix_spill import PrefixSpill
from pipeshard.services.stage.prefix_store import PrefixStore
from pipeshard.services.stage.rawtcp import RawTcpStage
from pipeshard.services.stage.servicer import StageServicer
from pipeshard.services.stage.wire import DEFAULT_MAX_FRAME_TOKENS, WIRE_DTYPES
from pipeshard.services.transport.hop import NEXT_HOP_HEALTH, HopStream, next_hop_health
from pipeshard.settings import LOOPBACK, MIB, ServerSettings, load_settings, setting
from pipeshard.shard.compile_cache import OFF
from pipeshard.shard.device import DEFAULT_DEVICE
from pipeshard.shard.draft_heads import DraftHeads, check_target, read_meta
from pipeshard.shard.manifest import load_manifest, verify_shard
from pipeshard.shard.paged import DEFAULT_CACHE_BYTES
from pipeshard.shard.pull import pull_shard
from pipeshard.shard.runtime import StageShard
from pipeshard.shard.serving import hold_serving_lock
from pipeshard.shard.shape_cache import SHAPE_CACHE_ENTRIES, bounded_core
from pipeshard.shard.weight_pages import WeightPages
from pipeshard.tls import TlsConfig
from pipeshard.topology import REPLICA_PORT_STRIDE, STAGE_PORT_BASE, Topology, fleet_ports
from pipeshard.v1 import stage_pb2, stage_pb2_grpc

log = structlog.get_logger(__name__)

RELEASE = "release"


@dataclass
class StageSettings(ServerSettings):
    port: int | None = setting(
        None, "gRPC port (default: the topology's, else 50061 + stage + 20 x replica; 0 = ephemeral)"
    )
    metrics_port: int | None = setting(
        None,
        "Prometheus /metrics port, read by `pipeshard top` (default: the topology's, else 9161 + "
        "stage + 20 x replica; off when --port is given; 0 = off)",
    )
    stage: int = setting(0, "index of this stage in the pipeline")
    replica: int = setting(
        0,
        "with --topology: which replica (lane) of the stage this is; it forwards to every replica "
        "of the next stage, that lane's first",
    )
    topology: Path | None = setting(
        None, "topology file (config/topology.yaml) giving port, shards and next hop"
    )
    shards: Path | None = setting(None, "export folder holding manifest.json and the stage folders")
    next_hop: str | None = setting(
        None,
        "address of the next stage (unset for the final stage); several, comma-separated: every "
        "replica of the next stage, this replica's own lane's first (per-hop routing: each session "
        "forwarded to the replica its coordinator routes it to)",
    )
    precision: str = setting(DEFAULT_PRECISION, "inference precision", choices=PRECISIONS)
    invariant_ladder: str = setting(
        "",
        "at --precision invariant: the configurations to try, fastest first, comma-separated "
        f"(pipeshard/precision.py; default {','.join(INVARIANT_LADDER)}; stateful and static stages "
        f"skip rungs that need two-token rows, default {','.join(SINGLE_ROW_LADDER)}); unset: the "
        "topology file's invariant_ladder",
    )
    num_threads: int = setting(0, "OpenVINO inference threads (0 = the plugin's choice)")
    num_streams: int = setting(
        0, "OpenVINO CPU streams (0 = the latency hint's one); a stage runs one inference at a time"
    )
    max_sessions: int = setting(64, "sessions this stage holds at most")
    max_sessions_per_owner: int = setting(
        32, "sessions one owner (coordinator) holds here at most, so one cannot take them all"
    )
    lease_grace_s: float = setting(
        5.0, "release an owner's sessions once it has held no Results subscription this long, in s"
    )
    idle_timeout_s: float = setting(300.0, "release a session idle this long, in seconds")
    codec: str = setting(
        AUTO,
        "compression of hidden states sent on (and, on the final stage, of logits returned); auto: per "
        "link from its measured bandwidth (off on loopback); quantum_zstd: fp32 hidden states only; a "
        "session may ask for another in OpenSession (codec)",
        choices=(AUTO, *CODEC_NAMES),
    )
    wire_dtype: str = setting(
        "fp32",
        "dtype of hidden states on the wire; fp16 and bf16 are LOSSY (fewer bytes)",
        choices=WIRE_DTYPES,
    )
    max_frame_tokens: int = setting(
        DEFAULT_MAX_FRAME_TOKENS,
        "positions one Forward frame may carry; a frame declaring more is refused (RESOURCE_EXHAUSTED) "
        "before its tensor is decompressed",
    )
    exporter: str | None = setting(
        None,
        "exporter (host:port) to pull this stage's shard from when it is missing: the export named "
        "as the --shards folder is (its last path part, e.g. smollm2-135m-instruct-2s-int4)",
    )
    raw_tcp_port: int = setting(0, "also serve the raw-TCP baseline on this port (benchmarks; 0 = off)")
    raw_tcp_next_hop: str | None = setting(None, "raw-TCP address of the next stage (benchmarks)")
    hop_delay_ms: float = setting(
        0.0, "emulated one-way latency added to every frame or result this stage sends (benchmarks)"
    )
    prefix_cache_bytes: int = setting(
        512 * 1024 * 1024, "bytes of captured KV the prefix cache keeps (least recently used out; 0 = off)"
    )
    prefix_spill_dir: Path | None = setting(
        None,
        "also keep the prefix cache's blocks in this folder (checked KV blobs), so a restarted stage "
        "keeps its cache; off when unset",
    )
    prefix_spill_bytes: int = setting(
        4 * 1024 * 1024 * 1024, "bytes of blocks the spill folder keeps (oldest out; --prefix-spill-dir)"
    )
    kv: str = setting(
        AUTO_KV,
        "KV backend: auto (static for a `pipeshard export --static` shard, else paged), paged (a shared "
        "block pool; plan frames run many sessions in one inference), stateful (one cache per session, "
        "one session per inference; the raw-TCP baseline needs it) or static (only a static export)",
        choices=KV_CHOICES,
    )
    kv_cache_bytes: int = setting(
        DEFAULT_CACHE_BYTES,
        "byte budget of the paged KV block pool (--kv paged), held from the start: a stage that "
        "cannot hold it is refused at start",
    )
    shape_cache_entries: int = setting(
        SHAPE_CACHE_ENTRIES,
        "step shapes the CPU plugin keeps prepared (its runtime cache, and oneDNN's primitive cache "
        "unless ONEDNN_PRIMITIVE_CACHE_CAPACITY is set), so native memory stays flat under ever new "
        "long-context shapes; 0: the plugin's defaults (5,000 and 1,024, which grow for hours)",
    )
    device: str = setting(
        DEFAULT_DEVICE,
        "OpenVINO device to compile for: CPU, GPU, GPU.1, NPU, AUTO:GPU,CPU, HETERO:GPU,CPU, ...; "
        "a device this machine lacks is refused at start",
    )
    compile_cache_dir: str = setting(
        "",
        "folder for compiled models, so a restart skips compiling (one subfolder per export and "
        "device; empty: .compile_cache inside the export; off: no cache); --kv stateful and static",
    )
    draft_heads: Path | None = setting(
        None,
        "final stage only: trained draft heads (pipeshard distil --kind medusa) run for rows that ask, "
        "their candidates returned with the verify result (the coordinator's `medusa` source); refused "
        "at start when trained for other weights",
    )
    weight_pages: str = setting(
        RELEASE,
        "release: while the stage compiles and warms up, unmap the pages of its memory-mapped weight "
        "files once the CPU plugin has copied them (the page cache keeps them), so its RSS holds one "
        "copy of the weights, not two; keep: leave them mapped",
        choices=(RELEASE, "keep"),
    )

    @property
    def shards_dir(self) -> Path:
        """The export folder, once :func:`resolve` has filled ``shards`` in."""
        if self.shards is None:
            raise InvalidArgument("shards", "is required (or give --topology)")
        return self.shards


def resolve(settings: StageSettings) -> StageSettings:
    """Fill what the topology file knows and the flags did not say; without one, the fleet's
    default ports (docs/SERVICES.md)."""
    if settings.topology is None:
        if settings.shards is None:
            raise InvalidArgument("shards", "is required (or give --topology)")
        default = STAGE_PORT_BASE + settings.stage + REPLICA_PORT_STRIDE * settings.replica
        settings.port, settings.metrics_port = fleet_ports(settings.port, settings.metrics_port, default)
        return settings
    topo = Topology.load(settings.topology)
    me = topo.stage(settings.stage, settings.replica)
    settings.shards = settings.shards or Path(topo.shards)
    settings.next_hop = settings.next_hop or topo.next_hop(settings.stage, settings.replica)
    settings.exporter = settings.exporter or topo.exporter.address
    settings.host = me.host if settings.host == LOOPBACK else settings.host
    settings.port = me.port if settings.port is None else settings.port
    settings.metrics_port = me.metrics_port if settings.metrics_port is None else settings.metrics_port
    settings.precision = topo.precision if settings.precision == DEFAULT_PRECISION else settings.precision
    settings.invariant_ladder = settings.invariant_ladder or topo.invariant_ladder
    settings.device = me.device if settings.device == DEFAULT_DEVICE else settings.device
    return settings


def next_hops(value: str | None) -> list[str]:
    """``--next-hop``'s addresses in order (comma-separated; none for the final stage)."""
    return [address.strip() for address in (value or "").split(",") if address.strip()]


def fleet_tls(settings: StageSettings) -> TlsConfig | None:
    """This stage's fleet identity, for its next hop and the exporter (None = plaintext)."""
    if settings.tls_dir is None:
        return None
    return TlsConfig.from_dir(settings.tls_dir, settings.tls_name or f"stage{settings.stage}")


def ensure_shard(settings: StageSettings) -> None:
    """Pull the shard from the exporter when it is missing or damaged and an exporter is known."""
    try:
        verify_shard(settings.shards_dir, settings.stage)
    except (FailedPrecondition, NotFound, InvalidArgument, FileNotFoundError) as exc:
        if not settings.exporter:
            raise
        log.info("pulling_shard", stage=settings.stage, exporter=settings.exporter, reason=str(exc))
        started = time.perf_counter()
        pull_shard(
            settings.exporter,
            settings.shards_dir,
            settings.stage,
            tls=fleet_tls(settings),
            token=settings.token,
        )
        log.info("shard_pulled", stage=settings.stage, seconds=round(time.perf_counter() - started, 3))


def prefix_store(settings: StageSettings, shard: StageShard) -> PrefixStore:
    """The prefix cache, spilling to ``--prefix-spill-dir`` when set (one folder per stage)."""
    spill = None
    if settings.prefix_spill_dir is not None:
        folder = Path(settings.prefix_spill_dir) / f"stage{shard.stage_index}"
        spill = PrefixSpill(folder, shard.kv_source, settings.prefix_spill_bytes)
        log.info("prefix_spill", folder=str(folder), blocks=len(spill), bytes=spill.nbytes)
    return PrefixStore(settings.prefix_cache_bytes, spill, layout=shard.kv_source.blocks)


def weight_folders(settings: StageSettings, backend: AnyBackend) -> list[Path]:
    """Where the stage's weights are mapped from: the export, and a compile-cache root outside it."""
    folders = [settings.shards_dir]
    cached = settings.compile_cache_dir.strip().lower() not in ("", OFF)
    if backend.traits.maps_compile_cache and cached:
        folders.append(Path(settings.compile_cache_dir))
    return folders


def shard_spec(settings: StageSettings, core: ov.Core) -> ShardSpec:
    """What loading the stage's shard takes, from its flags (``core``: the stage's, bounded_core)."""
    return ShardSpec(
        export_dir=settings.shards_dir,
        stage=settings.stage,
        precision=settings.precision,
        num_threads=settings.num_threads or None,
        device=settings.device,
        compile_cache=settings.compile_cache_dir,
        num_streams=settings.num_streams or None,
        cache_bytes=settings.kv_cache_bytes,
        invariant_ladder=settings.invariant_ladder,
        core=core,
    )


def reserve_pool(shard: StageShard) -> None:
    """The KV pool made resident now, so the stage holds its budget from the start and one that
    cannot is refused here, naming the flag, not killed by the kernel under load."""
    need, room = shard.pool_bytes(), headroom.available_bytes()
    if need > room:
        raise InvalidArgument(
            "kv_cache_bytes",
            f"needs a KV pool of {need / MIB:.0f} MiB, but this machine (or the stage's memory cgroup) "
            f"has {room / MIB:.0f} MiB available: give a smaller --kv-cache-bytes or free memory",
        )
    started = time.perf_counter()
    shard.reserve()
    if need:
        log.info(
            "kv_pool_reserved", mib=round(need / MIB, 1), seconds=round(time.perf_counter() - started, 3)
        )


def warm(settings: StageSettings, shard: StageShard) -> None:
    """The shard, checked against its place in the pipeline and warmed up."""
    if shard.is_last == bool(settings.next_hop):
        raise InvalidArgument(
            "next_hop", "must be set for every stage but the last" if not shard.is_last else "must be unset"
        )
    reserve_pool(shard)
    # Warm up before the server starts listening (so before health reports SERVING): the first
    # inferences of a fresh compiled model pay for allocation and kernel preparation.
    started = time.perf_counter()
    inferences = shard.warmup()
    log.info(
        "warmup done",
        stage=settings.stage,
        inferences=inferences,
        seconds=round(time.perf_counter() - started, 3),
    )


def load_heads(settings: StageSettings, num_stages: int) -> DraftHeads | None:
    """The final stage's draft heads (--draft-heads), checked against the export's weights."""
    if settings.draft_heads is None:
        return None
    if settings.stage != num_stages - 1:
        raise InvalidArgument(
            "draft_heads",
            f"only the final stage runs draft heads; this is stage {settings.stage} of {num_stages} "
            f"(give --draft-heads to stage {num_stages - 1})",
        )
    meta = read_meta(settings.draft_heads)
    check_target(meta, settings.shards_dir, settings.draft_heads)
    heads = DraftHeads(settings.draft_heads, meta, settings.num_threads or None)
    log.info("draft_heads_loaded", folder=str(settings.draft_heads), heads=heads.heads)
    return heads


def build_node(settings: StageSettings) -> tuple[StageNode, stage_pb2.GetStageInfoResponse]:
    if settings.kv != StatefulBackend.name and settings.raw_tcp_port:
        raise InvalidArgument(
            "raw_tcp_port", "the raw-TCP baseline serves the stateful backend only (--kv stateful)"
        )
    core = bounded_core(settings.shape_cache_entries)  # before anything runs the CPU plugin
    check_wire_dtype(settings.codec, settings.wire_dtype)
    ladder(settings.invariant_ladder)  # an unknown configuration is refused before anything compiles
    manifest = load_manifest(settings.shards_dir)
    backend = choose_backend(settings.kv, manifest)  # the one choice: its object from here on
    heads = load_heads(settings, manifest.num_stages)  # before compiling: a refusal comes at once
    release = settings.weight_pages == RELEASE
    meters = StageMeters(settings.stage)
    limits = SessionLimits(settings.max_sessions, settings.idle_timeout_s, settings.max_sessions_per_owner)
    with WeightPages(weight_folders(settings, backend)) if release else contextlib.nullcontext():
        parts = backend.load(
            shard_spec(settings, core),
            limits,
            lambda shard: prefix_store(settings, shard),
            meters=meters,
            prepare=lambda shard: warm(settings, shard),
        )
    shard, engine, kv = parts.shard, parts.engine, parts.kv
    meters.watch(engine.sessions, parts.bytes_per_position)
    engine.heads = heads
    delay_s = settings.hop_delay_ms / 1000.0
    hops = [HopStream(a, delay_s=delay_s, tls=fleet_tls(settings)) for a in next_hops(settings.next_hop)]
    node = StageNode(
        engine,
        settings.stage,
        next_hops=hops,
        codec=CodecChooser(settings.codec, hops[0].link if hops else None),
        wire_dtype=settings.wire_dtype,
        results_delay_s=delay_s,
        kv=kv,
        max_frame_tokens=settings.max_frame_tokens,
    )
    info = stage_pb2.GetStageInfoResponse(
        stage_index=settings.stage,
        num_stages=shard.num_stages,
        layer_start=shard.entry.layer_start,
        layer_end=shard.entry.layer_end,
        model_fingerprint=shard.manifest.model.fingerprint,
        max_context=shard.max_context,
        next_hop=hops[0].address if hops else "",
        next_hops=[hop.address for hop in hops],
        precision=canonical(settings.precision),
        invariant=is_invariant(settings.precision),
        device=shard.device,
        draft_heads=heads.heads if heads is not None else 0,
        configuration=shard.config.name,
    )
    proof = shard.proof
    if proof is not None and proof.check is not None:  # a paged stage's self-check decides
        info.invariant = proof.invariant
        info.self_check = proof.check.describe()
        info.self_check_seconds = proof.check.seconds
        info.invariant_fallback = proof.describe_fallbacks()
    info.MergeFrom(parts.facts)
    return node, info


def main(argv: list[str] | None = None) -> int:
    set_offline_defaults()
    allocator.bound_heap()  # before gRPC's and OpenVINO's threads make arenas of their own
    settings = resolve(load_settings(StageSettings, argv, prog="pipeshard stage"))
    holder: dict = {}

    async def services():
        ensure_shard(settings)
        holder["serving"] = hold_serving_lock(settings.shards_dir)  # no forced export replaces it now
        node, info = build_node(settings)
        holder["node"] = node
        node.start_reaper(settings.idle_timeout_s, settings.lease_grace_s)
        for hop in node.next_hops:
            hop.start()  # dial (and probe the link) now, while no frame is computing
        if settings.raw_tcp_port:
            host, _, port = (settings.raw_tcp_next_hop or "").rpartition(":")
            raw = RawTcpStage(node.engine, (host, int(port)) if port else None)
            holder["raw"] = await raw.serve(settings.host, settings.raw_tcp_port)
        return [(stage_pb2_grpc.add_StageServiceServicer_to_server, StageServicer(node, info))]

    async def shutdown():
        if "node" in holder:
            await holder["node"].close()

    def report_next_hops(server: GrpcServer) -> None:
        """Each next hop's state on its health service ``next_hop_health(i)`` (the first's also on
        NEXT_HOP_HEALTH, the lane's own, as before): SERVING until its stream breaks (a dead or
        stalled replica of the next stage), again once it reconnects; the coordinator watches them
        and GetStageInfo lists them (``next_hop_states``), so a broken link names its own route."""
        for index, hop in enumerate(holder["node"].next_hops):
            services = [next_hop_health(index), *([NEXT_HOP_HEALTH] if index == 0 else [])]
            for service in services:
                server.set_serving(service, True)
            hop.on_state = functools.partial(report, server, hop, services)

    def report(server: GrpcServer, hop: HopStream, services: list[str], up: bool, reason: str) -> None:
        if not up:
            log.warning("next_hop_lost", address=hop.address, reason=reason)
        for service in services:
            server.set_serving(service, up)

    return run_server(
        settings,
        services,
        name=f"stage {settings.stage}",
        shutdown_hooks=[shutdown],
        peers="fleet",
        node_name=f"stage{settings.stage}",
        on_started=report_next_hops,
    )
