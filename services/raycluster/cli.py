"""The Ray options of ``pipeshard up`` / ``down`` and ``pipeshard fleet plan --ray``.

Ray is an optional extra: these flags are always there, and Ray is imported only when one is used,
so without it `make up` is unchanged and ``--ray`` says how to install it.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

from pipeshard.paths import DEFAULT_MODEL
from pipeshard.services.fleet_cli import RUN_DIR, TOPOLOGY

INSTALL = "pipeshard's Ray fleet needs Ray: pip install -e '.[ray]' (`make setup` installs it)"


def _commands():
    if importlib.util.find_spec("ray") is None:
        raise SystemExit(INSTALL)
    from pipeshard.services.raycluster import commands

    return commands


def _replicas(text: str) -> str:
    if text != "auto" and not (text.isdigit() and int(text) >= 1):
        raise argparse.ArgumentTypeError(f"must be a positive integer or auto, got {text!r}")
    return text


def register(sub: argparse._SubParsersAction) -> None:
    up = sub.choices["up"]
    up.add_argument(
        "--ray",
        nargs="?",
        const="auto",
        default=os.environ.get("PIPESHARD_RAY") or None,
        metavar="ADDRESS",
        help="start the fleet as actors on a Ray cluster (auto: the one this machine is in; or "
        "HEAD:6379); the planner places layers over its nodes unless --stages is given (docs/RAY.md)",
    )
    up.add_argument(
        "--no-profile",
        action="store_true",
        help="with --ray: plan by memory alone (every node as fast) instead of `pipeshard profile` per node",
    )
    for action in up._actions:
        if action.dest == "replicas":  # a Ray fleet may grow a lane whenever a node with room joins
            action.type, action.help = _replicas, f"{action.help}; with --ray also auto: a lane per room"
        if action.dest == "stages":  # unset: with --ray the planner chooses, else 2
            action.default, action.help = None, "stages of the export (default 2; with --ray: the planner's)"
    plain_up, plain_down = up.get_default("func"), sub.choices["down"].get_default("func")

    def run_up(args: argparse.Namespace) -> int:
        if args.ray:
            if args.coordinators != 1:
                print(
                    "--coordinators: a Ray fleet has one coordinator (a group is for plain processes)",
                    file=sys.stderr,
                )
                return 2
            return _commands().run_up(args, RUN_DIR, TOPOLOGY)
        if args.replicas == "auto":
            print("--replicas auto needs --ray", file=sys.stderr)
            return 2
        args.replicas = int(args.replicas)
        args.stages = args.stages or 2
        return plain_up(args)

    def run_down(args: argparse.Namespace) -> int:
        if (RUN_DIR / "ray.json").exists():
            stopped = _commands().run_down(RUN_DIR)
            print(
                f"stopped {', '.join(stopped)} on the Ray cluster" if stopped else "no Ray fleet was running"
            )
            return 0
        return plain_down(args)

    up.set_defaults(func=run_up)
    sub.choices["down"].set_defaults(func=run_down)
    lanes = next(a for a in sub.choices["fleet"]._actions if isinstance(a, argparse._SubParsersAction))
    plan = lanes.add_parser(
        "plan", help="print where `up --ray` would place the layers, without starting anything"
    )
    plan.add_argument("--ray", nargs="?", const="auto", default=os.environ.get("PIPESHARD_RAY", "auto"))
    plan.add_argument("--model", default=DEFAULT_MODEL)
    plan.add_argument("--weights", default="int4")
    plan.add_argument("--stages", type=int, default=None, help="an even split of this many stages")
    plan.add_argument("--no-profile", action="store_true", help="plan by memory alone")
    plan.set_defaults(func=lambda args: _commands().run_plan(args))
    replan = lanes.add_parser("replan", help="a Ray fleet: add lanes while the cluster has room for one")
    replan.add_argument("--ray", nargs="?", const="auto", default=os.environ.get("PIPESHARD_RAY", "auto"))
    replan.set_defaults(func=lambda args: _commands().run_replan(args))
    drain = lanes.choices["drain"]
    drain.add_argument(
        "--ray",
        nargs="?",
        const="auto",
        default=None,
        metavar="ADDRESS",
        help="a Ray fleet: STAGE_ADDR is a node id (or its first characters, as `up --ray` prints it); "
        "its lanes move off it, a replacement started first where there is room",
    )
    plain_drain = drain.get_default("func")
    drain.set_defaults(func=lambda args: _commands().run_drain(args) if args.ray else plain_drain(args))
