"""Replica stages as processes: a killed replica's running requests finish on the other lane with
the tokens of an undisturbed run, their KV restored from the coordinator's standby copies; with
every replica of a stage gone, UNAVAILABLE names it; a restarted replica rejoins without a
coordinator restart; SIGHUP drains and adds lanes."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import grpc
import pytest

from pipeshard.clients.client import PipeshardClient
from pipeshard.services.launcher import Fleet, spawn, stage_name
from pipeshard.topology import Endpoint, StageEndpoint, Topology
from tests.pipeline.concurrent_streams import concurrently, stream_tokens
from tests.pipeline.stage_probe import live_sessions

pytestmark = pytest.mark.slow

BASE_PORT = 52205  # this module's fleet: replica r of stage k on BASE_PORT + k + 20r
USERS = 8
TOKENS = 40
KILL_AFTER = 8  # tokens every stream has out before the kill: its standby copy holds its prompt
# About 120 tokens each (with the chat template): a few whole blocks of 32 for the copies to hold.
_SCENE = "The village sits where the river bends past the old mill, the orchard and the stone bridge. " * 5
PROMPTS = [f"{_SCENE}Write a short story about a {animal}." for animal in ("cat", "dog", "fox", "owl")] * 2
SHORT_PROMPTS = ["Write a short story about a cat.", "Write a short story about a dog."]


def _address(k: int, r: int) -> str:
    return f"127.0.0.1:{BASE_PORT + k + 20 * r}"


def _topology(shards: Path, lanes: list[int]) -> Topology:
    """This module's fleet as a topology file listing ``lanes``."""

    def lane(r: int) -> list[StageEndpoint]:
        return [StageEndpoint("127.0.0.1", BASE_PORT + k + 20 * r, 0) for k in range(2)]

    ends = [lane(r) for r in lanes]
    coordinator = Endpoint("127.0.0.1", BASE_PORT + 50, BASE_PORT + 51)
    return Topology(str(shards), coordinator, Endpoint("127.0.0.1", 0, 0), ends[0], replicas=ends[1:])


@pytest.fixture(scope="module")
def replicated(smollm2_export, fleet_factory, tmp_path_factory):
    """Two lanes of two stages at the default precision (`invariant`: a restored standby copy's
    stages re-feed its last position's input, carried in the snapshot); the coordinator also
    reads a topology file listing both (re-read on SIGHUP)."""
    shards = smollm2_export(2, "int4")
    topology = tmp_path_factory.mktemp("failover") / "topology.yaml"
    _topology(shards, [0, 1]).save(topology)
    fleet = fleet_factory(
        shards,
        2,
        stage_ports=[BASE_PORT, BASE_PORT + 1],
        replicas=2,
        extra_coordinator_args=["--topology", str(topology)],
    )
    return shards, fleet, topology


def _ensure_running(fleet: Fleet, shards: Path, k: int, r: int) -> None:
    """Restarts replica ``r`` of stage ``k`` on its port if it is not running."""
    proc = fleet.process(stage_name(k, r))
    if proc.popen.poll() is None:
        return
    args = ["stage", "--stage", str(k), "--shards", str(shards), "--port", str(BASE_PORT + k + 20 * r)]
    args += ["--next-hop", _address(1, r)] if k == 0 else []
    fleet.processes[fleet.processes.index(proc)] = spawn(
        stage_name(k, r), args, fleet.run_dir, dict(os.environ), 180
    )


def _events(fleet: Fleet, event: str) -> list[dict]:
    lines = fleet.process("coordinator").log.read_text().splitlines()
    return [json.loads(line) for line in lines if f'"{event}"' in line]


def _logged(fleet: Fleet, event: str, timeout_s: float = 60) -> bool:
    deadline = time.monotonic() + timeout_s
    while f'"{event}"' not in fleet.process("coordinator").log.read_text():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def _tokens(client: PipeshardClient, prompt: str) -> list[int]:
    return stream_tokens(client, prompt, TOKENS)


def _concurrently(
    address: str, on_first=None, prompts: list[str] = PROMPTS
) -> tuple[list[list[int]], list[BaseException]]:
    return concurrently(address, prompts, TOKENS, on_first, KILL_AFTER)


def test_killed_replica_fails_over_then_all_gone_then_rejoins(replicated):
    shards, fleet, _ = replicated
    undisturbed, errors = _concurrently(fleet.coordinator)
    assert not errors
    assert all(len(t) == TOKENS for t in undisturbed)

    # kill -9 the final stage of lane 1 once every stream has tokens out.
    started = threading.Barrier(USERS + 1)
    victim = fleet.process(stage_name(1, 1))
    killer = threading.Thread(target=lambda: (started.wait(timeout=300), victim.popen.kill()))
    killer.start()
    disturbed, errors = _concurrently(fleet.coordinator, on_first=lambda: started.wait(timeout=300))
    killer.join()
    assert victim.popen.wait(timeout=10) is not None
    assert not errors, errors
    assert disturbed == undisturbed
    moves = _events(fleet, "session_failed_over")
    assert moves and any(m["kv_from"] == "standby" and m["restored_tokens"] >= 96 for m in moves), moves

    # Every replica of stage 1 gone: UNAVAILABLE naming stage 1, within the fault contract's bound.
    fleet.process(stage_name(1, 0)).popen.kill()
    fleet.process(stage_name(1, 0)).popen.wait(timeout=10)
    with PipeshardClient(fleet.coordinator, timeout_s=60) as client:
        began = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            client.generate(PROMPTS[0], max_tokens=4)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "stage 1" in info.value.details()
        assert time.monotonic() - began < 10

        # Lane 1's stage 1 restarts on its port: the lane rejoins and serves, same tokens.
        _ensure_running(fleet, shards, 1, 1)
        deadline = time.monotonic() + 60
        while True:
            try:
                assert _tokens(client, PROMPTS[1]) == undisturbed[1]
                break
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    raise
                time.sleep(0.5)


def _lane0_used_by_two_streams(fleet: Fleet) -> bool:
    """Runs two concurrent requests; whether lane 0's first stage held more sessions meanwhile
    than before them."""
    before = live_sessions(_address(0, 0))
    seen = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.append(live_sessions(_address(0, 0)))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        # Short prompts no lane keeps (below --prefix-min-tokens): lane choice by load alone.
        results, errors = _concurrently(fleet.coordinator, prompts=SHORT_PROMPTS)
    finally:
        done.set()
        watcher.join()
    assert not errors and all(len(t) == TOKENS for t in results)
    return max(seen, default=before) > before


def test_sighup_drains_a_lane_left_out_of_the_topology_and_adds_it_back(replicated):
    shards, fleet, topology = replicated
    _topology(shards, [1]).save(topology)
    fleet.process("coordinator").popen.send_signal(signal.SIGHUP)
    assert _logged(fleet, "lane_drained")
    for k in range(2):  # whatever the test before left dead
        for r in range(2):
            _ensure_running(fleet, shards, k, r)
    assert not _lane0_used_by_two_streams(fleet)  # drained: no new session goes there
    _topology(shards, [1, 0]).save(topology)
    fleet.process("coordinator").popen.send_signal(signal.SIGHUP)
    assert _logged(fleet, "lane_added")
    assert _lane0_used_by_two_streams(fleet)  # back in rotation, least loaded
