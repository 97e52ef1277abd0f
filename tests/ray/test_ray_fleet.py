"""A fleet on a real 3-node Ray cluster on this machine (`make test-ray`): each stage on the node the
plan named, its stages pulling their shards from the exporter actor, exact against an in-process
run; a node killed mid-stream with two lanes fails no request and its stage serves again on another
node; a node that joins adds a lane (``--replicas auto``); draining a node fails no request; a plan
whose split no export has gets its export made once by the exporter actor, and reused."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install -e '.[ray]' (make setup does)")

from pipeshard.clients.client import PipeshardClient  # noqa: E402
from pipeshard.planning.cli import model_cost  # noqa: E402
from pipeshard.services.raycluster.actors import NAMESPACE  # noqa: E402
from pipeshard.services.raycluster.fleet import (  # noqa: E402
    EXPORTER,
    RaySpec,
    ensure_export,
    head_strategy,
    remove,
    start_actor,
    up,
)
from pipeshard.services.raycluster.keeper import start_keeper  # noqa: E402
from pipeshard.services.raycluster.members import members  # noqa: E402
from pipeshard.services.raycluster.placement import plan_fleet  # noqa: E402
from tests.ray.reference import greedy_reference  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.ray]

MAX_TOKENS = 128
PROMPTS = (
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "List five fruits that are red.",
    "Explain what a hash table is in two sentences.",
)


@pytest.fixture(scope="module")
def stage_bytes(smollm2_dir):
    """The planner's memory of the larger half of the default model (a 2-stage split's stage)."""
    cost = model_cost(smollm2_dir, "int4", None)
    half = cost.num_layers // 2
    return max(cost.stage_bytes(0, half, 1), cost.stage_bytes(half, cost.num_layers, 1))


@pytest.fixture(scope="module")
def cluster(stage_bytes):
    """A head and two nodes, each with memory for two stages and not for the whole model."""
    from ray.cluster_utils import Cluster

    memory = int(stage_bytes * 2.5)
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "memory": memory})
    workers = [c.add_node(num_cpus=1, memory=memory) for _ in range(2)]
    ray.init(address=c.address, namespace=NAMESPACE)
    c.wait_for_nodes()
    yield c, workers, memory
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def reference(smollm2_export):
    return greedy_reference(smollm2_export(2, "int4"), PROMPTS, MAX_TOKENS)


def _serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def _generate_all(address: str, results: dict, started: threading.Event | None = None) -> None:
    def one(i: int) -> None:
        with PipeshardClient(address, timeout_s=900) as client:
            got = []
            for piece in client.stream(PROMPTS[i], max_tokens=MAX_TOKENS, ignore_eos=True):
                got.extend(piece.token_ids)
                if started is not None and len(got) >= 16:
                    started.set()
            results[i] = got

    def guarded(i: int) -> None:
        try:
            one(i)
        except Exception as exc:  # a failed request is what the test counts
            results[i] = exc

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def test_plan_over_the_members_splits_the_model_over_two_of_three_nodes(cluster, smollm2_dir):
    found = members()
    assert len(found) == 3
    cost = model_cost(smollm2_dir, "int4", None)
    whole = cost.stage_bytes(0, cost.num_layers, 1)
    # each node as Ray lists it, but with memory for 60% of the model: two of them must share it
    found = [replace(m, memory_bytes=int(whole * 0.6)) for m in found]
    fp = plan_fleet(found, smollm2_dir, "int4", profile=False)
    assert len(fp.plan.stages) == 2, fp.plan
    assert len({s.node for s in fp.plan.stages}) == 2 and len(fp.plan.skipped) == 1
    assert fp.strategy == "STRICT_SPREAD"


def test_ray_fleet_is_exact_survives_a_dead_node_and_grows_a_lane(
    cluster, smollm2_export, reference, tmp_path, stage_bytes
):
    c, workers, memory = cluster
    shards = smollm2_export(2, "int4")
    spec = RaySpec(
        shards_root=shards.parent,
        work_dir=tmp_path / "nodes",
        topology=tmp_path / "topology.yaml",
        export=shards,
        replicas=2,
        auto_replicas=True,
        lane_timeout_s=10.0,
    )
    found = members()
    fp = plan_fleet(found, Path(shards), "int4", stages=2, profile=False)
    # the plan names the last worker for stage 0 and the head for stage 1: not Ray's own order
    named = [found[2], found[0]]
    stages = tuple(replace(s, node=m.name) for s, m in zip(fp.plan.stages, named, strict=True))
    fp = replace(fp, plan=replace(fp.plan, stages=stages))
    fleet = up(spec, fp)
    try:
        assert [s.node_id for s in fleet.lanes[0]] == [m.node_id for m in named], "not where the plan said"
        keeper = start_keeper(fleet)
        nodes = [{s.node_id for s in lane} for lane in fleet.lanes]
        assert all(len(n) == 2 for n in nodes), "a lane's stages share a node"
        # each stage pulled only its own shard into its node's folder: a node holds the shards of
        # exactly the stages placed on it
        held: dict[str, set[str]] = {}
        for lane in fleet.lanes:
            for k, s in enumerate(lane):
                held.setdefault(s.node_id, set()).add(f"stage_{k}")
        for node, stages in held.items():
            pulled = next((tmp_path / "nodes").glob(f"node-{node[:12]}/shards/{shards.name}"))
            assert {p.name for p in pulled.glob("stage_*")} == stages

        results: dict[int, object] = {}
        _generate_all(fleet.coordinator.address, results)
        assert [results[i] for i in range(len(PROMPTS))] == reference

        # a worker node holding a stage dies mid-stream
        # one whose stages are all of one lane: the other lane carries its requests meanwhile
        lanes_on = {
            w.node_id: {r for r, lane in enumerate(fleet.lanes) for s in lane if s.node_id == w.node_id}
            for w in workers
        }
        victim = next((w for w in workers if len(lanes_on[w.node_id]) == 1), None)
        assert victim is not None, f"every worker holds stages of both lanes: {lanes_on}"
        moved = [s for lane in fleet.lanes for s in lane if s.node_id == victim.node_id]
        started, results = threading.Event(), {}
        streams = threading.Thread(target=_generate_all, args=(fleet.coordinator.address, results, started))
        streams.start()
        assert started.wait(600)
        c.remove_node(victim, allow_graceful=False)
        streams.join()
        assert [results[i] for i in range(len(PROMPTS))] == reference, "a request failed or changed"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            now = {s.name: s for lane in ray.get(keeper.lane_infos.remote()).values() for s in lane}
            if all(now[s.name].node_id != victim.node_id and _serving(now[s.name].address) for s in moved):
                break
            time.sleep(1)
        else:
            pytest.fail(f"{[s.name for s in moved]} did not serve again on another node")
        kinds = [ch.kind for ch in ray.get(keeper.history.remote())]
        assert kinds.count("stage_moved") >= len(moved)

        # a node joins: room for one more lane
        lanes_before = len(ray.get(keeper.lane_infos.remote()))
        c.add_node(num_cpus=1, memory=memory)
        c.add_node(num_cpus=1, memory=memory)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and len(ray.get(keeper.lane_infos.remote())) == lanes_before:
            time.sleep(1)
        assert len(ray.get(keeper.lane_infos.remote())) == lanes_before + 1
        assert "lane_added" in [ch.kind for ch in ray.get(keeper.history.remote())]
        results = {}
        _generate_all(fleet.coordinator.address, results)
        assert [results[i] for i in range(len(PROMPTS))] == reference

        # draining a node while requests run: its lanes go, none of the requests fails
        lanes = ray.get(keeper.lane_infos.remote())
        node = lanes[max(lanes)][0].node_id
        started, results = threading.Event(), {}
        streams = threading.Thread(target=_generate_all, args=(fleet.coordinator.address, results, started))
        streams.start()
        assert started.wait(600)
        drained = ray.get(keeper.drain.remote(node[:8]))
        streams.join()
        assert drained and [results[i] for i in range(len(PROMPTS))] == reference
        left = ray.get(keeper.lane_infos.remote())
        assert all(s.node_id != node for lane in left.values() for s in lane)
        assert "lane_drained" in [ch.kind for ch in ray.get(keeper.history.remote())]
    finally:
        remove(["keeper", *fleet.actor_names, *ray.util.list_named_actors()])


def test_a_plan_whose_split_no_export_has_is_exported_once_by_the_exporter_actor(
    cluster, smollm2_dir, tmp_path
):

    cost = model_cost(smollm2_dir, "int4", None)
    fp = plan_fleet(members(), smollm2_dir, "int4", stages=2, profile=False)
    first = fp.plan.stages[0].layer_end - 2  # two layers off the even split
    parts = (
        replace(fp.plan.stages[0], layer_end=first),
        replace(fp.plan.stages[1], layer_start=first),
    )
    fp = replace(fp, plan=replace(fp.plan, stages=parts))
    spec = RaySpec(
        shards_root=tmp_path / "shards",
        work_dir=tmp_path / "nodes",
        topology=tmp_path / "topology.yaml",
        model=str(smollm2_dir),
    )
    exporter, _ = start_actor(
        EXPORTER,
        ["exporter-service", "--shards-dir", str(spec.shards_root)],
        spec,
        head_strategy(),
        "exporter",
    )
    try:
        shards = ensure_export(spec, fp, exporter)
        assert shards.name == f"{smollm2_dir.name}-split0-{first}_{first}-{cost.num_layers}-int4"
        manifest = shards / "manifest.json"
        layers = [(s["layer_start"], s["layer_end"]) for s in json.loads(manifest.read_text())["stages"]]
        assert layers == [(0, first), (first, cost.num_layers)]
        made = manifest.stat().st_mtime_ns
        assert ensure_export(spec, fp, exporter) == shards  # a second up: the same export, not made again
        assert manifest.stat().st_mtime_ns == made
    finally:
        remove([EXPORTER])
