"""`make bench-ray`: a fleet on a 3-node Ray cluster on this machine against the launcher's fleet.

A head and two nodes (``ray.cluster_utils.Cluster``, each with memory for two stages of the
default model's INT4 2-stage export, cached). Measured:

- ``up_to_first_token_s``: from the start of ``up`` (exporter, two lanes of stage actors pulling
  their shards, coordinator; the cluster already running) to the first token of a request, and
  ``up_phases``: where that time went, in seconds since the start of ``up`` (each service's actor
  start and listening, and per stage its shard pull, compile and load, and warm-up, from its log);
- decode tok/s of the Ray fleet over the launcher's fleet (``make up``'s ``start_fleet``, the same
  two lanes of two stages, on ephemeral ports so no default port is taken), both up at once and
  measured in turn (interleaved rounds) at 1 and 8 users: generated tokens over wall time of
  greedy requests of BENCH_TOKENS tokens, eos ignored; the ratio of medians with a 95% interval;
- ``node_death_to_serving_s``: 8 users streaming on the Ray fleet, a worker node holding a stage
  removed at once (its raylet and workers killed); the time until every stage it held answers
  grpc.health SERVING again on another node; ``failed_requests`` and ``mismatches`` against the
  undisturbed run.

The machine's two cores are shared by every process of both fleets and by Ray's own: figures are
noisy, ratios are what the run measured side by side.
"""

from __future__ import annotations

import datetime
import json
import os
import tempfile
import threading
import time
from pathlib import Path

import grpc
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc
from ray.cluster_utils import Cluster

from bench.stats import command_with_knobs, median, ratio_ci, write_result
from pipeshard import paths
from pipeshard.clients.client import PipeshardClient
from pipeshard.exporter.export import export_model
from pipeshard.model.fetch import ensure_default_model
from pipeshard.offline import set_offline_defaults
from pipeshard.planning.cli import model_cost
from pipeshard.services.launcher import start_fleet
from pipeshard.services.raycluster.actors import NAMESPACE, ServiceInfo, node_run_dir
from pipeshard.services.raycluster.fleet import RayFleet, RaySpec, remove, up
from pipeshard.services.raycluster.keeper import start_keeper
from pipeshard.services.raycluster.members import members
from pipeshard.services.raycluster.placement import plan_fleet

ROUNDS = int(os.environ.get("BENCH_RUNS", "3"))
TOKENS = int(os.environ.get("BENCH_TOKENS", "64"))
USERS = (1, 8)
PROMPT = "Write a short story about a {}."
ANIMALS = ("cat", "dog", "fox", "owl", "bee", "cow", "elk", "yak")


def _export() -> Path:
    model = ensure_default_model(paths.models_dir())
    out = paths.shards_dir() / paths.export_name(model.name, 2, "int4")
    if not (out / "manifest.json").exists():
        export_model(model, out, stages=2, weights="int4")
    return out


def _run(address: str, users: int, results: dict | None = None, started: threading.Event | None = None):
    """``users`` greedy requests at once; returns (tokens, seconds, failed)."""
    out: dict[int, object] = {} if results is None else results

    def one(i: int) -> None:
        try:
            with PipeshardClient(address, timeout_s=900) as client:
                got = []
                for chunk in client.stream(PROMPT.format(ANIMALS[i]), max_tokens=TOKENS, ignore_eos=True):
                    got.extend(chunk.token_ids)
                    if started is not None and len(got) >= 8:
                        started.set()
                out[i] = got
        except Exception as exc:  # counted as a failed request
            out[i] = exc

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(users)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    tokens = sum(len(v) for v in out.values() if isinstance(v, list))
    return tokens, seconds, sum(isinstance(v, Exception) for v in out.values()), out


def _first_token_s(address: str, since: float) -> float:
    with PipeshardClient(address, timeout_s=900) as client:
        for _ in client.stream(PROMPT.format("cat"), max_tokens=4, ignore_eos=True):
            return time.perf_counter() - since
    raise RuntimeError("no token")


def _events(log: Path) -> dict[str, dict]:
    """A stage log's JSON events by name (the last of each), with their time as ``at``."""
    found = {}
    for line in log.read_text().splitlines():
        if line.startswith("{"):
            event = json.loads(line)
            event["at"] = datetime.datetime.fromisoformat(event["timestamp"]).timestamp()
            found[event["event"]] = event
    return found


def _phases(fleet: RayFleet, t0: float) -> dict:
    """Seconds since ``t0`` (wall clock) of each phase of ``up``, per service."""

    def since(at: float) -> float:
        return round(at - t0, 1)

    def service(info: ServiceInfo) -> dict:
        return {"actor_start": since(info.started_at), "listening": since(info.listening_at)}

    phases = {"exporter": service(fleet.exporter), "coordinator": service(fleet.coordinator)}
    for lane in fleet.lanes:
        for s in lane:
            events = _events(node_run_dir(str(fleet.spec.work_dir), s.node_id) / f"{s.name}.log")
            pulled = events.get("shard_pulled")
            warm = events["warmup done"]
            loaded_from = pulled["at"] if pulled else s.started_at
            phases[s.name] = {
                **service(s),
                "shard_pull_s": pulled["seconds"] if pulled else 0.0,
                "compile_and_load_s": round(warm["at"] - warm["seconds"] - loaded_from, 1),
                "warmup_s": warm["seconds"],
            }
    return phases


