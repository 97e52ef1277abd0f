"""bench-planner: the planner's speed, and its predictions against a real unequal fleet.

1. Planner time for 8 nodes x 80 layers (a Llama-70B-sized model at int4, random heterogeneous
   nodes), latency and throughput (8 sequences, micro-batch count chosen) objectives.
2. A 3-stage loopback fleet with deliberately unequal stages: stage 1 runs with 1 inference
   thread (stages 0 and 2 with the plugin's default, 2 here) and/or sends every frame
   BENCH_DELAY_MS late (its --hop-delay-ms, an emulated slow link); BENCH_SLOW picks
   (default both). Each node may hold at most BENCH_NODE_MB of weights and KV cache (4096 tokens),
   so no node can take the whole model. This machine is profiled at the thread counts used
   (`pipeshard profile`, alternating, medians), the link measured to a running stage (plus the
   emulated delay), and the latency plan exported; then the planned split (on the nodes it uses)
   and the even split 10,10,10 decode the same prompt in interleaved rounds.

The prediction is checked against profiles taken in the same rounds as the fleets run: each
fleet's measured run comes right after a profile of this machine (on this shared machine the load
moves too much between an up-front profile and later runs), and that fleet's prediction for the
round is the cost model at that profile. Prediction and measurement are compared as a ratio of
medians over the rounds with a 95% paired-bootstrap interval (the plan made up front is reported
beside it).

Keys: planner_ms (latency objective; planner_ms_throughput beside it, and both in CPU time),
plan_error (|predicted - measured| / measured median tok/s of the planned fleet, with its
interval; plan_error_even for the even fleet), planned_over_even (ratio of median tok/s,
baseline: the even split on the same unequal nodes).
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

from bench.stats import interleaved, median, ratio_ci, summary, write_result
from pipeshard import paths
from pipeshard.offline import set_offline_defaults
from pipeshard.planning.cost import Curve, Link, ModelCost
from pipeshard.planning.dp import plan_layers, stage_ms
from pipeshard.planning.nodes import Node, parse_node

RUNS = int(os.environ.get("BENCH_RUNS", "10"))
TOKENS = int(os.environ.get("BENCH_TOKENS", "64"))
NODE_MB = float(os.environ.get("BENCH_NODE_MB", "150"))
PROFILE_REPEATS = int(os.environ.get("BENCH_PROFILE_REPEATS", "3"))
PROMPT = "Explain how a refrigerator keeps food cold."
THREADS = (None, 1, None)  # per stage: None = the plugin's default
# What makes stage 1 slow: "threads" (1 inference thread), "link" (every frame it sends waits
# BENCH_DELAY_MS more: the stage's --hop-delay-ms), or both (comma-separated).
SLOW = set(os.environ.get("BENCH_SLOW", "threads,link").split(","))
DELAY_MS = float(os.environ.get("BENCH_DELAY_MS", "10"))
THREADS_USED = THREADS if "threads" in SLOW else (None, None, None)
DELAYS = (0.0, DELAY_MS if "link" in SLOW else 0.0, 0.0)


def time_planner(repeats: int = 50) -> dict[str, float]:
    """Median ms of plan_layers for 8 random nodes and an 80-layer model, per objective (wall
    clock, and this process's CPU time: numpy may use a second thread, so CPU can exceed wall)."""
    model = ModelCost.estimate(
        num_layers=80,
        hidden_size=8192,
        intermediate_size=28672,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
        vocab_size=32000,
        tie_word_embeddings=False,
        weights="int4",
        context=4096,
        name="llama-70b-like",
    )
    rng = random.Random(21)
    nodes = [
        Node(
            name=f"n{i}",
            address="",
            per_layer_ms=Curve(((1, rng.uniform(5, 20)), (8, rng.uniform(20, 60)))),
            memory_bytes=int(rng.uniform(8, 24) * 2**30),
            link_to_next=Link(mbit=rng.choice([100, 1000]), rtt_ms=rng.uniform(1, 50)),
            overhead_ms=Curve.constant(0.5),
        )
        for i in range(8)
    ]
    out = {}
    for key, objective, batch in (("latency", "latency", 1), ("throughput", "throughput", 8)):
        for _ in range(5):
            plan_layers(nodes, model, objective, batch)
        wall, cpu = [], []
        for _ in range(repeats):
            t0, c0 = time.perf_counter(), time.process_time()
            plan_layers(nodes, model, objective, batch)
            wall.append((time.perf_counter() - t0) * 1000)
            cpu.append((time.process_time() - c0) * 1000)
        out[key] = statistics.median(wall)
        out[f"{key}_cpu"] = statistics.median(cpu)  # this process's CPU time: less hit by load
    return out


def start_unequal_fleet(shards: Path, run_dir: Path, threads: list[int | None], delays: list[float]):
    """Stages with per-stage thread counts and send delays (start_fleet gives every stage the same
    arguments)."""
    from pipeshard.services.launcher import Fleet, coordinator_args, fleet_env, spawn, stage_args

    run_dir.mkdir(parents=True, exist_ok=True)
    env = fleet_env()
    fleet = Fleet(run_dir)
    next_hop = None
    try:
        for k in reversed(range(len(threads))):
            extra = ["--num-threads", str(threads[k])] if threads[k] else []
            if delays[k]:
                extra += ["--hop-delay-ms", str(delays[k])]
            args = stage_args(k, shards, 0, "default", "json", next_hop, extra)
            proc = spawn(f"stage{k}", args, run_dir, env, 240)
            fleet.processes.insert(0, proc)
            next_hop = proc.address
        coordinator = spawn(
            "coordinator", coordinator_args(fleet.stages, shards, 0, "json"), run_dir, env, 240
        )
        fleet.processes.append(coordinator)
    except BaseException:
        fleet.stop()
        raise
    return fleet


PROFILE_KEYS = ("per_layer_ms", "overhead_ms", "embed_ms", "head_ms")


def profile_once(model_dir: Path, probes: Path) -> dict[int, dict]:
    """One profile at each thread count of THREADS_USED (0 = the default)."""
    from pipeshard.planning.profile import ProfileOptions, profile_node

    out = {}
    for threads in sorted({t or 0 for t in THREADS_USED}):
        options = ProfileOptions(rows=(1,), contexts=(128,), prefill=(), steps=32, threads=threads or None)
        out[threads] = profile_node(model_dir, options, name=f"t{threads}", probes_dir=probes)
    return out


def median_profile(runs: list[dict[int, dict]]) -> dict[int, dict]:
    """Per thread count, the median of each measured figure over the runs."""
    return {t: {k: {1: median([run[t][k][1] for run in runs])} for k in PROFILE_KEYS} for t in runs[0]}


def fleet_nodes(profiles: dict[int, dict], link: dict) -> list[Node]:
    nodes = []
    for k, threads in enumerate(THREADS_USED):
        raw = {**profiles[threads or 0], "name": f"stage{k}-{threads or 'default'}t-{DELAYS[k]:g}ms"}
        # the stage's send delay is half a round trip more on its link
        slow_link = {**link, "rtt_ms": link["rtt_ms"] + 2 * DELAYS[k]}
        raw |= {"memory_bytes": int(NODE_MB * 2**20), "link_to_next": slow_link}
        nodes.append(parse_node(raw, f"nodes[{k}]"))
    return nodes


def predicted_tok_s(nodes: list[Node], cost: ModelCost, split: list[int]) -> float:
    a, total = 0, 0.0
    for node, count in zip(nodes, split, strict=True):
        total += stage_ms(node, cost, a, a + count, 1)
        a += count
    return 1000.0 / total


def main() -> int:
    set_offline_defaults()
    from pipeshard.clients.client import PipeshardClient
    from pipeshard.exporter.export import export_model
    from pipeshard.planning.cli import model_cost
    from pipeshard.planning.profile import measure_link

    planner_ms = time_planner()
    print(f"planner: {planner_ms}", file=sys.stderr)

    model_dir = paths.default_model_dir()
    even_dir = paths.shards_dir() / paths.export_name(paths.DEFAULT_MODEL, 3, "int4")
    if not (even_dir / "manifest.json").exists():
        export_model(model_dir, even_dir, stages=3, weights="int4")
    run_dir = Path("run/bench-planner")
    fleets = {"even": start_unequal_fleet(even_dir, run_dir / "even", list(THREADS_USED), list(DELAYS))}
    try:
        link = measure_link(fleets["even"].stages[0])
        probes = run_dir / "probes"
        profiles = median_profile([profile_once(model_dir, probes) for _ in range(PROFILE_REPEATS)])
        nodes = fleet_nodes(profiles, link)
        cost = model_cost(model_dir, "int4", None)
        plan = plan_layers(nodes, cost, "latency")
        print(f"plan {plan.ranges} predicted {plan.tok_s:.1f} tok/s; skipped {plan.skipped}", file=sys.stderr)
        # the planner may skip a node: the planned fleet runs the nodes it uses, with their threads
        used = [next(k for k, n in enumerate(nodes) if n.name == s.node) for s in plan.stages]
        name = paths.export_name(paths.DEFAULT_MODEL, len(plan.stages), "int4")
        planned_dir = paths.shards_dir() / f"{name}-planned"
        manifest = planned_dir / "manifest.json"
        if not manifest.exists() or json.loads(manifest.read_text())["split"] != plan.split:
            export_model(model_dir, planned_dir, split=plan.ranges, weights="int4", force=True)
        fleets["planned"] = start_unequal_fleet(
            planned_dir, run_dir / "planned", [THREADS_USED[k] for k in used], [DELAYS[k] for k in used]
        )
        clients = {name: PipeshardClient(f.coordinator, timeout_s=600) for name, f in fleets.items()}
        positions = {"even": [0, 1, 2], "planned": used}  # the nodes each fleet runs on
        splits = {"even": [10, 10, 10], "planned": plan.split}
        round_profiles: list[dict[int, dict]] = []
        predictions: dict[str, list[float]] = {name: [] for name in clients}

        def runner(name: str):
            """Profile, predict this fleet from that profile, then measure it: one round's pair."""

            def run() -> float:
                round_profiles.append(profile_once(model_dir, probes))
                now = fleet_nodes(round_profiles[-1], link)
                predictions[name].append(
                    predicted_tok_s([now[k] for k in positions[name]], cost, splits[name])
                )
                return clients[name].generate(PROMPT, max_tokens=TOKENS, ignore_eos=True).tok_s

            return run

        samples = interleaved({n: runner(n) for n in clients}, RUNS, warmup=2)
    finally:
        for fleet in fleets.values():
            fleet.stop()
    predicted = {name: values[-RUNS:] for name, values in predictions.items()}
    measured = {k: median(v) for k, v in samples.items()}
    # predicted over measured: a ratio of medians over the rounds, each prediction from the profile
    # taken right before its measured run
    fit = {name: ratio_ci(predicted[name], samples[name]) for name in samples}

    def error(name: str) -> tuple[float, list[float]]:
        """|predicted / measured - 1| of the medians, with the interval it takes over the ratio's."""
        ratio, (low, high) = fit[name]
        span = [abs(low - 1), abs(high - 1)]
        return abs(ratio - 1), [0.0 if low <= 1 <= high else min(span), max(span)]

    at_planning = {"even": predicted_tok_s(nodes, cost, [10, 10, 10]), "planned": plan.tok_s}
    ratio, ci = ratio_ci(samples["planned"], samples["even"])
    result = {
        "runs": RUNS,
        "tokens": TOKENS,
        "tok_s": measured,
        "tok_s_range": {k: summary(v) for k, v in samples.items()},
        "predicted_tok_s": {k: median(v) for k, v in predicted.items()},  # from each round's profile
        "predicted_tok_s_range": {k: summary(v) for k, v in predicted.items()},
        "predicted_over_measured": {k: {"ratio": r, "ci": c} for k, (r, c) in fit.items()},
        "plan_error_per_round_median": median(
            [abs(p - m) / m for p, m in zip(predicted["planned"], samples["planned"], strict=True)]
        ),
        "predicted_tok_s_at_planning": at_planning,  # from the profiles the plan was made with
        "planner_ms": planner_ms["latency"],
        "planner_ms_throughput": planner_ms["throughput"],
        "planner_cpu_ms": {"latency": planner_ms["latency_cpu"], "throughput": planner_ms["throughput_cpu"]},
        "plan_error": error("planned")[0],
        "plan_error_ci": error("planned")[1],
        "plan_error_even": error("even")[0],
        "plan_error_even_ci": error("even")[1],
        "planned_over_even": ratio,
        "planned_over_even_ci": ci,
        "planned_over_even_config": "planned split over the even split 10,10,10 on the same unequal "
        "nodes (the planned fleet runs the nodes its plan uses)",
        "slow_stage": {"how": sorted(SLOW), "threads": list(THREADS_USED), "send_delay_ms": list(DELAYS)},
        "planned_split": plan.ranges,
        "node_mb": NODE_MB,
        "link": link,
        "planned_nodes": [s.node for s in plan.stages],
        "profiles_at_planning": {f"threads_{t or 'default'}": p for t, p in profiles.items()},
        "profiles_in_rounds": {
            f"threads_{t or 'default'}": p for t, p in median_profile(round_profiles[-2 * RUNS :]).items()
        },
    }
    knobs = (
        "BENCH_RUNS",
        "BENCH_TOKENS",
        "BENCH_NODE_MB",
        "BENCH_PROFILE_REPEATS",
        "BENCH_SLOW",
        "BENCH_DELAY_MS",
    )
    command = " ".join(f"{k}={os.environ[k]}" for k in knobs if k in os.environ)
    write_result("planner", result, f"{command} make bench-planner".strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
