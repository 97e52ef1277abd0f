"""``pipeshard top``: the fleet in config/topology.yaml, live in the terminal (rich).

Each refresh reads the fleet (fleet_status.py: stages, lanes, every coordinator; rates over the last
refresh interval) and the gateway's /health; a part that does not answer shows as down (or its
figures as "-") and the view keeps refreshing.
"""

from __future__ import annotations

import argparse
import sys
import time
import urllib.request
from pathlib import Path

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from pipeshard.services.fleet_status import TIMEOUT_S, FleetReader
from pipeshard.topology import Topology


def gateway_health(url: str) -> str:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=TIMEOUT_S) as reply:
            return "serving" if reply.status == 200 else f"down ({reply.status})"
    except OSError as exc:
        return f"down ({getattr(exc, 'code', None) or type(exc).__name__})"


class View(FleetReader):
    """Renders the fleet in the terminal, the gateway's /health with it when given."""

    def __init__(self, topo: Topology, gateway: str | None):
        super().__init__(topo)
        self.gateway = gateway

    def render(self) -> Group:
        snapshot = self.snapshot()
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
        for view in snapshot.stages:
            row = view.row
            stages.add_row(
                view.label,
                view.node[:8] or "-",
                row.address,
                row.layers,
                row.health,
                row.precision,
                row.step_ms,
                row.rows_per_step,
                row.sessions,
                row.cache,
            )
        front = Table(title="front", title_justify="left")
        for column in (
            "service",
            "address",
            "health",
            "users",
            "queue",
            "tok/s",
            "speculation",
            "Generate calls by code",
        ):
            front.add_column(column)
        group = len(snapshot.coordinators) > 1
        for coordinator in snapshot.coordinators:
            calls = ", ".join(f"{code} {n}" for code, n in sorted(coordinator.generate_calls.items())) or "-"
            front.add_row(
                f"coordinator {coordinator.index}" if group else "coordinator",
                coordinator.address,
                coordinator.health,
                coordinator.users,
                coordinator.queue,
                coordinator.tok_s,
                coordinator.speculation,
                calls,
            )
        if self.gateway:
            front.add_row("openai gateway", self.gateway, gateway_health(self.gateway), "", "", "", "", "")
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
    p = sub.add_parser("top", help="show the fleet live: stages, coordinators, gateway (Ctrl-C to quit)")
    p.add_argument("--topology", type=Path, default=Path("config/topology.yaml"))
    p.add_argument("--gateway", default="http://127.0.0.1:8080", help="gateway URL ('' to leave it out)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    p.add_argument(
        "--once", action="store_true", help="print one snapshot (rates over one interval) and exit"
    )
    p.set_defaults(func=run)
