"""`make soak`: many concurrent clients with random cancels while a stage is killed and restarted.

A 2-stage INT4 loopback fleet (real processes). Each prompt's greedy answer is first taken
alone (the solo run). Then SOAK_REQUESTS requests (default 200) from SOAK_CLIENTS concurrent
clients (default 16), each a random prompt and length with eos ignored, about one in five
cancelled after a random delay; after a third of them stage 1 is killed (SIGKILL) and started
again on its port. Checked, and the run fails (exit 1) otherwise:
  * every uncancelled answer equals the prefix of its solo run, or ends with UNAVAILABLE;
  * no other status (no INTERNAL, no mixed-up answer);
  * no session is left on any stage afterwards;
  * each process's resident memory grows by less than SOAK_MAX_GROWTH_MIB (default 200) from
    after the warm-up to the end (the restarted stage: from its restart).
Figures go to bench/results/soak.json (and docs/RELIABILITY.md by hand).
"""

from __future__ import annotations

import asyncio
import os
import random
import socket
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import grpc

from bench.stats import write_result
from pipeshard import paths
from pipeshard.clients.client import AsyncPipeshardClient, PipeshardClient
from pipeshard.offline import set_offline_defaults
from pipeshard.services.launcher import fleet_env, spawn, stage_args, start_fleet
from pipeshard.v1 import stage_pb2, stage_pb2_grpc

