"""The planner's node descriptions from the Ray cluster's members.

Memory and device come from each alive node's Ray resources (``memory``, ``GPU``); speed from
``pipeshard profile`` run on that node as a Ray task, cached on the node's disk by host name,
model, weights and device (nodes of one machine share a profile: they share its cores).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import ray
import yaml
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pipeshard.planning.cost import Curve
from pipeshard.planning.nodes import Node, parse_node
from pipeshard.services.launcher import fleet_env

# Quick probe points: the planner reads decode at the shortest context by rows per step.
_PROFILE_ARGS = ("--rows", "1", "--contexts", "128", "--prefill", "128")
UNIFORM_SPEED = Curve.constant(1.0)  # every node alike: the plan is decided by memory alone


@dataclass(frozen=True)
class Member:
    """One alive node of the cluster as the fleet sees it."""

    node_id: str
    ip: str
    memory_bytes: int
    device: str  # the OpenVINO device its stages compile for: GPU when Ray lists one, else CPU
    is_head: bool

    @property
    def name(self) -> str:
        """Short and unique: what `pipeshard fleet drain NODE` and the plan print."""
        return self.node_id[:8]


def members() -> list[Member]:
    """The alive nodes, the driver's first, then by address (the planner's pipeline order)."""
    here = ray.get_runtime_context().get_node_id()
    found = []
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        res = node.get("Resources", {})
        found.append(
            Member(
                node_id=node["NodeID"],
                ip=node["NodeManagerAddress"],
                memory_bytes=int(res.get("memory", 0)),
                device="GPU" if res.get("GPU", 0) >= 1 else "CPU",
                is_head=node["NodeID"] == here,
            )
        )
    return sorted(found, key=lambda m: (not m.is_head, m.ip, m.node_id))


def profile_cache_dir() -> Path:
    return Path(
        os.environ.get("PIPESHARD_RAY_PROFILE_CACHE", Path.home() / ".cache" / "pipeshard" / "profiles")
    )


@ray.remote(num_cpus=0)
def profile_here(model: str, weights: str, device: str) -> str:
    """``pipeshard profile`` on this node, or its cached result: the node description as YAML."""
    cache = profile_cache_dir() / f"{socket.gethostname()}-{Path(model).name}-{weights}-{device}.yaml"
    if not cache.is_file():
        cache.parent.mkdir(parents=True, exist_ok=True)
        argv = ["profile", "--model", model, "--weights", weights, "--device", device, "--out", str(cache)]
        subprocess.run(
            [sys.executable, "-m", "pipeshard.cli", *argv, *_PROFILE_ARGS], check=True, env=fleet_env()
        )
    return cache.read_text()


def planner_nodes(found: list[Member], model: str, weights: str, profile: bool = True) -> list[Node]:
    """Each member as a planner node: its profiled speed (one node after another, so nodes of one
    machine profile it once) with Ray's memory and device for it; ``profile`` off: equal speeds."""
    nodes = []
    for m in found:
        base = Node(
            name=m.name, address=m.ip, per_layer_ms=UNIFORM_SPEED, memory_bytes=max(1, m.memory_bytes)
        )
        if profile:
            strategy = NodeAffinitySchedulingStrategy(m.node_id, soft=False)
            text = ray.get(
                profile_here.options(scheduling_strategy=strategy).remote(model, weights, m.device)
            )
            measured = parse_node(yaml.safe_load(text), f"profile of {m.name}")
            base = replace(
                measured, name=m.name, address=m.ip, memory_bytes=base.memory_bytes, device=m.device
            )
        nodes.append(replace(base, device=m.device))
    return nodes
