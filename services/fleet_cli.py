"""``pipeshard up`` / ``pipeshard down``: a loopback fleet as background processes.

``up`` fetches the default model and exports shards when they are missing, writes
config/topology.yaml with the default ports, starts the stages, the coordinator and the OpenAI
gateway, waits until they serve, and prints ``coordinator listening on HOST:PORT`` and
``openai gateway listening on HOST:PORT``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from pipeshard.auth import load_or_create_token
from pipeshard.certs_cli import node_names
from pipeshard.errors import InvalidArgument
from pipeshard.keys import default_key_file
from pipeshard.paths import DEFAULT_MODEL, certs_dir, export_name, shards_dir
from pipeshard.precision import DEFAULT_PRECISION, INVARIANT_LADDER, PRECISIONS, ladder
from pipeshard.services.draft_training import (
    add_flag,
    default_mode,
    draft_watch_args,
    start_background_training,
)
from pipeshard.services.gateway.settings import GATEWAY_METRICS_PORT, GATEWAY_PORT
from pipeshard.services.launcher import (
    coordinator_name,
    default_speculation,
    draft_heads_args,
    feature_draft_args,
    process_start_time,
    recorded,
    stage_name,
    start_fleet,
    stop_recorded,
)
from pipeshard.shard.device import DEFAULT_DEVICE
from pipeshard.shard.manifest import WEIGHT_FORMATS
from pipeshard.sizes import parse_bytes
from pipeshard.tls import CA_CERT, make_certs
from pipeshard.topology import Topology

RUN_DIR = Path("run")
RUN_CA_CERT = RUN_DIR / "ca.pem"  # where the CLI and the Python client look for the CA
TOPOLOGY = Path("config/topology.yaml")


def invariant_ladder(value: str) -> str:
    """``--invariant-ladder``, refused by the parser when it names an unknown configuration
    (before any stage starts to compile)."""
    try:
        ladder(value)
    except InvalidArgument as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def register(sub: argparse._SubParsersAction) -> None:
    up = sub.add_parser("up", help="start a loopback fleet (exports shards first if missing)")
    up.add_argument("--stages", type=int, default=2)
    up.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="processes per stage (replica r of stage k on port 50061+k+20r), each forwarding to every "
        "replica of the next; the coordinator spreads sessions over the lanes (replica r of each "
        "stage) and moves only a failed replica's stage of the sessions routed through it",
    )
    up.add_argument(
        "--coordinators",
        type=int,
        default=1,
        help="coordinators over the same stages, a group (coordinator c on port 50051+c); the gateway "
        "spreads requests over them and continues a dead one's streams on another",
    )
    up.add_argument("--weights", choices=WEIGHT_FORMATS, default="int4")
    up.add_argument("--precision", choices=PRECISIONS, default=DEFAULT_PRECISION)
    up.add_argument(
        "--invariant-ladder",
        type=invariant_ladder,
        default="",
        help="at --precision invariant: the configurations every paged stage tries, fastest first, "
        f"comma-separated (default {','.join(INVARIANT_LADDER)})",
    )
    up.add_argument("--model", default=DEFAULT_MODEL)
    up.add_argument(
        "--device",
        default=os.environ.get("PIPESHARD_DEVICE", DEFAULT_DEVICE),
        help="OpenVINO device of every stage (CPU, GPU.1, AUTO:GPU,CPU, ...; per stage: edit "
        "config/topology.yaml and start stages with --topology)",
    )
    up.add_argument(
        "--secure",
        action="store_true",
        help="mutual TLS between all processes and a client token (certificates made if missing)",
    )
    up.add_argument("--gateway-port", type=int, default=GATEWAY_PORT, help="OpenAI gateway HTTP port")
    up.add_argument(
        "--feature-draft",
        default="auto",
        help="auto: offer a feature draft trained for this export's weights (`make distil KIND=eagle`) "
        "as the default speculation; off; or a draft folder",
    )
    add_flag(up)
    up.add_argument(
        "--draft-heads",
        default="auto",
        help="auto: the final stage runs draft heads trained for this export's weights (`make distil "
        "KIND=medusa`), offered as `medusa`; off; or a heads folder",
    )
    up.add_argument(
        "--stage-memory-limit",
        default=None,
        help="run every stage in its own memory cgroup capped at this size (6G, 512M, bytes)",
    )
    up.set_defaults(func=run_up)
    down = sub.add_parser("down", help="stop the fleet that `pipeshard up` started")
    down.set_defaults(func=run_down)
    fleet = sub.add_parser(
        "fleet", help="change the replica lanes of a running fleet (topology file, then SIGHUP)"
    )
    lanes = fleet.add_subparsers(dest="fleet_command", required=True)
    drain = lanes.add_parser(
        "drain", help="take out the lane holding STAGE_ADDR: no new sessions, closed once its requests end"
    )
    drain.add_argument("stage_addr", help="host:port of any stage of the lane")
    add = lanes.add_parser("add", help="add a lane: one replica of every stage, started beforehand")
    add.add_argument(
        "stages", help="host:port of each stage's new replica, in pipeline order, comma-separated"
    )
    for command in (drain, add):
        command.add_argument("--topology", type=Path, default=TOPOLOGY, help="the coordinator's --topology")
        command.add_argument(
            "--run-dir",
            type=Path,
            default=RUN_DIR,
            help="where `pipeshard up` recorded the coordinator's pid",
        )
    drain.set_defaults(func=run_fleet_drain)
    add.set_defaults(func=run_fleet_add)


def ensure_shards(model: str, stages: int, weights: str) -> Path:
    """The export folder for (model, stages, weights), fetching and exporting it when missing."""
    shards = shards_dir() / export_name(model, stages, weights)
    if not (shards / "manifest.json").exists():
        cli = [sys.executable, "-m", "pipeshard.cli"]
        subprocess.run([*cli, "model", "fetch"], check=True)
        subprocess.run(
            [
                *cli,
                "export",
                "--model",
                model,
                "--stages",
                str(stages),
                "--weights",
                weights,
                "--out",
                str(shards),
            ],
            check=True,
        )
    return shards


def run_up(args: argparse.Namespace) -> int:
    if args.coordinators < 1:
        print(f"--coordinators must be at least 1, got {args.coordinators}", file=sys.stderr)
        return 2
    if (RUN_DIR / "pids").exists():
        print("a fleet is already up (run `make down` first)", file=sys.stderr)
        return 1
    limit = (
        None
        if args.stage_memory_limit is None
        else parse_bytes(args.stage_memory_limit, "stage_memory_limit")
    )
    shards = ensure_shards(args.model, args.stages, args.weights)
    topo = Topology.loopback(
        str(shards),
        args.stages,
        args.precision,
        device=args.device,
        replicas=args.replicas,
        invariant_ladder=args.invariant_ladder,
        coordinators=args.coordinators,
    )
    topo.save(TOPOLOGY)
    tls_dir, token = secure_setup(args.stages) if args.secure else (None, None)
    # With replicas the coordinator reads the topology too, so `pipeshard fleet drain|add` and a
    # SIGHUP change its lanes at run time.
    lanes_file = ["--topology", str(TOPOLOGY)] if args.replicas > 1 else []
    feature = feature_draft_args(shards, args.feature_draft)
    speculation, said = default_speculation(feature)
    watch = draft_watch_args(shards, feature, args.feature_draft)
    heads = draft_heads_args(shards, args.draft_heads)
    fleet = start_fleet(
        shards,
        args.stages,
        RUN_DIR,
        extra_coordinator_args=lanes_file + speculation + watch,
        extra_stage_args=["--invariant-ladder", args.invariant_ladder] if args.invariant_ladder else [],
        final_stage_args=heads,
        stage_ports=[s.port for s in topo.stages],
        coordinator_port=topo.coordinator.port,
        exporter_port=topo.exporter.port,
        gateway_port=args.gateway_port,
        extra_gateway_args=["--topology", str(TOPOLOGY.resolve())],  # the /ui page's fleet view
        metrics_ports={
            "exporter": topo.exporter.metrics_port,
            **{
                stage_name(k, r): s.metrics_port
                for r, lane in enumerate(topo.lanes)
                for k, s in enumerate(lane)
            },
            **{coordinator_name(c): e.metrics_port for c, e in enumerate(topo.coordinators)},
            "gateway": GATEWAY_METRICS_PORT,
        },
        detach=True,
        precision=args.precision,
        devices=[s.device for s in topo.stages],
        tls_dir=tls_dir,
        token=token,
        api_keys=default_key_file() if args.secure else None,
        replicas=args.replicas,
        stage_memory_limit=limit,
        coordinators=args.coordinators,
    )
    training = start_background_training(shards, args.draft_training or default_mode(), feature)
    if tls_dir is not None:
        shutil.copyfile(tls_dir / CA_CERT, RUN_CA_CERT)  # where clients look by default
        print(f"secured: mutual TLS with the CA in {tls_dir}; clients use {RUN_DIR / 'ca.pem'} and the token")
        print(f"API keys: {default_key_file()} (re-read on change; `pipeshard keys add NAME` makes one)")
    else:
        print("plaintext on loopback (`make up SECURE=1` for TLS and a token)")
    print(said)
    if training is not None:
        print(training.said())
    if heads:
        print(f"draft heads: {heads[1]} on the final stage (speculative `medusa`)")
    print(f"topology written to {TOPOLOGY}; logs in {RUN_DIR}/")
    print(f"exporter listening on {topo.exporter.address}")
    for r, lane in enumerate(fleet.lanes):
        for k, address in enumerate(lane):
            print(f"stage {k} listening on {address}" + (f" (replica {r})" if r else ""))
    for c, address in enumerate(fleet.coordinators):
        print(f"coordinator listening on {address}" + (f" (coordinator {c} of the group)" if c else ""))
    metrics = [topo.exporter.metrics_port, *(s.metrics_port for lane in topo.lanes for s in lane)]
    metrics += [e.metrics_port for e in topo.coordinators]
    metrics += [GATEWAY_METRICS_PORT]
    print(f"/metrics on ports {', '.join(map(str, metrics))}; watch the fleet with `pipeshard top`")
    print(f"openai gateway listening on {fleet.gateway}", flush=True)
    return 0


def secure_setup(stages: int) -> tuple[Path, str]:
    """Certificates in certs/ (made if missing) and the client token: PIPESHARD_TOKEN when set,
    else the one stored in certs/token (generated there the first time)."""
    folder = certs_dir()
    make_certs(folder, node_names(stages))
    token = os.environ.get("PIPESHARD_TOKEN")
    if token:
        print("client token: PIPESHARD_TOKEN from the environment")
    else:
        stored = folder / "token"
        token = load_or_create_token(stored)
        print(f"client token stored in {stored} (mode 0600; clients read it there or from PIPESHARD_TOKEN)")
    return folder, token


def run_down(args: argparse.Namespace) -> int:
    RUN_CA_CERT.unlink(missing_ok=True)
    stopped = stop_recorded(RUN_DIR)
    print(f"stopped {', '.join(stopped)}" if stopped else "no fleet was running")
    return 0


def run_fleet_drain(args: argparse.Namespace) -> int:
    topo = Topology.load(args.topology).without_lane(args.stage_addr)
    topo.save(args.topology)
    return _reload_coordinator(args.run_dir, f"the lane holding {args.stage_addr} drains")


def run_fleet_add(args: argparse.Namespace) -> int:
    topo = Topology.load(args.topology).with_lane(args.stages.split(","))
    topo.save(args.topology)
    return _reload_coordinator(args.run_dir, f"lane {args.stages} joins once it answers")


def _reload_coordinator(run_dir: Path, what: str) -> int:
    """SIGHUP to the coordinator `pipeshard up` recorded (a recycled pid is left alone)."""
    for pid, started, name in recorded(run_dir):
        if name == "coordinator" and process_start_time(pid) == started:
            os.kill(pid, signal.SIGHUP)
            print(f"topology written; coordinator {pid} re-reads it: {what} (see its log)")
            return 0
    print(f"topology written; no running coordinator recorded in {run_dir}: send it SIGHUP", file=sys.stderr)
    return 1
