"""``pipeshard wan up`` / ``pipeshard wan down``: a WAN-emulated fleet as background processes.

``up`` finds or exports the shards as ``pipeshard up`` does, starts a :class:`WanFleet` detached
(state in run/wan/, so ``down`` stops exactly it) with a TTL after which it tears itself down, and
prints ``coordinator listening on HOST:PORT``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipeshard.paths import DEFAULT_MODEL
from pipeshard.precision import DEFAULT_PRECISION, PRECISIONS
from pipeshard.services.draft_training import (
    add_flag,
    default_mode,
    draft_watch_args,
    start_background_training,
)
from pipeshard.services.fleet_cli import ensure_shards
from pipeshard.services.launcher import default_speculation, draft_heads_args, feature_draft_args
from pipeshard.services.wan import netns, state
from pipeshard.services.wan.emulator import WanFleet
from pipeshard.services.wan.netns import WanError
from pipeshard.shard.manifest import WEIGHT_FORMATS

RUN_DIR = Path("run/wan")


def register(sub: argparse._SubParsersAction) -> None:
    wan = sub.add_parser("wan", help="a fleet over emulated WAN links (root: namespaces, tbf, delay)")
    wan_sub = wan.add_subparsers(dest="wan_command", required=True)
    up = wan_sub.add_parser("up", help="start stages in namespaces behind delayed, rate-capped links")
    up.add_argument("--stages", type=int, default=2)
    up.add_argument("--delay-ms", type=float, default=50.0, help="one-way delay added on every hop")
    up.add_argument("--rate-mbit", type=float, default=100.0, help="tbf cap on every veth (0 = none)")
    up.add_argument("--weights", choices=WEIGHT_FORMATS, default="int4")
    up.add_argument("--precision", choices=PRECISIONS, default=DEFAULT_PRECISION)
    up.add_argument("--model", default=DEFAULT_MODEL)
    up.add_argument("--port", type=int, default=50051, help="coordinator port on 127.0.0.1 (0 = any)")
    up.add_argument("--ttl-s", type=float, default=3600.0, help="tear down by itself after this long")
    up.add_argument(
        "--feature-draft",
        default="auto",
        help="auto: offer a feature draft trained for this export's weights as the default "
        "speculation; off; or a draft folder",
    )
    add_flag(up)
    up.add_argument(
        "--draft-heads",
        default="auto",
        help="auto: the final stage runs draft heads trained for this export's weights (the `medusa` "
        "source); off; or a heads folder",
    )
    up.set_defaults(func=run_up)
    down = wan_sub.add_parser("down", help="stop what `pipeshard wan up` started, delete its namespaces")
    down.add_argument(
        "--run-dir",
        type=Path,
        default=RUN_DIR,
        help="the fleet's folder (a benchmark's WAN fleet, e.g. run/bench-spec-wan-3s-25ms, left up "
        "by a killed run)",
    )
    down.set_defaults(func=run_down)


def run_up(args: argparse.Namespace) -> int:
    try:
        netns.require_root(bool(args.rate_mbit))
        shards = ensure_shards(args.model, args.stages, args.weights)
        feature = feature_draft_args(shards, args.feature_draft)
        speculation, said = default_speculation(feature)
        fleet = WanFleet(
            shards,
            args.stages,
            args.delay_ms,
            args.rate_mbit,
            RUN_DIR,
            args.precision,
            coordinator_port=args.port,
            detach=True,
            ttl_s=args.ttl_s,
            extra_coordinator_args=speculation + draft_watch_args(shards, feature, args.feature_draft),
            final_stage_args=draft_heads_args(shards, args.draft_heads),
        )
        training = start_background_training(shards, args.draft_training or default_mode(), feature)
    except WanError as exc:
        print(f"wan up: {exc}", file=sys.stderr)
        return 1
    cap = f"{args.rate_mbit:g} mbit" if args.rate_mbit else "no rate cap"
    print(f"WAN emulator: {args.delay_ms:g} ms one way per hop, {cap}; logs in {RUN_DIR}/")
    print(f"stops by itself in {args.ttl_s:g} s unless `pipeshard wan down` runs first")
    print(said)
    if training is not None:
        print(training.said())
    for link in fleet.links:
        print(f"stage {link.index} in namespace {link.namespace} on {link.ns_ip}")
    print(f"coordinator listening on {fleet.coordinator}", flush=True)
    return 0


def run_down(args: argparse.Namespace) -> int:
    try:
        netns.require_root(rate_limited=False)
    except WanError as exc:
        print(f"wan down: {exc}", file=sys.stderr)
        return 1
    stopped, names = state.teardown(args.run_dir)
    leftovers = netns.orphans()
    netns.destroy(leftovers)
    print(f"stopped {', '.join(stopped)}" if stopped else "no WAN fleet was running")
    if names or leftovers:
        print(f"deleted namespaces {', '.join(names + leftovers)}")
    return 0
