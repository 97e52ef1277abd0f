"""``pipeshard top``: the fleet in config/topology.yaml, live in the terminal (rich).

Each refresh asks every stage for GetStageInfo and grpc.health, the coordinator for its health,
the gateway for /health, and every stage and the coordinator for their /metrics (step time, rows
per step, cache use; users, queue, tokens). Rates (step time, tok/s) are taken over the last
refresh interval. Everything is read through the services' public interfaces; a part that does
not answer shows as down (or its figures as "-") and the view keeps refreshing.
"""

from __future__ import annotations

import argparse
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from pipeshard.metrics import (
    COORDINATOR_QUEUED,
    COORDINATOR_RUNNING,
    GENERATED_TOKENS,
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
    generate_calls: dict[str, int] = field(default_factory=dict)
    users: str = "-"
    queue: str = "-"
    tok_s: str = "-"


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
        row.precision = f"{info.precision or '?'} ({'invariant' if info.invariant else 'load-dependent'})"
        return row


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


def coordinator_row(topo: Topology, now: Scrape | None, before: Scrape | None) -> CoordinatorRow:
    with grpc.insecure_channel(topo.coordinator.address) as channel:
        row = CoordinatorRow(topo.coordinator.address, _health(channel))
    row.generate_calls = _generate_calls(now)
    if now is not None:
        row.users = f"{now.value(_name(COORDINATOR_RUNNING)):.0f}"
        row.queue = f"{now.value(_name(COORDINATOR_QUEUED)):.0f}"
        if before is not None and now.at > before.at:
            tokens = f"{_name(GENERATED_TOKENS)}_total"
            row.tok_s = f"{(now.value(tokens) - before.value(tokens)) / (now.at - before.at):.1f}"
    return row


def gateway_health(url: str) -> str:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=TIMEOUT_S) as reply:
            return "serving" if reply.status == 200 else f"down ({reply.status})"
    except OSError as exc:
        return f"down ({getattr(exc, 'code', None) or type(exc).__name__})"


class View:
    """Renders the fleet; keeps the previous scrape of each /metrics page for the rates."""

    def __init__(self, topo: Topology, gateway: str | None):
        self.topo = topo
        self.gateway = gateway
        self._last: dict[str, Scrape] = {}

    def _scrape(self, key: str, host: str, port: int) -> tuple[Scrape | None, Scrape | None]:
        now, before = scrape(host, port), self._last.get(key)
        if now is not None:
            self._last[key] = now
        return now, before

    def _stage_row(self, stages: Table, k: int, r: int, endpoint: StageEndpoint) -> None:
        """One stage of one lane (``1.r2``: stage 1 of lane 2), with the node it runs on if known."""
        row = stage_row(endpoint.address)
        key = f"stage{k}" if r == 0 else f"stage{k}.r{r}"
        stage_figures(row, *self._scrape(key, endpoint.host, endpoint.metrics_port), k)
        stages.add_row(
            str(k) if r == 0 else f"{k}.r{r}",
            endpoint.node[:8] or "-",
            row.address,
            row.layers,
            row.health,
            row.precision,
            row.step_ms,
            row.rows_per_step,
            row.sessions,
            row.cache,
        )

    def render(self) -> Group:
        stages = Table(title="stages", title_justify="left")
        for column in (
            "stage",
            "node",
            "address",
            "layers",
            "health",
            "precision",
            "step ms",
            "rows/step",
            "sessions",
            "cache",
        ):
            stages.add_column(column)
        for r, lane in enumerate(self.topo.lanes):
            for k, endpoint in enumerate(lane):
                self._stage_row(stages, k, r, endpoint)
        c = self.topo.coordinator
        coordinator = coordinator_row(self.topo, *self._scrape("coordinator", c.host, c.metrics_port))
        front = Table(title="front", title_justify="left")
        for column in ("service", "address", "health", "users", "queue", "tok/s", "Generate calls by code"):
            front.add_column(column)
        calls = ", ".join(f"{code} {n}" for code, n in sorted(coordinator.generate_calls.items())) or "-"
        front.add_row(
            "coordinator",
            coordinator.address,
            coordinator.health,
            coordinator.users,
            coordinator.queue,
            coordinator.tok_s,
            calls,
        )
        if self.gateway:
            front.add_row("openai gateway", self.gateway, gateway_health(self.gateway), "", "", "", "")
        return Group(stages, front)


def run(args: argparse.Namespace) -> int:
    view = View(Topology.load(args.topology), args.gateway)
    if args.once:
        view.render()  # a first scrape, so the rates cover one interval
        time.sleep(args.interval)
        Console(width=None if sys.stdout.isatty() else 160).print(view.render())
        return 0
    with Live(view.render(), refresh_per_second=4, screen=False) as live:
        try:
            while True:
                time.sleep(args.interval)
                live.update(view.render())
        except KeyboardInterrupt:
            return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("top", help="show the fleet live: stages, coordinator, gateway (Ctrl-C to quit)")
    p.add_argument("--topology", type=Path, default=Path("config/topology.yaml"))
    p.add_argument("--gateway", default="http://127.0.0.1:8080", help="gateway URL ('' to leave it out)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    p.add_argument(
        "--once", action="store_true", help="print one snapshot (rates over one interval) and exit"
    )
    p.set_defaults(func=run)
