"""What `pipeshard top` and the gateway's /ui page show: the fleet of a topology file, read now.

Each read asks every stage for GetStageInfo and grpc.health, every coordinator of the group for
its health, and every stage and coordinator for their /metrics (step time, rows per step, cache use; users,
queue, tokens). Rates (step time, tok/s) are taken since the previous read. Everything is read
through the services' public interfaces; a part that does not answer shows as down (or its
figures as "-").
"""

from __future__ import annotations

import time
import urllib.request
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from pipeshard.metrics import (
    COORDINATOR_QUEUED,
    COORDINATOR_RUNNING,
    GENERATED_TOKENS,
    SPECULATION_DEFAULT,
    STAGE_CACHE_BYTES,
    STAGE_CACHE_POSITIONS,
    STAGE_STEP_ROWS,
    STAGE_STEP_SECONDS,
)
from pipeshard.topology import StageEndpoint, Topology
from pipeshard.v1 import stage_pb2, stage_pb2_grpc

TIMEOUT_S = 2.0


@dataclass
class Scrape:
    """One /metrics page: sample values by name and labels, and when it was read."""

    at: float
    samples: dict[tuple[str, frozenset], float] = field(default_factory=dict)

    def value(self, name: str, **labels: str) -> float:
        """The sum of ``name``'s samples whose labels include ``labels`` (0 if none)."""
        want = set(labels.items())
        return sum(v for (n, ls), v in self.samples.items() if n == name and want <= ls)


def scrape(host: str, port: int) -> Scrape | None:
    """The /metrics page at host:port, or None (no port, or it does not answer)."""
    if not port:
        return None
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=TIMEOUT_S) as reply:
            text = reply.read().decode()
    except OSError:
        return None
    out = Scrape(time.monotonic())
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def _name(metric) -> str:
    return metric.describe()[0].name  # the family name (a counter's without _total)


def _per(now: Scrape, before: Scrape | None, name: str, per: str, **labels: str) -> float | None:
    """Increase of counter ``name`` per increase of ``per`` since ``before`` (or since the start)."""
    start = before.value if before is not None else (lambda *_a, **_k: 0.0)
    d_per = now.value(per, **labels) - start(per, **labels)
    return (now.value(name, **labels) - start(name, **labels)) / d_per if d_per > 0 else None


@dataclass
class StageRow:
    address: str
    health: str
    layers: str = "?"
    sessions: str = "?"
    precision: str = "?"
    step_ms: str = "-"
    rows_per_step: str = "-"
    cache: str = "-"


@dataclass
class CoordinatorRow:
    address: str
    health: str
    index: int = 0  # its place in the group (the topology's ``coordinators``)
    generate_calls: dict[str, int] = field(default_factory=dict)
    users: str = "-"
    queue: str = "-"
    tok_s: str = "-"
    speculation: str = "-"  # the draft source of requests that do not choose one


@dataclass
class StageView:
    """One stage of one lane as read now."""

    stage: int
    lane: int
    node: str  # the machine it runs on when known ("" otherwise)
    row: StageRow

    @property
    def label(self) -> str:
        return str(self.stage) if self.lane == 0 else f"{self.stage}.r{self.lane}"


@dataclass
class FleetSnapshot:
    """What one refresh reads: every stage of every lane, then every coordinator of the group
    (``pipeshard top`` renders it; the gateway's /fleet serves it)."""

    stages: list[StageView]
    coordinators: list[CoordinatorRow]


def _health(channel: grpc.Channel) -> str:
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S)
    except grpc.RpcError as exc:
        return f"down ({exc.code().name})"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status).lower()


def stage_row(address: str) -> StageRow:
    with grpc.insecure_channel(address) as channel:
        row = StageRow(address, _health(channel))
        if row.health.startswith("down"):
            return row
        try:
            info = stage_pb2_grpc.StageServiceStub(channel).GetStageInfo(
                stage_pb2.GetStageInfoRequest(), timeout=TIMEOUT_S
            )
        except grpc.RpcError:
            return row
        row.layers = f"{info.layer_start}-{info.layer_end - 1}"
        row.sessions = str(info.live_sessions)
        row.precision = precision_cell(info)
        return row


