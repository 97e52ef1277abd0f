"""`make soak SOAK_MODE=chaos`: 16 clients for minutes while processes die and links fail.

A 3-stage INT4 loopback fleet with two lanes (replicas) at SOAK_PRECISION (the default precision,
``invariant``; ``exact`` as well), an exporter and
SOAK_COORDINATORS (2) coordinators, a group: each client holds one client of every coordinator's
address, so a stream whose coordinator is killed continues on another (docs/RELIABILITY.md,
"Coordinators in a group"); with SOAK_COORDINATORS=1 a coordinator kill fails the requests in
flight, which are counted apart. Every hop between stages passes through its
own forwarder (``faulty_links``), and the fleet runs with keepalive every 1 s and a 2 s timeout
(``PIPESHARD_KEEPALIVE_S``/``_TIMEOUT_S``), so a link that stalls longer than about 3 s is a dead
hop. Each prompt's greedy answer is first taken undisturbed (its reference). Then SOAK_CLIENTS
(16) clients send requests back to back (a random prompt, 8 to 48 tokens, eos ignored) for
SOAK_SECONDS (600; BENCH_QUICK=1: 120) while every 20-30 s (SOAK_FAULT_EVERY) one fault strikes,
the kinds taken in a shuffled cycle so a short run meets each:

- ``stage``: a random stage replica is killed (SIGKILL) and restarted on its port;
- ``link_stall`` / ``link_drop``: a random link between two stages of a random lane holds every
  byte / resets every connection for 2-6 s, then heals by itself;
- ``exporter``: the exporter is killed and restarted;
- ``coordinator``: a random coordinator is killed and restarted on its port (its streams continue on
  another; with one coordinator, requests in flight fail: expected).

A fault waits until the last one's lane serves again, so one lane always serves. Keys:
``failed_requests`` (not counting those during a coordinator outage: goal 0),
``failed_requests_coordinator`` (those: attempts refused while it was down, each client retrying
every 0.5 s, and ``..._mid_stream`` the ones that had streamed tokens when it died),
``mismatches`` (finished answers against their reference, exact: goal 0), ``recovery_ms`` per
fault kind (stage and link: from the fault to each failed-over stream's first token after its
failover finished; coordinator: from the kill to the next token any client gets with one
coordinator, and with a group from the kill to the first token of each stream's continuation on
another coordinator, split kill -> resent -> resumed -> token; exporter: from the kill to it
listening again), ``link_faults_noticed`` (link faults a coordinator's watch named),
``rss_growth_max`` (largest
growth of a process that lived through the whole soak, from the first fault (after 20-30 s of
full load, so warm-up is not counted) to the end: goal <= 10%; restarted processes are reported
from their restart apart), sessions left on stages.
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
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.failover import _percentiles, _rejoined, _wall
from bench.soak import PROMPTS, _live_sessions, _rss_mib, _shards
from bench.stats import command_with_knobs, write_result
from pipeshard.clients.client import AsyncPipeshardClient, PipeshardClient
from pipeshard.offline import set_offline_defaults
from pipeshard.precision import DEFAULT_PRECISION
from pipeshard.services.launcher import (
    Fleet,
    Process,
    coordinator_args,
    coordinator_name,
    fleet_env,
    link_control,
    link_name,
    spawn,
    stage_args,
    stage_name,
    start_fleet,
)
from pipeshard.services.wan.faults import command
from pipeshard.topology import LANE_SEPARATOR

QUICK = os.environ.get("BENCH_QUICK") == "1"
SECONDS = float(os.environ.get("SOAK_SECONDS", "120" if QUICK else "600"))
CLIENTS = int(os.environ.get("SOAK_CLIENTS", "16"))
FAULT_EVERY = tuple(float(s) for s in os.environ.get("SOAK_FAULT_EVERY", "20,30").split(","))
PORT_BASE = int(os.environ.get("SOAK_PORT_BASE", "52300"))  # replica r of stage k: base + k + 20r
SEED = int(os.environ.get("SOAK_SEED", "51"))
RSS_TOLERANCE = float(os.environ.get("SOAK_RSS_TOLERANCE", "0.10"))
KINDS = tuple(os.environ.get("SOAK_FAULTS", "stage,link_stall,link_drop,exporter,coordinator").split(","))
COORDINATORS = int(os.environ.get("SOAK_COORDINATORS", "2"))
PRECISION = os.environ.get("SOAK_PRECISION", DEFAULT_PRECISION)
STAGES, LANES, MAX_TOKENS = 3, 2, 48
LINK_FAULT_S = (2.0, 6.0)
KNOBS = (
    "SOAK_MODE",
    "BENCH_QUICK",
    "SOAK_SECONDS",
    "SOAK_CLIENTS",
    "SOAK_FAULT_EVERY",
    "SOAK_PORT_BASE",
    "SOAK_SEED",
    "SOAK_FAULTS",
    "SOAK_COORDINATORS",
    "SOAK_PRECISION",
)
COORDINATOR_PORT, EXPORTER_PORT = PORT_BASE + 50, PORT_BASE + 49


def _port(k: int, r: int) -> int:
    return PORT_BASE + k + 20 * r


class _Timed(AsyncPipeshardClient):
    """The group's client, noting when it sends a broken stream on to another coordinator (a
    request with ``resume_token_ids``): where the caller's detection ends."""

    def __init__(self, addresses: list[str], resent: dict[str, float], **kwargs):
        super().__init__(addresses, **kwargs)
        self._resent = resent

    def _call(self, stub, request):
        if request.resume_token_ids:
            self._resent[request.request_id] = time.time()
        return super()._call(stub, request)


