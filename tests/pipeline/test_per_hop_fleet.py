"""Per-hop routing through real processes: 3 stages x 2 replicas, every replica forwarding to both
replicas of the next stage. A killed replica moves only its own stage's part of the sessions
routed through it (the other stages keep theirs: no restore, no reopen there), and the fleet
survives one dead replica per stage; a route naming a replica a stage does not know is refused
naming it, and a stranger cannot re-point another owner's session."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import grpc
import pytest

from pipeshard.clients.client import PipeshardClient
from pipeshard.ownership import new_secret, owner_metadata
from pipeshard.services.launcher import Fleet, stage_name
from pipeshard.v1 import stage_pb2, stage_pb2_grpc
from tests.pipeline.concurrent_streams import concurrently, stream_tokens

pytestmark = pytest.mark.slow

STAGES = 3
USERS = 8
TOKENS = 40
KILL_AFTER = 8  # tokens every stream has out before the kill: its standby copy holds its prompt
# About 120 tokens each (with the chat template): a few whole blocks of 32 for the copies to hold.
_SCENE = "The village sits where the river bends past the old mill, the orchard and the stone bridge. " * 5
PROMPTS = [f"{_SCENE}Write a short story about a {animal}." for animal in ("cat", "dog", "fox", "owl")] * 2


@pytest.fixture(scope="module")
def routed(smollm2_export, fleet_factory):
    """Three stages x two replicas at the default precision, on ephemeral ports."""
    shards = smollm2_export(STAGES, "int4")
    return shards, fleet_factory(shards, STAGES, replicas=2)


def _events(log: Path, event: str) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines() if f'"{event}"' in line]


def _stage_log(fleet: Fleet, k: int, r: int) -> Path:
    return fleet.process(stage_name(k, r)).log


def _tokens(client: PipeshardClient, prompt: str) -> list[int]:
    return stream_tokens(client, prompt, TOKENS)


def _concurrently(address: str, on_out=None) -> tuple[list[list[int]], list[BaseException]]:
    return concurrently(address, PROMPTS, TOKENS, on_out, KILL_AFTER)


def _kill_mid_stream(fleet: Fleet, k: int, r: int) -> tuple[list[list[int]], list[BaseException]]:
    """kill -9 replica ``r`` of stage ``k`` once every one of the 8 streams has tokens out."""
    started = threading.Barrier(USERS + 1)
    victim = fleet.process(stage_name(k, r))
    killer = threading.Thread(target=lambda: (started.wait(timeout=300), victim.popen.kill()))
    killer.start()
    results = _concurrently(fleet.coordinator, on_out=lambda: started.wait(timeout=300))
    killer.join()
    assert victim.popen.wait(timeout=10) is not None
    return results


def _moved_by_failover(log: Path) -> list[dict]:
    """A stage's aborts that a failover made (not the prefix cache's lane moves)."""
    return [e for e in _events(log, "session_aborted") if "another replica" in e.get("reason", "")]


def test_a_dead_replica_moves_only_its_stage_and_the_fleet_survives_one_per_stage(routed):
    _, fleet = routed
    coordinator_log = fleet.process("coordinator").log
    undisturbed, errors = _concurrently(fleet.coordinator)
    assert not errors
    assert all(len(t) == TOKENS for t in undisturbed)

    # Stage 1's replica of lane 1 dies mid-stream: its sessions' stage 1 part moves to replica 0.
    disturbed, errors = _kill_mid_stream(fleet, 1, 1)
    assert not errors, errors
    assert disturbed == undisturbed
    moves = _events(coordinator_log, "session_failed_over")
    assert moves and all(m.get("moved_stages") == [1] for m in moves), moves
    assert all(m["from_route"][1] == 1 and m["to_route"][1] == 0 for m in moves), moves
    assert any(m["kv_from"] == "standby" and m["restored_tokens"] >= 96 for m in moves), moves
    moved = {m["session_id"] for m in moves}
    # Stage 0 and stage 2 kept those sessions: no restore and no failover's abort there, only the
    # cut back to the copy's positions (and, on stage 0, the new next hop).
    for k in (0, 2):
        for r in (0, 1):
            assert not _events(_stage_log(fleet, k, r), "kv_restored"), (k, r)
            assert not _moved_by_failover(_stage_log(fleet, k, r)), (k, r)
    routed_at = {
        k: {e["session_id"] for r in (0, 1) for e in _events(_stage_log(fleet, k, r), "session_routed")}
        for k in (0, 2)
    }
    assert moved <= routed_at[0] and moved <= routed_at[2]
    restored = {e["session_id"] for e in _events(_stage_log(fleet, 1, 0), "kv_restored")}
    assert moved & restored

    # Then stage 2's replica of the other lane: one replica dead per stage, no whole lane left.
    before = len(moves)
    disturbed, errors = _kill_mid_stream(fleet, 2, 0)
    assert not errors, errors
    assert disturbed == undisturbed
    moves = _events(coordinator_log, "session_failed_over")[before:]
    assert moves and all(m.get("moved_stages") == [2] for m in moves), moves
    # New sessions open across the lanes (stage 0's either replica -> stage 1's replica 0 ->
    # stage 2's replica 1) and answer the same tokens.
    with PipeshardClient(fleet.coordinator, timeout_s=300) as client:
        assert _tokens(client, PROMPTS[1]) == undisturbed[1]


def _stub(fleet: Fleet, k: int, r: int) -> stage_pb2_grpc.StageServiceStub:
    return stage_pb2_grpc.StageServiceStub(grpc.insecure_channel(fleet.process(stage_name(k, r)).address))


def test_a_route_naming_an_unknown_replica_is_refused_naming_it_and_a_stranger_cannot_reroute(routed):
    _, fleet = routed
    stage0 = _stub(fleet, 0, 1)
    info = stage0.GetStageInfo(stage_pb2.GetStageInfoRequest(), timeout=10)
    assert len(info.next_hops) == 2 and info.next_hops[0] == info.next_hop  # its own lane's first
    owner, stranger = owner_metadata(new_secret()), owner_metadata(new_secret())

    with pytest.raises(grpc.RpcError) as refused:
        stage0.OpenSession(
            stage_pb2.OpenSessionRequest(session_id="hop-5", next_hop=5), metadata=owner, timeout=10
        )
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "next_hop" in refused.value.details() and "5" in refused.value.details()
    assert info.next_hops[1] in refused.value.details()  # the replicas it does know, named

    stage0.OpenSession(
        stage_pb2.OpenSessionRequest(session_id="hop-1", next_hop=1), metadata=owner, timeout=10
    )
    try:
        with pytest.raises(grpc.RpcError) as refused:
            stage0.RouteSession(
                stage_pb2.RouteSessionRequest(session_id="hop-1", next_hop=2), metadata=owner, timeout=10
            )
        assert (
            refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "next_hop" in refused.value.details()
        )
        # Another owner's session is as unknown as none: it cannot be pointed anywhere.
        with pytest.raises(grpc.RpcError) as refused:
            stage0.RouteSession(
                stage_pb2.RouteSessionRequest(session_id="hop-1", next_hop=0), metadata=stranger, timeout=10
            )
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND
        moved = stage0.RouteSession(
            stage_pb2.RouteSessionRequest(session_id="hop-1", next_hop=0), metadata=owner, timeout=10
        )
        assert moved.positions == 0
        with pytest.raises(grpc.RpcError) as refused:  # more than the session holds
            stage0.RouteSession(
                stage_pb2.RouteSessionRequest(session_id="hop-1", keep_positions=3),
                metadata=owner,
                timeout=10,
            )
        assert (
            refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            and "keep_positions" in refused.value.details()
        )
    finally:
        stage0.ReleaseSession(stage_pb2.ReleaseSessionRequest(session_id="hop-1"), metadata=owner, timeout=10)
    final = _stub(fleet, 2, 1)
    with pytest.raises(grpc.RpcError) as refused:  # the final stage has no next hop at all
        final.OpenSession(
            stage_pb2.OpenSessionRequest(session_id="hop-0", next_hop=0), metadata=owner, timeout=10
        )
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "next_hop" in refused.value.details()