def precision_cell(info: stage_pb2.GetStageInfoResponse) -> str:
    """The precision, the configuration it compiled when that says more, the promise, and a
    fallback when the stage could not prove a faster configuration on its CPU."""
    cell = info.precision or "?"
    if info.configuration and info.configuration != info.precision:
        cell += f" {info.configuration}"
    cell += f" ({'invariant' if info.invariant else 'load-dependent'})"
    if info.invariant_fallback:
        failed = ", ".join(f.split(":")[0] for f in info.invariant_fallback.split("; "))
        cell += f", fell back: {failed} failed the self-check"
    return cell


def stage_figures(row: StageRow, now: Scrape | None, before: Scrape | None, stage: int) -> None:
    """Step time and rows per step over the interval, and cache use now, from the stage's /metrics."""
    if now is None:
        return
    label = {"stage": str(stage)}
    seconds, rows = _name(STAGE_STEP_SECONDS), _name(STAGE_STEP_ROWS)
    step_s = _per(now, before, f"{seconds}_sum", f"{seconds}_count", **label)
    per_step = _per(now, before, f"{rows}_sum", f"{rows}_count", **label)
    row.step_ms = f"{step_s * 1000:.1f}" if step_s is not None else "idle"
    row.rows_per_step = f"{per_step:.1f}" if per_step is not None else "-"
    positions = now.value(_name(STAGE_CACHE_POSITIONS), **label)
    mib = now.value(_name(STAGE_CACHE_BYTES), **label) / 2**20
    row.cache = f"{positions:.0f} pos, {mib:.1f} MiB"


def _generate_calls(now: Scrape | None) -> dict[str, int]:
    """Finished Generate calls by status code, from the coordinator's /metrics (empty if none)."""
    calls: dict[str, int] = {}
    for (name, labels), value in (now.samples if now else {}).items():
        got = dict(labels)
        if name == "pipeshard_rpc_requests_total" and got.get("method") == "Generate":
            calls[got["code"]] = int(value)
    return calls


def speculation_source(now: Scrape | None) -> str:
    """The draft source the coordinator's requests that do not choose one speculate with (its
    `pipeshard_speculation_default` gauge; it changes when a draft trained in the background is
    picked up)."""
    for (name, labels), value in (now.samples if now else {}).items():
        if name == _name(SPECULATION_DEFAULT) and value == 1:
            return dict(labels).get("source", "-")
    return "-"


def coordinator_row(address: str, index: int, now: Scrape | None, before: Scrape | None) -> CoordinatorRow:
    with grpc.insecure_channel(address) as channel:
        row = CoordinatorRow(address, _health(channel), index)
    row.generate_calls = _generate_calls(now)
    row.speculation = speculation_source(now)
    if now is not None:
        row.users = f"{now.value(_name(COORDINATOR_RUNNING)):.0f}"
        row.queue = f"{now.value(_name(COORDINATOR_QUEUED)):.0f}"
        if before is not None and now.at > before.at:
            tokens = f"{_name(GENERATED_TOKENS)}_total"
            row.tok_s = f"{(now.value(tokens) - before.value(tokens)) / (now.at - before.at):.1f}"
    return row


class FleetReader:
    """Reads a topology's fleet; keeps the previous scrape of each /metrics page for the rates."""

    def __init__(self, topo: Topology):
        self.topo = topo
        self._last: dict[str, Scrape] = {}

    def _scrape(self, key: str, host: str, port: int) -> tuple[Scrape | None, Scrape | None]:
        now, before = scrape(host, port), self._last.get(key)
        if now is not None:
            self._last[key] = now
        return now, before

    def _stage(self, k: int, r: int, endpoint: StageEndpoint) -> StageView:
        """One stage of one lane (``1.r2``: stage 1 of lane 2), with the node it runs on if known."""
        row = stage_row(endpoint.address)
        key = f"stage{k}" if r == 0 else f"stage{k}.r{r}"
        stage_figures(row, *self._scrape(key, endpoint.host, endpoint.metrics_port), k)
        return StageView(k, r, endpoint.node, row)

    def snapshot(self) -> FleetSnapshot:
        """Every stage of every lane and every coordinator, read now (rates since the last call)."""
        stages = [self._stage(k, r, e) for r, lane in enumerate(self.topo.lanes) for k, e in enumerate(lane)]
        coordinators = [
            coordinator_row(e.address, c, *self._scrape(f"coordinator{c}", e.host, e.metrics_port))
            for c, e in enumerate(self.topo.coordinators)
        ]
        return FleetSnapshot(stages, coordinators)