class Chaos:
    """The fleet, its faults and what the clients saw."""

    def __init__(self, fleet: Fleet, shards: Path, reference: dict[str, list[int]]):
        self.fleet, self.shards, self.reference = fleet, shards, reference
        self.rng = random.Random(SEED)
        self.outcomes: Counter[str] = Counter()
        self.failures: list[tuple[float, bool]] = []  # (wall time, had streamed tokens)
        self.mismatches: list[dict] = []
        self.streams: dict[str, list[float]] = {}  # request id -> its tokens' wall times
        self.faults: list[dict] = []  # kind, target, at (wall), back (wall)
        self.coordinator_down: list[tuple[float, float]] = []  # (killed, serving again) wall times
        self.rss_restarted: dict[str, float] = {}  # process name -> RSS when it was back
        self.rss_start: dict[str, tuple[int, float]] = {}  # name -> (pid, RSS) at the first fault
        self.resent: dict[str, float] = {}  # request id -> when the client last sent it on (wall)

    async def client(self, stop_at: float) -> None:
        async with _Timed(self.fleet.coordinators, self.resent, timeout_s=300) as client:
            while time.time() < stop_at:
                await self._request(client)

    async def _request(self, client: AsyncPipeshardClient) -> None:
        prompt, max_tokens = self.rng.choice(PROMPTS), self.rng.randint(8, MAX_TOKENS)
        request_id = uuid.uuid4().hex
        self.streams[request_id] = out_at = []
        tokens: list[int] = []
        try:
            async for response in client.responses(
                prompt, max_tokens=max_tokens, ignore_eos=True, request_id=request_id
            ):
                if response.HasField("chunk"):
                    tokens.extend(response.chunk.token_ids)
                    out_at.append(time.time())
        except grpc.aio.AioRpcError as exc:  # counted: the goal is none outside a coordinator outage
            self.outcomes[exc.code().name] += 1
            self.failures.append((time.time(), bool(tokens)))
            await asyncio.sleep(0.5)
            return
        self.outcomes["ok"] += 1
        if tokens != self.reference[prompt][:max_tokens]:
            self.mismatches.append({"prompt": prompt, "max_tokens": max_tokens, "got": tokens})

    async def faulter(self, stop_at: float) -> None:
        cycle: list[str] = []
        while time.time() + FAULT_EVERY[0] < stop_at:
            await asyncio.sleep(self.rng.uniform(*FAULT_EVERY))
            if not cycle:
                cycle = list(KINDS)
                self.rng.shuffle(cycle)
            kind = cycle.pop()
            if not self.faults:  # after the first 20-30 s of full load: warm caches and KV pools
                self.rss_start = _rss(self.fleet)
            fault = {"kind": kind, "at": time.time()}
            self.faults.append(fault)
            await getattr(self, f"_{kind}")(fault)
            fault["back"] = time.time()

    def _replace(self, old: Process, new: Process) -> None:
        self.fleet.processes[self.fleet.processes.index(old)] = new

    async def _kill(self, name: str) -> Process:
        victim = self.fleet.process(name)
        victim.popen.send_signal(signal.SIGKILL)
        await asyncio.to_thread(victim.popen.wait)
        return victim

    async def _stage(self, fault: dict) -> None:
        k, r = self.rng.randrange(STAGES), self.rng.randrange(LANES)
        name = fault["target"] = stage_name(k, r)
        victim = await self._kill(name)
        next_hop = self.fleet.process(link_name(k, r)).address if k < STAGES - 1 else None
        args = stage_args(k, self.shards, _port(k, r), PRECISION, "json", next_hop)
        proc = await asyncio.to_thread(spawn, name, args, self.fleet.run_dir, fleet_env(), 300)
        self._replace(victim, proc)
        await _rejoined(self.fleet, f"127.0.0.1:{_port(k, r)}", 300)
        self.rss_restarted[name] = _rss_mib(proc.popen.pid)

    async def _link(self, fault: dict, verb: str) -> None:
        k, r = self.rng.randrange(STAGES - 1), self.rng.randrange(LANES)
        seconds = round(self.rng.uniform(*LINK_FAULT_S), 1)
        fault.update(target=link_name(k, r), seconds=seconds)
        await asyncio.to_thread(command, link_control(self.fleet.run_dir, k, r), f"{verb} {seconds}")
        await asyncio.sleep(seconds)
        await _rejoined(self.fleet, f"127.0.0.1:{_port(k + 1, r)}", 300, unnamed_is_up=True)

    async def _link_stall(self, fault: dict) -> None:
        await self._link(fault, "stall")

    async def _link_drop(self, fault: dict) -> None:
        await self._link(fault, "reset")

    async def _exporter(self, fault: dict) -> None:
        fault["target"] = "exporter"
        victim = await self._kill("exporter")
        args = ["exporter-service", "--shards-dir", str(self.shards.parent), "--port", str(EXPORTER_PORT)]
        proc = await asyncio.to_thread(
            spawn, "exporter", [*args, "--log-format", "json"], self.fleet.run_dir, fleet_env(), 120
        )
        self._replace(victim, proc)
        fault["recovery_ms"] = round((time.time() - fault["at"]) * 1000, 1)
        self.rss_restarted["exporter"] = _rss_mib(proc.popen.pid)

    async def _coordinator(self, fault: dict) -> None:
        c = self.rng.randrange(COORDINATORS)
        name = fault["target"] = coordinator_name(c)
        victim = await self._kill(name)
        # The old log is kept (its failovers count): the new process's spawn truncates the name.
        victim.log.rename(victim.log.with_suffix(f".{len(self.faults)}.log"))
        lanes = self.fleet.lanes
        stages = [LANE_SEPARATOR.join(lane[k] for lane in lanes) for k in range(STAGES)]
        args = coordinator_args(stages, self.shards, COORDINATOR_PORT + c, "json")
        proc = await asyncio.to_thread(spawn, name, args, self.fleet.run_dir, fleet_env(), 300)
        self._replace(victim, proc)
        await _serving(proc.address)
        self.coordinator_down.append((fault["at"], time.time()))
        self.rss_restarted[name] = _rss_mib(proc.popen.pid)