def _serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def main() -> None:
    set_offline_defaults()
    shards = _export()
    cost = model_cost(ensure_default_model(paths.models_dir()), "int4", None)
    half = cost.num_layers // 2
    memory = int(2.5 * max(cost.stage_bytes(0, half, 1), cost.stage_bytes(half, cost.num_layers, 1)))
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "memory": memory})
    workers = [cluster.add_node(num_cpus=1, memory=memory) for _ in range(2)]
    ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
    cluster.wait_for_nodes()
    work = Path(tempfile.mkdtemp(prefix="bench-ray-"))
    spec = RaySpec(shards.parent, work / "nodes", work / "topology.yaml", export=shards, replicas=2)
    plain = None
    fleet = None
    try:
        t_up, t_wall = time.perf_counter(), time.time()
        fleet = up(spec, plan_fleet(members(), Path(shards), "int4", stages=2, profile=False))
        first_token = _first_token_s(fleet.coordinator.address, t_up)
        phases = {**_phases(fleet, t_wall), "first_token": round(first_token, 1)}
        keeper = start_keeper(fleet)
        plain = start_fleet(shards, 2, work / "plain", replicas=2)
        rates: dict[str, dict[int, list[float]]] = {"ray": {}, "plain": {}}
        for users in USERS:
            _run(fleet.coordinator.address, users)  # warm-up of both at this load
            _run(plain.coordinator, users)
            for r in range(ROUNDS):
                order = [("ray", fleet.coordinator.address), ("plain", plain.coordinator)]
                for name, address in order if r % 2 == 0 else order[::-1]:
                    tokens, seconds, failed, _ = _run(address, users)
                    assert failed == 0, f"{name} fleet: {failed} failed requests"
                    rates[name].setdefault(users, []).append(tokens / seconds)
        plain.stop()
        plain = None
        # a node's death while 8 users stream
        _, _, _, undisturbed = _run(fleet.coordinator.address, 8)
        # a worker whose stages are all of one lane: the other lane carries its requests meanwhile
        lanes_on = {
            w.node_id: {r for r, ln in enumerate(fleet.lanes) for s in ln if s.node_id == w.node_id}
            for w in workers
        }
        victim = next(w for w in workers if len(lanes_on[w.node_id]) == 1)
        lost = [s.name for lane in fleet.lanes for s in lane if s.node_id == victim.node_id]
        results, started = {}, threading.Event()
        streams = threading.Thread(target=_run, args=(fleet.coordinator.address, 8, results, started))
        streams.start()
        started.wait(600)
        t_kill = time.perf_counter()
        cluster.remove_node(victim, allow_graceful=False)
        back = None
        while time.perf_counter() - t_kill < 600:
            now = {s.name: s for lane in ray.get(keeper.lane_infos.remote()).values() for s in lane}
            if all(now[n].node_id != victim.node_id and _serving(now[n].address) for n in lost):
                back = time.perf_counter() - t_kill
                break
            time.sleep(0.5)
        streams.join()
        failed = sum(isinstance(v, Exception) for v in results.values())
        done = [i for i, v in results.items() if not isinstance(v, Exception)]
        mismatches = sum(results[i] != undisturbed[i] for i in done)
    finally:
        if plain is not None:
            plain.stop()
        if fleet is not None:
            remove(["keeper", *fleet.actor_names, *ray.util.list_named_actors()])
        ray.shutdown()
        cluster.shutdown()
    ratios = {}
    for users in USERS:
        ratio, ci = ratio_ci(rates["ray"][users], rates["plain"][users])
        ratios[f"ray_over_plain_tok_s_{users}u"] = round(ratio, 3)
        ratios[f"ray_over_plain_tok_s_{users}u_ci95"] = [round(x, 3) for x in ci]
    write_result(
        "ray",
        {
            "nodes": 3,
            "lanes": 2,
            "stages": 2,
            "tokens": TOKENS,
            "rounds": ROUNDS,
            "up_to_first_token_s": round(first_token, 1),
            "up_phases": phases,
            "node_death_to_serving_s": None if back is None else round(back, 1),
            "stages_on_dead_node": lost,
            "failed_requests": failed,
            "mismatches": mismatches,
            **ratios,
            "tok_s": {
                name: {str(u): round(median(v), 1) for u, v in by.items()} for name, by in rates.items()
            },
        },
        command_with_knobs("bench-ray", ("BENCH_RUNS", "BENCH_TOKENS")),
    )


if __name__ == "__main__":
    main()
