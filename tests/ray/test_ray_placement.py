"""Which node each stage of a lane is pinned to, without a cluster: the plan's nodes for the first
lane, the members with the most room for the next ones, never a drained node, none when full."""

from __future__ import annotations

import pytest

pytest.importorskip("ray", reason="Ray is not installed: pip install -e '.[ray]' (make setup does)")

from pipeshard.planning.plan import Plan, StagePlan
from pipeshard.services.raycluster import placement
from pipeshard.services.raycluster.members import Member
from pipeshard.services.raycluster.placement import FleetPlan, choose_nodes

STAGE = 100


def _fleet(nodes: tuple[str, str]) -> tuple[FleetPlan, list[Member]]:
    alive = [
        Member("head0000aa", "10.0.0.1", 3 * STAGE, "CPU", True),
        Member("node1111bb", "10.0.0.1", 3 * STAGE, "CPU", False),
        Member("node2222cc", "10.0.0.1", 2 * STAGE, "CPU", False),
    ]
    stages = tuple(StagePlan(n, "", 15 * k, 15 * k + 15, 0.0, 0.0, STAGE) for k, n in enumerate(nodes))
    return FleetPlan(Plan("m", 30, "latency", 1, 1, stages, 0.0, 0.0), tuple(alive)), alive


def test_lanes_go_on_the_planned_nodes_first_then_where_there_is_most_room(monkeypatch):
    fp, alive = _fleet(("node2222", "head0000"))  # not the members' own order
    held: dict[str, float] = {}
    monkeypatch.setattr(placement, "reserved_memory", lambda: dict(held))
    first = choose_nodes(fp, alive)
    assert first == ["node2222cc", "head0000aa"]
    for node in first:
        held[node] = held.get(node, 0) + STAGE
    # the next lane: the planned nodes hold a lane already, so the most room, one stage per node
    assert choose_nodes(fp, alive) == ["node1111bb", "head0000aa"]
    assert choose_nodes(fp, alive, avoid="head") == ["node1111bb", "node2222cc"]
    held.update({"head0000aa": 3 * STAGE, "node1111bb": 3 * STAGE})  # only node2 has room: for one stage
    assert choose_nodes(fp, alive) is None


def test_an_even_split_names_no_node_and_takes_the_roomiest(monkeypatch):
    fp, alive = _fleet(("", ""))
    monkeypatch.setattr(placement, "reserved_memory", lambda: {"head0000aa": 2 * STAGE})
    assert choose_nodes(fp, alive) == ["node1111bb", "node2222cc"]