async def _serving(address: str, timeout_s: float = 300) -> None:
    """Waits until ``address`` reports SERVING on grpc.health.v1 (the coordinator: every stage reachable)."""
    deadline = time.monotonic() + timeout_s
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                answer = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
                if answer.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{address} did not serve within {timeout_s:g} s")


def _failovers(run_dir: Path, event_name: str = "session_failed_over") -> dict[str, float]:
    """Request id -> when its (last) ``event_name`` was logged (wall), over every coordinator's log:
    a failover finished, or (generation_resumed) a stream taken over from a killed coordinator."""
    ends = {}
    for log in sorted(run_dir.glob("coordinator*.log")):
        for line in log.read_text().splitlines():
            if f'"{event_name}"' in line:
                event = json.loads(line)
                ends[event.get("request_id", "")] = _wall(event["timestamp"])
    return ends


def _recovery(chaos: Chaos) -> dict[str, dict]:
    """Per fault kind, the recovery samples' p50/p95 (ms) and the faults' count (module doc). A
    group's coordinator recovery is also split where it goes: ``kill_to_resent`` (the caller sees
    the stream break and sends it on), ``resent_to_resumed`` (the survivor takes the call and
    tokenizes it: it logs ``generation_resumed``) and ``resumed_to_token`` (it admits it, opens its
    sessions, prefills prompt + tokens so far and steps to its next token)."""
    samples: dict[str, list[float]] = {kind: [] for kind in KINDS}
    split: dict[str, list[float]] = {"kill_to_resent": [], "resent_to_resumed": [], "resumed_to_token": []}
    failovers = _failovers(chaos.fleet.run_dir)
    resumed = _failovers(chaos.fleet.run_dir, "generation_resumed")
    for i, fault in enumerate(chaos.faults):
        at = fault["at"]
        until = chaos.faults[i + 1]["at"] if i + 1 < len(chaos.faults) else float("inf")
        if fault["kind"] == "exporter":
            samples["exporter"].append(fault["recovery_ms"])
        elif fault["kind"] == "coordinator" and COORDINATORS == 1:
            nxt = min((t for out in chaos.streams.values() for t in out if t > at), default=None)
            if nxt is not None:
                samples["coordinator"].append((nxt - at) * 1000)
        elif fault["kind"] == "coordinator":  # each resumed stream: the kill to its next token
            for request_id, when in resumed.items():
                out_at = chaos.streams.get(request_id, [])
                # the continuation's first token: one read after the kill may still be the dead
                # coordinator's, sent before it died and read late by a busy client
                nxt = min((t for t in out_at if t > when), default=None)
                if at <= when < until and nxt is not None and any(t < at for t in out_at):
                    samples["coordinator"].append((nxt - at) * 1000)
                    resent = chaos.resent.get(request_id, when)
                    split["kill_to_resent"].append((resent - at) * 1000)
                    split["resent_to_resumed"].append((when - resent) * 1000)
                    split["resumed_to_token"].append((nxt - when) * 1000)
        else:
            for request_id, end in failovers.items():
                out_at = chaos.streams.get(request_id, [])
                if not at <= end < until or not any(t < at for t in out_at):
                    continue
                # its first token once the failover finished: the stream's longest stall anywhere
                # after the fault (the measure before) also counted later stalls of a loaded
                # machine (a 1.1 s gap 8.6 s after a link drop whose failover took 1.1 s)
                nxt = min((t for t in out_at if t > end), default=None)
                if nxt is not None:
                    samples[fault["kind"]].append((nxt - at) * 1000)
    counts = Counter(f["kind"] for f in chaos.faults)
    out = {kind: _percentiles(values) | {"faults": counts[kind]} for kind, values in samples.items()}
    if "coordinator" in out and COORDINATORS > 1:
        out["coordinator"]["split"] = {part: _percentiles(values) for part, values in split.items()}
    return out


