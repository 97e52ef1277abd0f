"""``pipeshard plan`` and ``pipeshard profile``.

Every flag can also be set by an environment variable ``PIPESHARD_PLAN_<FLAG>`` or
``PIPESHARD_PROFILE_<FLAG>`` (for example ``PIPESHARD_PLAN_OBJECTIVE=throughput``); a flag on the
command line wins.
"""

from __future__ import annotations

import argparse
import functools
import os
import socket
import sys
from pathlib import Path

import yaml

from pipeshard import paths
from pipeshard.errors import InvalidArgument, PipeshardError
from pipeshard.planning.plan import OBJECTIVES, Plan
from pipeshard.precision import DEFAULT_PRECISION, PRECISIONS

WEIGHTS = ("int4", "int8", "fp16", "fp32")


def _env(command: str, name: str, default=None):
    return os.environ.get(f"PIPESHARD_{command.upper()}_{name.upper()}", default)


def _int(value):
    return None if value in (None, "") else int(value)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan",
        help="place layer ranges on an ordered list of nodes (dynamic programming)",
        description="Place contiguous layer ranges on the nodes of nodes.yaml, in their order, "
        "skipping nodes that do not help; print the plan with its predicted tok/s.",
    )
    env = functools.partial(_env, "plan")
    p.add_argument(
        "--nodes",
        type=Path,
        default=env("nodes"),
        required=env("nodes") is None,
        help="nodes.yaml: a list of nodes in pipeline order (docs/PLANNER.md)",
    )
    p.add_argument(
        "--model",
        default=env("model", paths.DEFAULT_MODEL),
        help="a Hugging Face model folder, or a name under the models dir (default %(default)s)",
    )
    p.add_argument(
        "--weights",
        default=env("weights", "int4"),
        choices=WEIGHTS,
        help="weight format the stages will be exported in (default %(default)s)",
    )
    p.add_argument(
        "--objective",
        default=env("objective", "latency"),
        choices=OBJECTIVES,
        help="latency: one sequence; throughput: --batch sequences in micro-batches",
    )
    p.add_argument(
        "--batch",
        type=int,
        default=_int(env("batch")),
        help="sequences decoding at once (throughput; default 8)",
    )
    p.add_argument(
        "--micro-batches",
        type=int,
        default=_int(env("micro_batches")),
        help="fix the micro-batch count instead of choosing it (throughput)",
    )
    p.add_argument(
        "--context",
        type=int,
        default=_int(env("context")),
        help="KV cache tokens reserved per sequence (default the export's max_context)",
    )
    p.add_argument(
        "--max-stage-memory",
        default=env("max_stage_memory"),
        help="no stage may need more than this (weights + KV; 6G, 512M, bytes): the plan is placed "
        "within it, or refused naming the stage over it",
    )
    p.add_argument("--out", type=Path, default=env("out"), help="write the plan here (plan.yaml)")
    p.add_argument(
        "--topology",
        type=Path,
        default=env("topology"),
        help="also write a topology file for the plan (e.g. config/topology.yaml)",
    )
    p.add_argument(
        "--shards",
        default=env("shards"),
        help="export folder the topology names (default SHARDS_DIR/<model>-<N>s-<weights>)",
    )
    p.add_argument(
        "--precision",
        default=env("precision", DEFAULT_PRECISION),
        choices=PRECISIONS,
        help="precision the topology's fleet runs at",
    )
    p.add_argument(
        "--coordinator",
        default=env("coordinator", "127.0.0.1"),
        help="HOST or HOST:PORT the topology's coordinator listens on (default %(default)s:50051)",
    )
    p.add_argument(
        "--exporter",
        default=env("exporter", "127.0.0.1"),
        help="HOST or HOST:PORT of the exporter the topology's stages pull their shards from "
        "(default %(default)s:50071)",
    )
    p.set_defaults(func=run_plan)

    q = subparsers.add_parser(
        "profile",
        help="measure this machine into a node description for `pipeshard plan`",
        description="Export four small probe stages of the model, time them (decode by rows and "
        "context, prefill by prompt length) and write a node description.",
    )
    envq = functools.partial(_env, "profile")
    q.add_argument(
        "--model",
        default=envq("model", paths.DEFAULT_MODEL),
        help="a Hugging Face model folder, or a name under the models dir (default %(default)s)",
    )
    q.add_argument("--weights", default=envq("weights", "int4"), choices=WEIGHTS)
    q.add_argument(
        "--threads",
        type=int,
        default=_int(envq("threads")),
        help="inference threads, as the stage's --num-threads (default the plugin's choice)",
    )
    q.add_argument("--precision", default=envq("precision", DEFAULT_PRECISION), choices=PRECISIONS)
    q.add_argument(
        "--device",
        default=envq("device", "CPU"),
        help="OpenVINO device to time the probes on, as the stage's --device (default %(default)s)",
    )
    q.add_argument(
        "--name", default=envq("name", socket.gethostname()), help="node name (default the hostname)"
    )
    q.add_argument("--address", default=envq("address", ""), help="HOST:PORT its stage will listen on")
    q.add_argument(
        "--peer",
        default=envq("peer"),
        help="HOST:PORT of a pipeshard service on the next node: measure the link to it",
    )
    q.add_argument(
        "--rows", default=envq("rows", "1,4"), help="rows per decode step to time (default %(default)s)"
    )
    q.add_argument(
        "--contexts",
        default=envq("contexts", "128,1024"),
        help="cache lengths to time decode at (default %(default)s)",
    )
    q.add_argument(
        "--prefill",
        default=envq("prefill", "128,512"),
        help="prompt lengths to time prefill at (default %(default)s)",
    )
    q.add_argument(
        "--out", type=Path, default=envq("out"), help="write the node description here (node.yaml)"
    )
    q.set_defaults(func=run_profile)


