"""Where a fleet's stages go: the DP planner over the cluster's members, one placement group per lane.

The planner picks the layer ranges and the node of each stage (or an even split of ``stages``);
each lane reserves a bundle of the planner's memory for each of its stages, every bundle pinned to
the node chosen for it by Ray's node-id label (nodes of one machine share an IP, not a node id): the
planner's node where it has room, else the member with the most room, one stage per node when the
cluster has a node per stage. A lane whose node dies is placed again by the keeper.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import ray
from ray.util.placement_group import (
    NODE_ID_LABEL_KEY,
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)

from pipeshard.errors import InvalidArgument
from pipeshard.exporter.export import resolve_split
from pipeshard.paths import export_name
from pipeshard.planning.cli import model_cost
from pipeshard.planning.cost import ModelCost
from pipeshard.planning.dp import plan_layers
from pipeshard.planning.plan import Plan, StagePlan
from pipeshard.services.raycluster.members import Member, planner_nodes
from pipeshard.sizes import gib


@dataclass(frozen=True)
class FleetPlan:
    """The plan and what it asks of the cluster."""

    plan: Plan
    members: tuple[Member, ...]

    @property
    def stage_memory(self) -> list[int]:
        return [s.memory_bytes for s in self.plan.stages]

    @property
    def strategy(self) -> str:
        return "STRICT_SPREAD" if len(self.members) >= len(self.plan.stages) else "SPREAD"

    def export_dir(self, shards_root: Path, model: str, weights: str) -> Path:
        """The export of this plan's split: the even export's folder when the split is even."""
        n = len(self.plan.stages)
        if self.plan.split == resolve_split(self.plan.num_layers, n, None):
            return shards_root / export_name(model, n, weights)
        ranges = self.plan.ranges.replace(":", "-").replace(",", "_")
        return shards_root / f"{model}-split{ranges}-{weights}"


def _refusal(cost: ModelCost, found: list[Member]) -> InvalidArgument:
    need = cost.stage_bytes(0, cost.num_layers, 1)
    largest = max((m.memory_bytes for m in found), default=0)
    return InvalidArgument(
        "nodes",
        f"cannot place {cost.name} on this Ray cluster: it needs {gib(need)} in all (weights and the KV "
        f"cache of {cost.context} tokens), no split over the {len(found)} alive node(s) fits, and the "
        f"largest node offers {gib(largest)} (together {gib(sum(m.memory_bytes for m in found))}); "
        "add nodes, or lower --context",
    )


def plan_fleet(
    found: list[Member],
    model_dir: Path,
    weights: str,
    *,
    stages: int | None = None,
    context: int | None = None,
    profile: bool = True,
) -> FleetPlan:
    """Layer ranges over ``found`` (the DP planner), or ``stages`` even ones; refused, naming the
    memory needed and the largest node's, when no placement fits."""
    if not found:
        raise InvalidArgument("ray", "the cluster has no alive node")
    cost = model_cost(model_dir, weights, context)
    if stages is None:
        nodes = planner_nodes(found, str(model_dir), weights, profile)
        try:
            plan = plan_layers(nodes, cost)
        except InvalidArgument as exc:
            if exc.field != "nodes":
                raise
            raise _refusal(cost, found) from None
        return FleetPlan(plan, tuple(found))
    split = resolve_split(cost.num_layers, stages, None)
    starts = [sum(split[:k]) for k in range(stages)]
    parts = tuple(
        StagePlan("", "", a, a + n, 0.0, 0.0, cost.stage_bytes(a, a + n, 1))
        for a, n in zip(starts, split, strict=True)
    )
    largest = max(m.memory_bytes for m in found)
    if max(p.memory_bytes for p in parts) > largest or sum(p.memory_bytes for p in parts) > sum(
        m.memory_bytes for m in found
    ):
        raise _refusal(cost, found)
    plan = Plan(cost.name, cost.num_layers, "latency", 1, 1, parts, 0.0, 0.0)
    return FleetPlan(plan, tuple(found))


def reserved_memory() -> dict[str, float]:
    """Memory the cluster's live placement groups hold, by node id."""
    held: dict[str, float] = {}
    for pg in placement_group_table().values():
        if pg.get("state") == "REMOVED":
            continue
        for index, node in pg.get("bundles_to_node_id", {}).items():
            held[node] = held.get(node, 0.0) + pg["bundles"][index].get("memory", 0.0)
    return held


def choose_nodes(fp: FleetPlan, alive: list[Member], avoid: str | None = None) -> list[str] | None:
    """A node id per stage of one more lane: the planner's node for the stage where it has room and
    holds no other lane, else the member with the most room; distinct nodes when there are enough;
    none on a node whose id starts with ``avoid``. None when some stage finds no room."""
    held = reserved_memory()
    free = {m.node_id: m.memory_bytes - held.get(m.node_id, 0.0) for m in alive}
    if avoid is not None:
        free = {n: room for n, room in free.items() if not n.startswith(avoid)}
    spread = len(free) >= len(fp.plan.stages)
    chosen: list[str] = []
    for stage in fp.plan.stages:
        fits = [n for n, room in free.items() if room >= stage.memory_bytes and not (spread and n in chosen)]
        # the plan's node while no lane holds it yet: further lanes spread over the others
        planned = [n for n in fits if stage.node and n.startswith(stage.node) and not held.get(n)]
        if not fits:
            return None
        node = (planned or sorted(fits, key=lambda n: -free[n]))[0]
        free[node] -= stage.memory_bytes
        chosen.append(node)
    return chosen


def reserve_lane(fp: FleetPlan, name: str, nodes: list[str], timeout_s: float) -> PlacementGroup | None:
    """A placement group holding one lane's stages, bundle k on node ``nodes[k]``, or None when it
    is not placed within ``timeout_s`` (then nothing stays reserved)."""
    bundles = [{"memory": float(max(1, m))} for m in fp.stage_memory]
    pins = [{NODE_ID_LABEL_KEY: node} for node in nodes]
    strategy = "STRICT_SPREAD" if len(set(nodes)) == len(nodes) else "PACK"
    pg = placement_group(
        bundles, strategy=strategy, name=name, lifetime="detached", bundle_label_selector=pins
    )
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        return None
    return pg