def _links_noticed(chaos: Chaos) -> dict[str, list[int]]:
    """Per link fault kind, [noticed, struck]: the faults some coordinator's watch named (a hop's
    next stage unreachable from it, ``stage_reachability``) between the fault and 5 s after it
    healed. A stall shorter than keepalive's bound (about 3 s) may pass unnoticed, by design."""
    downs = []
    for log in sorted(chaos.fleet.run_dir.glob("coordinator*.log")):
        for line in log.read_text().splitlines():
            if '"stage_reachability"' in line and "next hop" in line:
                event = json.loads(line)
                if not event["up"]:
                    downs.append(_wall(event["timestamp"]))
    out: dict[str, list[int]] = {}
    for fault in chaos.faults:
        if fault["kind"].startswith("link"):
            end = fault["at"] + fault["seconds"] + 5
            counts = out.setdefault(fault["kind"], [0, 0])
            counts[0] += any(fault["at"] <= t <= end for t in downs)
            counts[1] += 1
    return out


def _iso(wall: float) -> str:
    return datetime.fromtimestamp(wall, UTC).isoformat(timespec="milliseconds")


def _rss(fleet: Fleet) -> dict[str, tuple[int, float]]:
    """Every product process's (pid, RSS MiB); the link forwarders are the emulation's, not counted."""
    product = [p for p in fleet.processes if not p.name.startswith("link")]
    return {p.name: (p.popen.pid, _rss_mib(p.popen.pid)) for p in product}


async def _run(fleet: Fleet, shards: Path, reference: dict[str, list[int]]) -> tuple[Chaos, float]:
    chaos = Chaos(fleet, shards, reference)
    started = time.time()
    stop_at = started + SECONDS
    faulter = asyncio.create_task(chaos.faulter(stop_at))
    await asyncio.gather(*(chaos.client(stop_at) for _ in range(CLIENTS)))
    await faulter  # a fault still healing finishes, so the fleet ends whole
    return chaos, time.time() - started