def _ints(text: str, field: str) -> tuple[int, ...]:
    try:
        values = tuple(int(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise InvalidArgument(field, f"must be comma-separated positive integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise InvalidArgument(field, f"must be comma-separated positive integers, got {text!r}")
    return values


def model_cost(model_dir: Path, weights: str, context: int | None):
    """The planner's view of a model folder (its config.json) exported at ``weights``."""
    from pipeshard.exporter.export import resolve_max_context
    from pipeshard.exporter.families import load_config, resolve_spec
    from pipeshard.planning.cost import ModelCost

    spec = resolve_spec(load_config(model_dir))
    return ModelCost.estimate(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        vocab_size=spec.vocab_size,
        tie_word_embeddings=spec.tie_word_embeddings,
        weights=weights,
        context=resolve_max_context(spec, context),
        name=model_dir.name,
        mlp_params=sum(spec.mlp_params(i) for i in range(spec.num_layers)) // spec.num_layers,
    )


def _model_dir(spec: str) -> Path:
    """A folder with config.json (weights are not needed to plan), or a name under the models dir."""
    for candidate in (Path(spec), paths.models_dir() / spec):
        if (candidate / "config.json").is_file():
            return candidate.resolve()
    raise InvalidArgument("model", f"no config.json at {spec} or {paths.models_dir() / spec}")


def plan_topology(
    plan: Plan, shards: str, precision: str, coordinator: str = "127.0.0.1", exporter: str = "127.0.0.1"
):
    """The plan's fleet: each stage at its node's address on its node's device (nodes without an
    address keep the default port 50061+k on 127.0.0.1), the coordinator and the exporter at
    ``coordinator`` and ``exporter`` (HOST or HOST:PORT, default ports 50051 and 50071)."""
    from pipeshard.topology import (
        COORDINATOR_PORT,
        EXPORTER_PORT,
        METRICS_OFFSET,
        Endpoint,
        StageEndpoint,
        Topology,
    )

    def endpoint(spec: str, default_port: int, field: str) -> tuple[str, int]:
        host, sep, port = spec.rpartition(":")
        if not sep:
            return spec, default_port
        if not host or not port.isdigit():
            raise InvalidArgument(field, f"must be HOST or HOST:PORT, got {spec!r}")
        return host, int(port)

    topo = Topology.loopback(shards, len(plan.stages), precision)
    for k, stage in enumerate(plan.stages):
        host, port = topo.stages[k].host, topo.stages[k].port
        if stage.address:
            host, port = endpoint(stage.address, port, f"address of node {stage.node}")
        topo.stages[k] = StageEndpoint(host, port, port + METRICS_OFFSET, stage.device)
    host, port = endpoint(coordinator, COORDINATOR_PORT, "coordinator")
    topo.coordinator = Endpoint(host, port, port + METRICS_OFFSET)
    host, port = endpoint(exporter, EXPORTER_PORT, "exporter")
    topo.exporter = Endpoint(host, port, port + METRICS_OFFSET)
    return topo


def print_plan(plan: Plan) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{plan.model}: {plan.num_layers} layers, objective {plan.objective}")
    for column in ("stage", "node", "address", "layers", "step ms", "tok/s alone", "memory MiB"):
        table.add_column(column, justify="right" if column not in ("node", "address") else "left")
    for k, s in enumerate(plan.stages):
        table.add_row(
            str(k),
            s.node,
            s.address or "-",
            f"{s.layer_start}:{s.layer_end} ({s.layers})",
            f"{s.step_ms:.2f}",
            f"{s.tok_s:.1f}",
            f"{s.memory_bytes / 2**20:.0f}",
        )
    console = Console(width=None if sys.stdout.isatty() else 120)
    console.print(table)
    rows = plan.batch // plan.micro_batches
    console.print(
        f"predicted {plan.tok_s:.1f} tok/s end to end ({plan.batch} sequence(s) in {plan.micro_batches} "
        f"micro-batch(es) of {rows}; a round of one token each takes {plan.round_ms:.2f} ms)"
    )
    if plan.skipped:
        console.print(f"skipped (no gain): {', '.join(plan.skipped)}")
    console.print(f"export it: pipeshard export --split {plan.ranges}")


def run_plan(args: argparse.Namespace) -> int:
    from pipeshard.planning.dp import plan_within
    from pipeshard.planning.nodes import load_nodes
    from pipeshard.sizes import parse_bytes

    try:
        model_dir = _model_dir(args.model)
        cost = model_cost(model_dir, args.weights, args.context)
        nodes = load_nodes(args.nodes)
        batch = args.batch or (8 if args.objective == "throughput" else 1)
        limit = (
            None if args.max_stage_memory is None else parse_bytes(args.max_stage_memory, "max_stage_memory")
        )
        plan = plan_within(nodes, cost, args.objective, batch, args.micro_batches, limit)
        if args.out:
            plan.save(args.out)
        if args.topology:
            shards = args.shards or str(
                paths.shards_dir() / paths.export_name(model_dir.name, len(plan.stages), args.weights)
            )
            topology = plan_topology(plan, shards, args.precision, args.coordinator, args.exporter)
            topology.save(args.topology)
    except PipeshardError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, InvalidArgument) else 1
    print_plan(plan)
    for path in (args.out, args.topology):
        if path:
            print(f"wrote {path}")
    return 0


def run_profile(args: argparse.Namespace) -> int:
    from pipeshard.model.fetch import resolve_model_source
    from pipeshard.planning.profile import ProfileOptions, profile_node

    try:
        model_dir = resolve_model_source(args.model)
        options = ProfileOptions(
            rows=_ints(args.rows, "rows"),
            contexts=_ints(args.contexts, "contexts"),
            prefill=_ints(args.prefill, "prefill"),
            threads=args.threads,
            precision=args.precision,
            weights=args.weights,
            device=args.device,
        )
        if args.threads is not None and args.threads < 1:
            raise InvalidArgument("threads", f"must be positive, got {args.threads}")
        node = profile_node(model_dir, options, name=args.name, address=args.address, peer=args.peer)
    except PipeshardError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, InvalidArgument) else 1
    text = yaml.safe_dump(node, sort_keys=False)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        print(f"wrote {args.out} ({node['measured']['seconds']} s)", file=sys.stderr)
    else:
        print(text, end="")
    return 0
