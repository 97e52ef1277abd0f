"""What ``pipeshard up --ray``, ``down`` and ``fleet plan --ray`` do (imported only with Ray installed)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import ray

from pipeshard.errors import InvalidArgument, PipeshardError
from pipeshard.paths import shards_dir
from pipeshard.planning.cli import _model_dir
from pipeshard.services.raycluster.actors import NAMESPACE
from pipeshard.services.raycluster.fleet import RaySpec, remove, save_state, up
from pipeshard.services.raycluster.keeper import KEEPER, keeper, start_keeper
from pipeshard.services.raycluster.members import members
from pipeshard.services.raycluster.placement import FleetPlan, plan_fleet
from pipeshard.topology import COORDINATOR_PORT, EXPORTER_PORT, STAGE_PORT_BASE


def connect(address: str) -> None:
    """Join the Ray cluster at ``address`` (``auto``: the one this machine runs) as a driver."""
    ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, ignore_reinit_error=True)


def plan_here(args: argparse.Namespace) -> FleetPlan:
    found = members()
    model_dir = _model_dir(args.model)
    return plan_fleet(found, model_dir, args.weights, stages=args.stages, profile=not args.no_profile)


def print_placement(fp: FleetPlan) -> None:
    by_name = {m.name: m for m in fp.members}
    print(f"{len(fp.members)} alive node(s); lanes placed {fp.strategy}, one placement group each")
    for m in fp.members:
        head = " (head)" if m.is_head else ""
        print(f"  node {m.name} {m.ip}: {m.memory_bytes / 2**20:.0f} MiB, {m.device}{head}")
    for k, s in enumerate(fp.plan.stages):
        where = f"on {s.node} ({by_name[s.node].ip})" if s.node in by_name else "where Ray has room"
        print(f"  stage {k}: layers {s.layer_start}:{s.layer_end}, {s.memory_bytes / 2**20:.0f} MiB, {where}")
    print(f"split {fp.plan.ranges}")


def run_plan(args: argparse.Namespace) -> int:
    try:
        connect(args.ray)
        print_placement(plan_here(args))
    except PipeshardError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, InvalidArgument) else 1
    return 0


def run_up(args: argparse.Namespace, run_dir: Path, topology: Path) -> int:
    state = run_dir / "ray.json"
    if state.exists() or (run_dir / "pids").exists():
        print("a fleet is already up (run `make down` first)", file=sys.stderr)
        return 1
    auto = args.replicas == "auto"
    spec = RaySpec(
        shards_root=shards_dir().resolve(),
        work_dir=(run_dir / "ray").resolve(),
        topology=topology.resolve(),
        model=args.model,
        weights=args.weights,
        precision=args.precision,
        replicas=1 if auto else int(args.replicas),
        auto_replicas=auto,
        stage_port_base=STAGE_PORT_BASE,
        coordinator_port=COORDINATOR_PORT,
        exporter_port=EXPORTER_PORT,
        gateway_port=args.gateway_port,
        metrics=True,
    )
    try:
        connect(args.ray)
        fp = plan_here(args)
        print_placement(fp)
        fleet = up(spec, fp)
    except PipeshardError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, InvalidArgument) else 1
    start_keeper(fleet)
    save_state(fleet, state, args.ray)
    print(f"export {fleet.shards}; topology written to {topology}; node logs in {spec.work_dir}/")
    print(f"exporter listening on {fleet.exporter.address}")
    for r, lane in enumerate(fleet.lanes):
        for k, s in enumerate(lane):
            print(
                f"stage {k} listening on {s.address} on node {s.node_id[:8]}"
                + (f" (replica {r})" if r else "")
            )
    print(f"coordinator listening on {fleet.coordinator.address}")
    if fleet.gateway is not None:
        print(f"openai gateway listening on {fleet.gateway.address}")
    print("Ray's dashboard shows each actor, its node, its restarts and its log", flush=True)
    return 0


def run_down(run_dir: Path) -> list[str]:
    state_file = run_dir / "ray.json"
    state = json.loads(state_file.read_text())
    connect(os.environ.get("RAY_ADDRESS", state["address"]))
    # every named actor of the namespace: lanes the keeper added since `up` as well
    stopped = remove([KEEPER, *state["actors"], *ray.util.list_named_actors()])
    state_file.unlink()
    return stopped


def run_replan(args: argparse.Namespace) -> int:
    connect(args.ray)
    added = ray.get(keeper().replan.remote())
    print(f"{added} lane(s) added" if added else "no room for another lane")
    return 0


def run_drain(args: argparse.Namespace) -> int:
    connect(args.ray)
    node = args.stage_addr
    drained = ray.get(keeper().drain.remote(node))
    print(f"lane(s) {drained} drained off node {node}" if drained else f"no lane has a stage on node {node}")
    return 0 if drained else 1
