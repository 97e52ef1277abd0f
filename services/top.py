"""``pipeshard top``: the fleet in config/topology.yaml, live in the terminal (rich).

Each refresh asks every stage for GetStageInfo and grpc.health, the coordinator for its health and
(when its metrics port serves) its Generate calls by status code, and the gateway for /health.
Everything is read through the services' public interfaces; a part that does not answer shows as
down and the view keeps refreshing.
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

from pipeshard.topology import Topology
from pipeshard.v1 import stage_pb2, stage_pb2_grpc

TIMEOUT_S = 2.0


@dataclass
class StageRow:
    address: str
    health: str
    layers: str = "?"
    sessions: str = "?"


@dataclass
class CoordinatorRow:
    address: str
    health: str
    generate_calls: dict[str, int] = field(default_factory=dict)


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
        return row


def _generate_calls(host: str, metrics_port: int) -> dict[str, int]:
    """Finished Generate calls by status code, from the coordinator's /metrics (empty if none)."""
    try:
        with urllib.request.urlopen(f"http://{host}:{metrics_port}/metrics", timeout=TIMEOUT_S) as reply:
            text = reply.read().decode()
    except OSError:
        return {}
    calls: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "pipeshard_rpc_requests":
            continue
        for sample in family.samples:
            if sample.name.endswith("_total") and sample.labels.get("method") == "Generate":
                calls[sample.labels["code"]] = int(sample.value)
    return calls


def coordinator_row(topo: Topology) -> CoordinatorRow:
    with grpc.insecure_channel(topo.coordinator.address) as channel:
        row = CoordinatorRow(topo.coordinator.address, _health(channel))
    row.generate_calls = _generate_calls(topo.coordinator.host, topo.coordinator.metrics_port)
    return row


def gateway_health(url: str) -> str:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=TIMEOUT_S) as reply:
            return "serving" if reply.status == 200 else f"down ({reply.status})"
    except OSError as exc:
        return f"down ({getattr(exc, 'code', None) or type(exc).__name__})"


def render(topo: Topology, gateway: str | None) -> Group:
    stages = Table(title="stages", title_justify="left")
    for column in ("stage", "address", "layers", "health", "live sessions"):
        stages.add_column(column)
    for k, endpoint in enumerate(topo.stages):
        row = stage_row(endpoint.address)
        stages.add_row(str(k), row.address, row.layers, row.health, row.sessions)
    coordinator = coordinator_row(topo)
    front = Table(title="front", title_justify="left")
    for column in ("service", "address", "health", "Generate calls by code"):
        front.add_column(column)
    calls = ", ".join(f"{code} {n}" for code, n in sorted(coordinator.generate_calls.items())) or "-"
    front.add_row("coordinator", coordinator.address, coordinator.health, calls)
    if gateway:
        front.add_row("openai gateway", gateway, gateway_health(gateway), "")
    return Group(stages, front)


def run(args: argparse.Namespace) -> int:
    topo = Topology.load(args.topology)
    if args.once:
        Console(width=None if sys.stdout.isatty() else 160).print(render(topo, args.gateway))
        return 0
    with Live(render(topo, args.gateway), refresh_per_second=4, screen=False) as live:
        try:
            while True:
                time.sleep(args.interval)
                live.update(render(topo, args.gateway))
        except KeyboardInterrupt:
            return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("top", help="show the fleet live: stages, coordinator, gateway (Ctrl-C to quit)")
    p.add_argument("--topology", type=Path, default=Path("config/topology.yaml"))
    p.add_argument("--gateway", default="http://127.0.0.1:8080", help="gateway URL ('' to leave it out)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    p.add_argument("--once", action="store_true", help="print one snapshot and exit")
    p.set_defaults(func=run)