def main() -> int:
    set_offline_defaults()
    os.environ.setdefault("PIPESHARD_KEEPALIVE_S", "1")
    os.environ.setdefault("PIPESHARD_KEEPALIVE_TIMEOUT_S", "2")
    shards = _shards(STAGES)
    fleet = start_fleet(
        shards,
        STAGES,
        Path(tempfile.mkdtemp(prefix="pipeshard-soak-chaos-")),
        stage_ports=[_port(k, 0) for k in range(STAGES)],
        replicas=LANES,
        coordinator_port=COORDINATOR_PORT,
        exporter_port=EXPORTER_PORT,
        faulty_links=True,
        timeout_s=300,
        precision=PRECISION,
        coordinators=COORDINATORS,
    )
    try:
        with PipeshardClient(fleet.coordinator, timeout_s=300) as client:
            reference = {
                p: client.generate(p, max_tokens=MAX_TOKENS, ignore_eos=True).token_ids for p in PROMPTS
            }
        load_before = round(os.getloadavg()[0], 1)
        chaos, seconds = asyncio.run(_run(fleet, shards, reference))
        time.sleep(8)  # past the stages' lease grace: sessions of a killed coordinator are freed
        after = _rss(fleet)
        sessions = {p.name: _live_sessions(p.address) for p in fleet.processes if p.name.startswith("stage")}
    finally:
        fleet.stop()
    raw = {
        "faults": chaos.faults,
        "streams": chaos.streams,
        "failures": chaos.failures,
        "resent": chaos.resent,
    }
    (fleet.run_dir / "soak_chaos_raw.json").write_text(json.dumps(raw))  # kept if the analysis fails
    # With one coordinator its outages fail requests by construction; a group's must not.
    outage = [(a, b + 2.0) for a, b in chaos.coordinator_down] if COORDINATORS == 1 else []  # back off 0.5 s
    during = [streamed for t, streamed in chaos.failures if any(a <= t <= b for a, b in outage)]
    before = chaos.rss_start
    lived = {n: (b, after[n][1]) for n, (pid, b) in before.items() if n in after and after[n][0] == pid}
    growth = {n: round((end - start) / start, 4) for n, (start, end) in lived.items()}
    rss_mib = {n: [round(start, 1), round(end, 1)] for n, (start, end) in lived.items()}
    restarted = {
        n: {"rss_back_mib": round(rss, 1), "rss_end_mib": round(after[n][1], 1)}
        for n, rss in chaos.rss_restarted.items()
        if n in after
    }
    result = {
        "seconds": round(seconds, 1),
        "load_before_after": [load_before, round(os.getloadavg()[0], 1)],
        "clients": CLIENTS,
        "fleet": f"{STAGES} stages x {LANES} replicas, {COORDINATORS} coordinators, 1 exporter, INT4",
        "precision": PRECISION,
        "keepalive_s": [os.environ["PIPESHARD_KEEPALIVE_S"], os.environ["PIPESHARD_KEEPALIVE_TIMEOUT_S"]],
        "outcomes": dict(chaos.outcomes),
        "failed_requests": len(chaos.failures) - len(during),
        "failed_requests_coordinator": len(during),
        "failed_requests_coordinator_mid_stream": sum(during),
        "mismatches": len(chaos.mismatches),
        "mismatch_examples": chaos.mismatches[:3],
        "faults": [
            {k: v for k, v in f.items() if k in ("kind", "target", "seconds")} | {"at": _iso(f["at"])}
            for f in chaos.faults
        ],
        "failovers": len(_failovers(fleet.run_dir)),
        "resumed_on_another_coordinator": len(_failovers(fleet.run_dir, "generation_resumed")),
        "recovery_ms": _recovery(chaos),
        "link_faults_noticed": _links_noticed(chaos),
        "rss_growth": growth,
        "rss_mib_start_end": rss_mib,
        "rss_growth_max": max(growth.values(), default=None),
        "rss_restarted": restarted,
        "sessions_left": sessions,
        "seed": SEED,
    }
    write_result("soak_chaos", result, command=command_with_knobs("soak", KNOBS))
    ok = not result["failed_requests"] and not result["mismatches"] and not any(sessions.values())
    return 0 if ok and (result["rss_growth_max"] or 0) <= RSS_TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
