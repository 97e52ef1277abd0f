"""What ``pipeshard up --ray``, ``down`` and ``fleet plan --ray`` do (imported only with Ray installed)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import ray

from pipeshard.auth import load_or_create_token
from pipeshard.errors import InvalidArgument, PipeshardError
from pipeshard.keys import default_key_file
from pipeshard.paths import certs_dir, shards_dir
from pipeshard.planning.cli import _model_dir
from pipeshard.services.raycluster.actors import NAMESPACE
from pipeshard.services.raycluster.fleet import (
    RaySpec,
    fleet_members,
    remove,
    save_state,
    start_signer,
    up,
)
from pipeshard.services.raycluster.keeper import KEEPER, keeper, start_keeper
from pipeshard.services.raycluster.members import Member, members
from pipeshard.services.raycluster.placement import FleetPlan, plan_fleet
from pipeshard.tls import CA_CERT, TOKEN_FILE, fleet_ca
from pipeshard.topology import COORDINATOR_PORT, EXPORTER_PORT, STAGE_PORT_BASE


def connect(address: str) -> None:
    """Join the Ray cluster at ``address`` (``auto``: the one this machine runs) as a driver."""
    ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, ignore_reinit_error=True)


def plan_here(args: argparse.Namespace, found: list[Member] | None = None) -> FleetPlan:
    found = members() if found is None else found
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


def secure_certs() -> Path:
    """The fleet CA and token in certs/ on this (the head's) machine, made if missing: copy
    ca.pem and token (never ca.key) to every machine that is to take stages."""
    folder = certs_dir()
    fleet_ca(folder)
    load_or_create_token(folder / TOKEN_FILE)
    return folder.resolve()


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
        certs=secure_certs() if args.secure else None,
        api_keys=default_key_file().resolve() if args.secure else None,
    )
    try:
        connect(args.ray)
        if spec.secure:
            start_signer(spec)
        found, refused = fleet_members(spec)
        for m in refused:
            print(f"node {m.name} ({m.ip}) holds no fleet CA and token in its certs/: it takes no stage")
        fp = plan_here(args, found)
        print_placement(fp)
        fleet = up(spec, fp)
    except PipeshardError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, InvalidArgument) else 1
    start_keeper(fleet)
    save_state(fleet, state, args.ray)
    if spec.certs is not None:
        shutil.copyfile(spec.certs / CA_CERT, run_dir / CA_CERT)  # where clients look by default
        print(
            f"secured: mutual TLS, each actor's key made on its node and certified by the CA in {spec.certs}"
        )
        print(f"clients use {run_dir / CA_CERT} and the token in {spec.certs / TOKEN_FILE}")
    else:
        print("plaintext on the nodes' addresses (`--secure` for mutual TLS and a token)")
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
    (run_dir / CA_CERT).unlink(missing_ok=True)
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
