"""`make bench-failover`: recovery of running requests when a replica is killed mid-generation.

Two 2-stage INT4 fleets with two replicas of each stage at the default precision, up at
once: the default one, whose coordinator keeps each running session's KV captured from its
replicas block by block (a standby copy, services/coordinator/kv_standby.py) and routes each
session per stage (a dead replica moves only its stage's part), and one with copies off
(``--standby-kv-bytes 0``: every failover replays). Per point (1 and 8 users, about 128 and
1,024 prompt tokens) and round on the default fleet, and at 8 users x 1,024 on the other: every
user streams a greedy request (eos ignored) with its own request id; once each has a few tokens
out, the replica of the final stage holding the most sessions is killed with SIGKILL, then
restarted on its port; the next round starts once the coordinator has seen it serve again. A
stream is affected when the coordinator logged its request's failover; its recovery is the time
from the kill to the token that ends its longest stall after the kill (a token already on its way
when the kill landed can arrive first). Every stream's tokens are compared with the same
request's undisturbed run on the same fleet (``mismatches``, exact mode), and any stream that
ended in an error counts in ``failed_requests``. Each point also gives the undisturbed run's
median TTFT: a replay costs about one prefill of the context so far.

The coordinator logs where each failover's KV came from (``kv_from``: ``standby``, the prefix
cache, or none) and how long opening, restoring and replaying took; ``restore`` samples restored
a standby copy, ``replay`` samples restored nothing (``recovery_ms_p95_1024_replay`` comes from
the fleet without copies). What the copies cost while nothing fails: undisturbed rounds at 8
users x 1,024 tokens on the two fleets, interleaved (BENCH_COST_RUNS after one warm-up), as the
ratio of medians of generated tokens per second and of TTFT, on over off, with 95% intervals.

Per hop against lanes (``per_hop``): the default fleet against a third one whose replicas ride
fixed lanes (each stage forwards to its own lane's next replica only, as before per-hop routing:
a failover restores the session's copy on every stage of another lane), kill rounds at 8 users x
1,024 tokens interleaved after one warm-up pair. Per round the median ``restore_ms`` of the
failovers that restored a copy (per hop: the dead stage's parts restored, the others cut back and
re-pointed; lanes: every stage's parts) and the median recovery; the ratio per hop over lanes of
their medians with a 95% interval (goal: restore <= 0.6). ``BENCH_PART=hops`` runs only this part.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import tempfile
import time
import uuid
from datetime import datetime
from pathlib import Path

from bench.stats import command_with_knobs, median, ratio_ci, write_result
from pipeshard import paths
from pipeshard.clients.client import AsyncPipeshardClient
from pipeshard.offline import set_offline_defaults
from pipeshard.precision import DEFAULT_PRECISION
from pipeshard.services.launcher import Fleet, spawn, stage_args, stage_name, start_fleet
from pipeshard.shard.prompting import Prompter
from pipeshard.v1 import stage_pb2, stage_pb2_grpc

ROUNDS = int(os.environ.get("BENCH_RUNS", "3"))
COST_ROUNDS = int(os.environ.get("BENCH_COST_RUNS", "3"))
TOKENS = int(os.environ.get("BENCH_TOKENS", "32"))
# The default fleet's replica r of stage k on base + k + 20r, its coordinator on base + 50; the
# fleet without standby copies two ports up.
PORT_BASE = int(os.environ.get("BENCH_PORT_BASE", "52500"))
USERS = (1, 8)
CONTEXTS = (128, 1024)
# BENCH_PART=default: only the default fleet's kill rounds (no fleet without copies, no cost rounds,
# no lanes), for a machine too loaded for the whole run; BENCH_PART=hops: only per hop against lanes.
PART = os.environ.get("BENCH_PART", "")
DEFAULT_ONLY = PART == "default"
HOPS_POINT = (8, 1024)  # users x context of the per-hop against lanes rounds
# A reduced run names its points (users x context, comma-separated): BENCH_POINTS=8x1024.
POINTS = [tuple(int(n) for n in p.split("x")) for p in os.environ.get("BENCH_POINTS", "").split(",") if p]
# One failover, kill to next token: the watch sees the loss (detect), the request's failed step
# reaches its failover (wait), the old session is aborted, a new one opened, the KV restored (the
# standby copy's parts joined, then sent and loaded), the rest replayed, and the lost step sent
# again until its token streams (resend).
PHASE_KEYS = (
    "kv_from",
    "restored_tokens",
    "replayed_tokens",
    "detect_ms",
    "wait_ms",
    "abort_ms",
    "open_ms",
    "restore_ms",
    "join_ms",
    "load_ms",
    "replay_ms",
    "resend_ms",
)
KILL_AFTER = 3  # tokens every stream has out before the kill
KNOBS = ("BENCH_RUNS", "BENCH_COST_RUNS", "BENCH_TOKENS", "BENCH_POINTS", "BENCH_PART", "BENCH_PORT_BASE")


def _prompt(tokenizer, user: int, context: int) -> str:
    """A prompt of about ``context`` tokens, distinct per user."""
    words = f"Note {user}: the river bends past the old mill and the orchard. ".split()
    text: list[str] = []
    while len(tokenizer.encode(" ".join(text))) < context - 20:  # the chat template adds ~20
        text += words
    return " ".join(text) + " Summarise this."


async def _stream(
    address: str, prompt: str, request_id: str, out_at: list[float], started, tokens: list[int]
) -> None:
    out_at.append(time.perf_counter())  # the request's start: out_at[1] - out_at[0] is its TTFT
    async with AsyncPipeshardClient(address, timeout_s=600) as client:
        async for response in client.responses(
            prompt, max_tokens=TOKENS, ignore_eos=True, request_id=request_id
        ):
            if response.HasField("chunk"):
                tokens.extend(response.chunk.token_ids)
                out_at.append(time.perf_counter())
                if len(tokens) >= KILL_AFTER:
                    started.set()


def _percentiles(values: list[float]) -> dict:
    """p50 and p95 (nearest rank) of the recovery samples, and how many there were."""
    if not values:
        return {"p50": None, "p95": None, "samples": 0}
    ordered = sorted(values)

    def rank(q: float) -> float:
        return round(ordered[max(0, math.ceil(q * len(ordered)) - 1)], 1)

    return {"p50": rank(0.50), "p95": rank(0.95), "samples": len(values)}


async def _rejoined(
    fleet: Fleet, address: str, timeout_s: float = 120, *, unnamed_is_up: bool = False
) -> None:
    """Waits until the coordinator's watch has seen ``address`` serve again since its last
    loss (the lane is back in rotation), so the next round spreads over both lanes.
    ``unnamed_is_up``: an address the log never named counts as serving (a link stall shorter
    than keepalive's bound is never reported)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = None
        for line in fleet.process("coordinator").log.read_text().splitlines():
            if '"stage_reachability"' in line and address in line:
                state = json.loads(line)["up"]
        if state or (unnamed_is_up and state is None):
            await asyncio.sleep(0.5)  # the lane's entry stream re-dials too
            return
        await asyncio.sleep(0.2)
    raise RuntimeError(f"{address} did not rejoin within {timeout_s:g} s")


def _live_sessions(address: str) -> int:
    import grpc

    with grpc.insecure_channel(address) as channel:
        stub = stage_pb2_grpc.StageServiceStub(channel)
        return stub.GetStageInfo(stage_pb2.GetStageInfoRequest(), timeout=5).live_sessions


def _failed_over(fleet: Fleet) -> dict[str, dict]:
    """Request id -> its (last) logged failover: where the KV came from, positions restored and
    replayed, the milliseconds spent aborting, opening, restoring and replaying, and (``_end``,
    wall-clock seconds) when it finished; with a standby copy, the restore's split into joining
    the parts (``join_ms``) and sending and loading them (``load_ms``)."""
    events, restored, replayed = {}, {}, {}
    for line in fleet.process("coordinator").log.read_text().splitlines():
        if '"session_failed_over"' in line:
            event = json.loads(line)
            event["_end"] = _wall(event["timestamp"])
            events[event.get("request_id", "")] = event
        elif '"standby_restored"' in line:
            event = json.loads(line)
            restored[event["session_id"]] = event
        elif '"failover_replayed"' in line:  # the replay's rows, which the engine plans after it
            event = json.loads(line)
            replayed[event["session_id"]] = event
    for event in events.values():
        split = restored.get(event["session_id"], {})
        event["join_ms"], event["load_ms"] = split.get("join_ms"), split.get("load_ms")
        event["replay_ms"] = replayed.get(event["session_id"], {}).get("replay_ms")
    return events


def _wall(timestamp: str) -> float:
    """A log line's ISO timestamp as wall-clock seconds."""
    return datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp()


def _lost_at(fleet: Fleet, address: str, after: float) -> float | None:
    """When (wall clock) the coordinator's watch first logged ``address`` lost after ``after``."""
    for line in fleet.process("coordinator").log.read_text().splitlines():
        if '"stage_reachability"' in line and address in line:
            event = json.loads(line)
            if not event["up"] and _wall(event["timestamp"]) >= after:
                return _wall(event["timestamp"])
    return None


async def _round(fleet: Fleet, shards: Path, base: int, prompts: list[str], kill: bool) -> dict:
    n = len(prompts)
    ids = [uuid.uuid4().hex for _ in range(n)]
    out_at: list[list[float]] = [[] for _ in range(n)]
    tokens: list[list[int]] = [[] for _ in range(n)]
    started = [asyncio.Event() for _ in range(n)]
    began = time.perf_counter()
    tasks = [
        asyncio.create_task(_stream(fleet.coordinator, prompts[i], ids[i], out_at[i], started[i], tokens[i]))
        for i in range(n)
    ]
    killed_at = None
    if kill:
        await asyncio.gather(*(e.wait() for e in started))
        lanes = fleet.lanes
        victim_lane = max(range(len(lanes)), key=lambda r: _live_sessions(lanes[r][1]))
        victim = fleet.process(stage_name(1, victim_lane))
        victim.popen.send_signal(signal.SIGKILL)
        killed_at, killed_wall = time.perf_counter(), time.time()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    wall = time.perf_counter() - began
    errors = sum(isinstance(r, BaseException) for r in results)
    recovery, phases = [], []
    if kill:
        victim.popen.wait()
        affected = _failed_over(fleet)
        port = base + 1 + 20 * victim_lane
        lost = _lost_at(fleet, f"127.0.0.1:{port}", killed_wall - 1)
        for i in range(n):
            if ids[i] in affected:
                event = affected[ids[i]]
                after = [killed_at, *(t for t in out_at[i] if t > killed_at)]
                if len(after) < 2:
                    continue
                # the token ending the longest stall after the kill
                resumed = max(range(1, len(after)), key=lambda j: after[j] - after[j - 1])
                ms = (after[resumed] - killed_at) * 1000
                recovery.append((ms, event.get("kv_from") == "standby"))
                began_at = event["_end"] - event["seconds"]  # the failover's start, wall clock
                phase = {k: event.get(k) for k in PHASE_KEYS if k in event}
                phase["detect_ms"] = (lost - killed_wall) * 1000 if lost is not None else None
                phase["wait_ms"] = (began_at - (lost or killed_wall)) * 1000
                # after the failover's log line: its replay (the engine's rows), then the resend
                phase["resend_ms"] = ms - (event["_end"] - killed_wall) * 1000 - (event["replay_ms"] or 0.0)
                phases.append(phase)
        args = stage_args(1, shards, port, DEFAULT_PRECISION, "json", None)  # the fleet's precision
        fleet.processes[fleet.processes.index(victim)] = spawn(
            victim.name, args, fleet.run_dir, dict(os.environ), 180
        )
        await _rejoined(fleet, f"127.0.0.1:{port}")
    ttft = [(t[1] - t[0]) * 1000 for t in out_at if len(t) > 1]
    gaps = [(t[j] - t[j - 1]) * 1000 for t in out_at for j in range(2, len(t))]
    return {
        "itl_ms": gaps,
        "tokens": tokens,
        "errors": errors,
        "recovery_ms": recovery,
        "phases": phases,
        "ttft_ms": ttft,
        "tok_s": sum(len(t) for t in tokens) / wall,
    }


def _start(shards: Path, base: int, coordinator_args: list[str], fixed_lanes: bool = False) -> Fleet:
    return start_fleet(
        shards,
        2,
        Path(tempfile.mkdtemp(prefix="bench-failover-")),
        stage_ports=[base, base + 1],
        replicas=2,
        coordinator_port=base + 50,
        extra_coordinator_args=coordinator_args,
        fixed_lanes=fixed_lanes,
    )


def _hops_against_lanes(loop, fleets: dict[str, tuple[Fleet, int]], shards: Path, prompts: list[str]) -> dict:
    """Kill rounds on the per-hop fleet and the fixed-lane one, interleaved after a warm-up pair:
    per round the median restore of the failovers that restored a copy and the median recovery;
    ratios per hop over lanes of their medians with 95% intervals, and the failed requests and
    mismatches against each fleet's undisturbed run."""
    reference = {
        name: loop.run_until_complete(_round(fleet, shards, base, prompts, kill=False))["tokens"]
        for name, (fleet, base) in fleets.items()
    }
    samples: dict[str, dict[str, list[float]]] = {
        name: {"restore_ms": [], "recovery_ms": []} for name in fleets
    }
    moved: dict[str, list[int]] = {name: [] for name in fleets}  # stages each failover restored
    failed = mismatches = 0
    for i in range(ROUNDS + 1):
        names = list(fleets) if i % 2 else list(reversed(fleets))
        for name in names:
            fleet, base = fleets[name]
            result = loop.run_until_complete(_round(fleet, shards, base, prompts, kill=True))
            failed += result["errors"]
            mismatches += sum(a != b for a, b in zip(result["tokens"], reference[name], strict=True))
            restores = [p["restore_ms"] for p in result["phases"] if p.get("kv_from") == "standby"]
            if i and restores:
                samples[name]["restore_ms"].append(median(restores))
                samples[name]["recovery_ms"].append(median([ms for ms, _ in result["recovery_ms"]]))
                moved[name] += [len(p.get("moved_stages") or [0, 1]) for p in result["phases"]]
        print(f"hops round {i}: {samples}", flush=True)
    paired = min(len(samples["per_hop"]["restore_ms"]), len(samples["lanes"]["restore_ms"]))
    figures: dict = {
        "samples": samples,
        "rounds_paired": paired,
        "failed_requests": failed,
        "mismatches": mismatches,
    }
    for name in fleets:
        figures[f"{name}_stages_restored_per_failover"] = round(
            sum(moved[name]) / max(1, len(moved[name])), 2
        )
        for key in ("restore_ms", "recovery_ms"):
            figures[f"{name}_{key}_p50"] = round(median(samples[name][key] or [0.0]), 1)
    if paired:
        for key in ("restore_ms", "recovery_ms"):
            ratio, ci = ratio_ci(samples["per_hop"][key][:paired], samples["lanes"][key][:paired])
            figures[f"per_hop_over_lanes_{key.removesuffix('_ms')}"] = round(ratio, 3)
            figures[f"per_hop_over_lanes_{key.removesuffix('_ms')}_ci"] = [round(x, 3) for x in ci]
    return figures


def _measure(loop, fleet: Fleet, shards: Path, base: int, prompts_for, points: list[tuple[int, int]]):
    """Per (users, context) point an undisturbed round, then ROUNDS killed ones. Returns the
    points' recovery figures, failed requests and mismatching streams."""
    failed, mismatches, figures = 0, 0, {}
    for users, context in points:
        prompts = [prompts_for(u, context) for u in range(users)]
        reference = loop.run_until_complete(_round(fleet, shards, base, prompts, kill=False))
        failed += reference["errors"]
        recovery: list[tuple[float, bool]] = []  # (ms, restored from a standby copy)
        phases: list[dict] = []
        for _ in range(ROUNDS):
            disturbed = loop.run_until_complete(_round(fleet, shards, base, prompts, kill=True))
            failed += disturbed["errors"]
            pairs = zip(disturbed["tokens"], reference["tokens"], strict=True)
            mismatches += sum(a != b for a, b in pairs)
            recovery += disturbed["recovery_ms"]
            phases += disturbed["phases"]
        name = f"{users}users_{context}"
        figures[name] = _percentiles([ms for ms, _ in recovery]) | {
            "restore": _percentiles([ms for ms, restored in recovery if restored]),
            "replay": _percentiles([ms for ms, restored in recovery if not restored]),
            "undisturbed_ttft_ms_p50": _percentiles(reference["ttft_ms"])["p50"],
            "undisturbed_itl_ms_p50": _percentiles(reference["itl_ms"])["p50"],
            "phase_ms_p50": {
                key: round(median([p[key] for p in phases if p.get(key) is not None] or [0.0]), 1)
                for key in PHASE_KEYS[1:]
            },
            "kv_from": sorted(str(p["kv_from"]) for p in phases),
        }
        print(f"{name} base {base}: {figures[name]}", flush=True)
    return figures, failed, mismatches


def _capture_cost(loop, on: Fleet, off: Fleet, shards: Path, prompts: list[str]) -> dict:
    """Undisturbed rounds on the fleet with standby copies and the one without, interleaved (one
    warm-up pair first): ratios on/off of the medians of tokens per second and of TTFT."""
    samples: dict[str, dict[str, list[float]]] = {
        "on": {"tok_s": [], "ttft": []},
        "off": {"tok_s": [], "ttft": []},
    }
    for i in range(COST_ROUNDS + 1):
        order = [("on", on), ("off", off)] if i % 2 else [("off", off), ("on", on)]
        for name, fleet in order:
            result = loop.run_until_complete(_round(fleet, shards, 0, prompts, kill=False))
            if i:
                samples[name]["tok_s"].append(result["tok_s"])
                samples[name]["ttft"].append(median(result["ttft_ms"]))
        print(f"cost round {i}: {samples}", flush=True)
    tok_s, tok_s_ci = ratio_ci(samples["on"]["tok_s"], samples["off"]["tok_s"])
    ttft, ttft_ci = ratio_ci(samples["on"]["ttft"], samples["off"]["ttft"])
    return {
        "samples": samples,
        "standby_tok_s_ratio": round(tok_s, 3),
        "standby_tok_s_ratio_ci": [round(x, 3) for x in tok_s_ci],
        "standby_ttft_ratio": round(ttft, 3),
        "standby_ttft_ratio_ci": [round(x, 3) for x in ttft_ci],
    }


def main() -> int:
    set_offline_defaults()
    shards = paths.shards_dir() / paths.export_name(paths.DEFAULT_MODEL, 2, "int4")
    if not (shards / "manifest.json").exists():
        from pipeshard.exporter.export import export_model

        export_model(paths.default_model_dir(), shards, stages=2, weights="int4")
    tokenizer = Prompter.from_dir(shards).tokenizer
    grid = POINTS or [(users, context) for context in CONTEXTS for users in USERS]
    prompts_for = lambda u, c: _prompt(tokenizer, u, c)  # noqa: E731
    loop = asyncio.new_event_loop()
    on = _start(shards, PORT_BASE, [])
    cost, replay, failed_off, mismatches_off = {}, {"8users_1024": {"replay": {"p95": None}}}, 0, 0
    hops: dict = {}
    points: dict = {}
    failed = mismatches = 0
    try:
        if PART in ("", "hops"):
            lanes = _start(shards, PORT_BASE + 4, [], fixed_lanes=True)
            try:
                users, context = HOPS_POINT
                fleets = {"per_hop": (on, PORT_BASE), "lanes": (lanes, PORT_BASE + 4)}
                hops = _hops_against_lanes(
                    loop, fleets, shards, [prompts_for(u, context) for u in range(users)]
                )
            finally:
                lanes.stop()
        if PART == "hops":
            write_result("failover_hops", hops, command=command_with_knobs("bench-failover", KNOBS))
            return 0
        if not DEFAULT_ONLY:
            off = _start(shards, PORT_BASE + 2, ["--standby-kv-bytes", "0"])
            try:
                cost = _capture_cost(loop, on, off, shards, [prompts_for(u, 1024) for u in range(8)])
                replay, failed_off, mismatches_off = _measure(
                    loop, off, shards, PORT_BASE + 2, prompts_for, [(8, 1024)]
                )
            finally:
                off.stop()
        points, failed, mismatches = _measure(loop, on, shards, PORT_BASE, prompts_for, grid)
    finally:
        on.stop()
        loop.close()
    result: dict = {"tokens": TOKENS, "rounds": ROUNDS, "stages": 2, "replicas": 2, "weights": "int4"}
    result["recovery_ms"] = points
    result["recovery_ms_without_standby"] = replay
    result["recovery_ms_p95_1024"] = points["8users_1024"]["p95"]
    result["recovery_ms_p95_1024_replay"] = replay["8users_1024"]["replay"]["p95"]
    result["recovery_ms_p95_1024_restore"] = points["8users_1024"]["restore"]["p95"]
    result["standby_cost"] = cost
    result["per_hop"] = hops
    result["failed_requests"] = failed + failed_off + hops.get("failed_requests", 0)
    result["mismatches"] = mismatches + mismatches_off + hops.get("mismatches", 0)
    write_result("failover", result, command=command_with_knobs("bench-failover", KNOBS))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
