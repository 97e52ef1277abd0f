"""`make soak SOAK_MODE=failover`: many clients for minutes while replicas are killed and restarted.

A 2-stage INT4 loopback fleet with two replicas of each stage at the default precision. Each
prompt's greedy answer is first taken undisturbed (its reference). Then SOAK_CLIENTS concurrent
clients (default 16) send requests back to back (a random prompt and 8 to 48 tokens, eos
ignored) for SOAK_SECONDS (default 300), while every SOAK_KILL_EVERY seconds (default 20) one
replica (the stages and lanes taken in turn) is killed with SIGKILL and started again on its
port. A kill waits until the coordinator has seen the last one's replica serve again, so one
lane always serves. Keys: ``failed_requests`` (any request that did not finish: goal 0),
``mismatches`` (finished answers that differ from their reference: goal 0 in exact mode),
``recovery_ms_p95`` (from a kill to the token that ends each affected stream's longest stall
after it; affected: the coordinator logged its failover), the kills and the failovers.
SOAK_SECONDS may be shortened on a loaded machine (say so with the figures).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sys
import tempfile
import time
import uuid
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

import grpc

from bench.failover import _failed_over, _percentiles, _rejoined
from bench.soak import PROMPTS, _shards
from bench.stats import command_with_knobs, write_result
from pipeshard.clients.client import AsyncPipeshardClient, PipeshardClient
from pipeshard.offline import set_offline_defaults
from pipeshard.precision import DEFAULT_PRECISION
from pipeshard.services.launcher import fleet_env, spawn, stage_args, stage_name, start_fleet

SECONDS = float(os.environ.get("SOAK_SECONDS", "300"))
CLIENTS = int(os.environ.get("SOAK_CLIENTS", "16"))
KILL_EVERY = float(os.environ.get("SOAK_KILL_EVERY", "20"))
PORT_BASE = int(os.environ.get("SOAK_PORT_BASE", "52250"))  # replica r of stage k: base + k + 20r
SEED = int(os.environ.get("SOAK_SEED", "32"))
MAX_TOKENS = 48
KNOBS = ("SOAK_MODE", "SOAK_SECONDS", "SOAK_CLIENTS", "SOAK_KILL_EVERY", "SOAK_PORT_BASE", "SOAK_SEED")


async def _stream(
    address: str, prompt: str, max_tokens: int, request_id: str, out_at: list[float]
) -> list[int]:
    tokens: list[int] = []
    async with AsyncPipeshardClient(address, timeout_s=300) as client:
        async for response in client.responses(
            prompt, max_tokens=max_tokens, ignore_eos=True, request_id=request_id
        ):
            if response.HasField("chunk"):
                tokens.extend(response.chunk.token_ids)
                out_at.append(time.perf_counter())
    return tokens


async def _soak(fleet, shards: Path, reference: dict[str, list[int]]) -> dict:
    rng = random.Random(SEED)
    outcomes: Counter[str] = Counter()
    mismatches: list[dict] = []
    streams: dict[str, list[float]] = {}  # request id -> its tokens' arrival times
    kills: list[tuple[float, str, str, datetime]] = []  # (when, replica, address, wall clock)
    started = time.perf_counter()
    stop_at = started + SECONDS

    async def client() -> None:
        while time.perf_counter() < stop_at:
            prompt, max_tokens = rng.choice(PROMPTS), rng.randint(8, MAX_TOKENS)
            request_id = uuid.uuid4().hex
            streams[request_id] = out_at = []
            try:
                tokens = await _stream(fleet.coordinator, prompt, max_tokens, request_id, out_at)
            except grpc.aio.AioRpcError as exc:  # counted: the soak's goal is none
                outcomes[exc.code().name] += 1
                continue
            outcomes["ok"] += 1
            if tokens != reference[prompt][:max_tokens]:
                mismatches.append({"prompt": prompt, "max_tokens": max_tokens, "got": tokens})

    async def killer() -> None:
        turn = 0
        while time.perf_counter() + KILL_EVERY < stop_at:
            await asyncio.sleep(KILL_EVERY)
            k, r = turn % 2, (turn // 2) % 2  # stage 0 lane 0, stage 1 lane 0, stage 0 lane 1, ...
            turn += 1
            name = stage_name(k, r)
            victim = fleet.process(name)
            port = PORT_BASE + k + 20 * r
            victim.popen.send_signal(signal.SIGKILL)
            kills.append((time.perf_counter(), name, f"127.0.0.1:{port}", datetime.now(UTC)))
            await asyncio.to_thread(victim.popen.wait)
            # stage 0 forwards to both stage 1 replicas, its own lane's first (as the launcher starts it)
            hops = [f"127.0.0.1:{PORT_BASE + 1 + 20 * lane}" for lane in (r, 1 - r)]
            next_hop = ",".join(hops) if k == 0 else None
            args = stage_args(k, shards, port, DEFAULT_PRECISION, "json", next_hop)  # the fleet's precision
            proc = await asyncio.to_thread(spawn, name, args, fleet.run_dir, fleet_env(), 180)
            fleet.processes[fleet.processes.index(victim)] = proc
            await _rejoined(fleet, f"127.0.0.1:{port}")

    kill_task = asyncio.create_task(killer())
    await asyncio.gather(*(client() for _ in range(CLIENTS)))
    kill_task.cancel()
    await asyncio.gather(kill_task, return_exceptions=True)

    recovery = []
    for request_id in _failed_over(fleet):
        out_at = streams.get(request_id, [])
        # The kill the stream failed over from: the last one before the stall that ends its longest gap.
        for killed_at, *_ in reversed(kills):
            after = [killed_at, *(t for t in out_at if t > killed_at)]
            if any(t < killed_at for t in out_at) and len(after) > 1:
                resumed = max(range(1, len(after)), key=lambda j: after[j] - after[j - 1])
                recovery.append((after[resumed] - killed_at) * 1000)
                break
    return {
        "seconds": round(time.perf_counter() - started, 1),
        "outcomes": dict(outcomes),
        "mismatch_examples": mismatches[:3],
        "mismatches": len(mismatches),
        "kills": [name for _, name, _, _ in kills],
        "failovers": len(_failed_over(fleet)),
        "recovery_ms": _percentiles(recovery),
        "out_of_rotation_ms": _out_of_rotation(fleet, kills),
    }


def _out_of_rotation(fleet, kills: list) -> dict:
    """Per kill, from the kill to the coordinator's log of the replica's lane leaving rotation
    (its health watch seeing it down): p50, p95 and the largest."""
    downs = []
    for line in fleet.process("coordinator").log.read_text().splitlines():
        if '"stage_reachability"' in line:
            event = json.loads(line)
            if not event["up"]:
                downs.append((event["address"], datetime.fromisoformat(event["timestamp"])))
    delays = []
    for _, _, address, at in kills:
        seen = [t for a, t in downs if a == address and t >= at]
        if seen:
            delays.append((min(seen) - at).total_seconds() * 1000)
    return _percentiles(delays) | {"max": round(max(delays), 1) if delays else None}


def _all_gone_ms(fleet) -> dict:
    """Every replica of stage 1 killed: how long the next request takes to end UNAVAILABLE, and
    whether its message names stage 1."""
    for r in range(2):
        fleet.process(stage_name(1, r)).popen.kill()
        fleet.process(stage_name(1, r)).popen.wait()
    with PipeshardClient(fleet.coordinator, timeout_s=60) as client:
        began = time.perf_counter()
        try:
            client.generate(PROMPTS[0], max_tokens=4)
        except grpc.RpcError as exc:
            return {
                "ms": round((time.perf_counter() - began) * 1000, 1),
                "code": exc.code().name,
                "names_stage_1": "stage 1" in (exc.details() or ""),
            }
    return {"ms": None, "code": "OK", "names_stage_1": False}


def main() -> int:
    set_offline_defaults()
    shards = _shards()
    fleet = start_fleet(
        shards,
        2,
        Path(tempfile.mkdtemp(prefix="pipeshard-soak-failover-")),
        stage_ports=[PORT_BASE, PORT_BASE + 1],
        replicas=2,
        coordinator_port=PORT_BASE + 50,
    )
    try:
        with PipeshardClient(fleet.coordinator, timeout_s=300) as client:
            reference = {
                p: client.generate(p, max_tokens=MAX_TOKENS, ignore_eos=True).token_ids for p in PROMPTS
            }
        result = asyncio.run(_soak(fleet, shards, reference))
        result["all_replicas_gone"] = _all_gone_ms(fleet)
    finally:
        fleet.stop()
    failed = sum(n for outcome, n in result["outcomes"].items() if outcome != "ok")
    result.update(
        clients=CLIENTS,
        kill_every_s=KILL_EVERY,
        seed=SEED,
        failed_requests=failed,
        recovery_ms_p95=result["recovery_ms"]["p95"],
    )
    write_result("soak_failover", result, command=command_with_knobs("soak", KNOBS))
    return 1 if failed or result["mismatches"] else 0


if __name__ == "__main__":
    sys.exit(main())