REQUESTS = int(os.environ.get("SOAK_REQUESTS", "200"))
CLIENTS = int(os.environ.get("SOAK_CLIENTS", "16"))
MAX_GROWTH_MIB = float(os.environ.get("SOAK_MAX_GROWTH_MIB", "200"))
CANCEL_FRACTION = 0.2
MAX_TOKENS = 32
SEED = int(os.environ.get("SOAK_SEED", "15"))
PROMPTS = (
    "Say hi.",
    "What is the capital of France?",
    "Write a haiku about rain.",
    "List three prime numbers.",
    "Explain what a CPU does in one sentence.",
    "Name a colour of the sky.",
    "Count from one to five.",
    "Give me a word that rhymes with cat.",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _live_sessions(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        stub = stage_pb2_grpc.StageServiceStub(channel)
        return stub.GetStageInfo(stage_pb2.GetStageInfoRequest(), timeout=5).live_sessions


def _shards(stages: int = 2) -> Path:
    """SOAK_SHARDS, or the default model's INT4 export in ``stages`` stages (made if missing)."""
    chosen = os.environ.get("SOAK_SHARDS")
    if chosen:
        return Path(chosen)
    from pipeshard.exporter.export import export_model

    out = paths.shards_dir() / paths.export_name(paths.DEFAULT_MODEL, stages, "int4")
    if not (out / "manifest.json").exists():
        export_model(paths.default_model_dir(), out, stages=stages, weights="int4")
    return out


async def _one(
    address: str, prompt: str, max_tokens: int, cancel_after: float | None
) -> tuple[str, list[int]]:
    """Outcome ("ok", "cancelled", or a status code name) and the tokens received."""
    tokens: list[int] = []

    async def run() -> None:
        async with AsyncPipeshardClient(address, timeout_s=120) as client:
            async for response in client.responses(prompt, max_tokens=max_tokens, ignore_eos=True):
                if response.HasField("chunk"):
                    tokens.extend(response.chunk.token_ids)

    try:
        if cancel_after is None:
            await run()
        else:
            try:
                await asyncio.wait_for(run(), cancel_after)
            except TimeoutError:
                return "cancelled", tokens
    except grpc.aio.AioRpcError as exc:
        return exc.code().name, tokens
    return "ok", tokens


async def _soak(fleet, shards: Path, ports: list[int], solo: dict[str, list[int]]) -> dict:
    rng = random.Random(SEED)
    plan = [
        (
            rng.choice(PROMPTS),
            rng.randint(4, MAX_TOKENS),
            rng.uniform(0.05, 1.5) if rng.random() < CANCEL_FRACTION else None,
        )
        for _ in range(REQUESTS)
    ]
    outcomes: Counter[str] = Counter()
    mismatches: list[dict] = []
    done = 0
    restart_at = REQUESTS // 3
    restarted = asyncio.Event()
    queue: asyncio.Queue = asyncio.Queue()
    for item in plan:
        queue.put_nowait(item)

    async def worker() -> None:
        nonlocal done
        while not queue.empty():
            prompt, max_tokens, cancel_after = queue.get_nowait()
            outcome, tokens = await _one(fleet.coordinator, prompt, max_tokens, cancel_after)
            outcomes[outcome] += 1
            if outcome == "ok" and tokens != solo[prompt][:max_tokens]:
                mismatches.append({"prompt": prompt, "max_tokens": max_tokens, "got": tokens})
            if outcome == "UNAVAILABLE":
                await asyncio.sleep(1.0)  # a client backs off while a stage is down
            done += 1

    async def restart_stage1() -> dict:
        while done < restart_at:
            await asyncio.sleep(0.05)
        stage1 = fleet.process("stage1")
        stage1.popen.kill()
        stage1.popen.wait()
        killed, killed_after = time.monotonic(), done
        args = stage_args(1, shards, ports[1], "default", "json", None)
        proc = await asyncio.to_thread(spawn, "stage1", args, fleet.run_dir, fleet_env(), 180)
        fleet.processes[fleet.processes.index(stage1)] = proc
        restarted.set()
        return {
            "killed_after_requests": killed_after,
            "killed_at_s": round(killed - started, 1),
            "restarted_after_requests": done,
            "down_s": round(time.monotonic() - killed, 2),
            "pid": proc.popen.pid,
        }

    started = time.monotonic()
    restart = asyncio.create_task(restart_stage1())
    await asyncio.gather(*(worker() for _ in range(CLIENTS)))
    restart_info = await restart
    return {
        "seconds": round(time.monotonic() - started, 1),
        "outcomes": dict(outcomes),
        "mismatches": mismatches,
        "restart": restart_info,
    }


def main() -> int:
    set_offline_defaults()
    shards = _shards()
    run_dir = Path(tempfile.mkdtemp(prefix="pipeshard-soak-"))
    ports = [_free_port(), _free_port()]
    fleet = start_fleet(shards, 2, run_dir, stage_ports=ports)
    try:
        with PipeshardClient(fleet.coordinator, timeout_s=120) as client:
            solo = {p: client.generate(p, max_tokens=MAX_TOKENS, ignore_eos=True).token_ids for p in PROMPTS}
        before = {p.name: _rss_mib(p.popen.pid) for p in fleet.processes}
        result = asyncio.run(_soak(fleet, shards, ports, solo))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(_live_sessions(a) for a in fleet.stages):
            time.sleep(0.2)
        result["sessions_left"] = [_live_sessions(a) for a in fleet.stages]
        after = {p.name: _rss_mib(p.popen.pid) for p in fleet.processes}
    finally:
        fleet.stop()
    result["rss_mib"] = {
        name: {"before": round(before[name], 1), "after": round(after[name], 1)} for name in before
    }
    # The restarted stage is a new process: its growth counts from its own start.
    growth = {n: after[n] - before[n] for n in before if n != "stage1"}
    allowed = {"OK", "ok", "cancelled", "UNAVAILABLE"}
    failures = []
    if result["mismatches"]:
        failures.append(f"{len(result['mismatches'])} answers differ from their solo runs")
    if set(result["outcomes"]) - allowed:
        failures.append(f"unexpected outcomes: {result['outcomes']}")
    if any(result["sessions_left"]):
        failures.append(f"sessions left on the stages: {result['sessions_left']}")
    if any(g > MAX_GROWTH_MIB for g in growth.values()):
        failures.append(f"memory grew beyond {MAX_GROWTH_MIB:g} MiB: {growth}")
    result.update(requests=REQUESTS, clients=CLIENTS, seed=SEED, failures=failures, passed=not failures)
    write_result("soak", result, command="make soak")
    for failure in failures:
        print(f"soak FAILED: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
