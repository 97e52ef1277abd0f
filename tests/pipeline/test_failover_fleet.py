"""Replica stages as processes: a killed replica's running requests finish on the other lane with
the tokens of an undisturbed run; with every replica of a stage gone, UNAVAILABLE names it; a
restarted replica rejoins without a coordinator restart."""

from __future__ import annotations

import os
import threading
import time

import grpc
import pytest

from pipeshard.clients.client import PipeshardClient
from pipeshard.services.launcher import spawn, stage_name

pytestmark = pytest.mark.slow

BASE_PORT = 52400  # this module's fleet: replica r of stage k on BASE_PORT + k + 20r
USERS = 8
TOKENS = 40
PROMPTS = [f"Write a short story about a {animal}." for animal in ("cat", "dog", "fox", "owl")] * 2


@pytest.fixture(scope="module")
def replicated(smollm2_export, fleet_factory):
    """Two lanes of two stages, exact precision (the default)."""
    shards = smollm2_export(2, "int4")
    fleet = fleet_factory(shards, 2, stage_ports=[BASE_PORT, BASE_PORT + 1], replicas=2)
    return shards, fleet


def _tokens(client: PipeshardClient, prompt: str, on_first=None) -> list[int]:
    tokens: list[int] = []
    for chunk in client.stream(prompt, max_tokens=TOKENS, ignore_eos=True):
        tokens.extend(chunk.token_ids)
        if on_first is not None and len(tokens) >= 2:
            on_first()
            on_first = None
    return tokens


def _concurrently(address: str, on_first=None) -> tuple[list[list[int]], list[BaseException]]:
    results: list[list[int]] = [[] for _ in PROMPTS]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            with PipeshardClient(address, timeout_s=300) as client:
                results[i] = _tokens(client, PROMPTS[i], on_first)
        except BaseException as exc:  # recorded: the test asserts there were none
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(USERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    return results, errors


def test_killed_replica_fails_over_then_all_gone_then_rejoins(replicated):
    shards, fleet = replicated
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
        port = BASE_PORT + 1 + 20
        args = ["stage", "--stage", "1", "--shards", str(shards), "--port", str(port)]
        fleet.processes[fleet.processes.index(victim)] = spawn(
            stage_name(1, 1), args, fleet.run_dir, dict(os.environ), 180
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                assert _tokens(client, PROMPTS[1]) == undisturbed[1]
                break
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
