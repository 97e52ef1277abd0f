"""`make bench-pipeline`: the distributed pipeline against the in-process chain, raw TCP and the monolith.

Configurations (128 new tokens, eos ignored, one chat-templated prompt, greedy, default precision):
  A   openvino_genai.LLMPipeline on the optimum-intel INT4 export (the unsplit reference)
  C2  our 2-stage INT4 shards chained in this process
  D2  the same shards as 2 stage processes on loopback, driven over the gRPC ring from this process
  D3  3 stage processes, likewise
  R2  D2's processes relaying the same steps over raw TCP (20-byte header + raw tensor, TCP_NODELAY)
  G2  D2 end to end: client -> coordinator process -> ring (reported, not a goal)
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import time
from pathlib import Path

import grpc
import numpy as np

from bench.reference import GenAIPipeline, optimum_export
from bench.stats import interleaved_generations, median, ratio_ci, summary, write_result
from pipeshard import paths
from pipeshard.clients.client import PipeshardClient
from pipeshard.offline import set_offline_defaults
from pipeshard.ownership import owner_metadata
from pipeshard.services.coordinator.fleet_kv import AUTO, FleetKv
from pipeshard.services.coordinator.remote_stages import RemoteStages
from pipeshard.services.coordinator.ring import Ring
from pipeshard.services.launcher import Fleet, spawn, start_fleet
from pipeshard.services.stage.rawtcp import RAW_TCP_SECRET, RawTcpRing
from pipeshard.services.stage.wire import token_frame
from pipeshard.shard.chain import LocalChain
from pipeshard.shard.prompting import Prompter
from pipeshard.tensor_codec import decode, encode
from pipeshard.v1 import stage_pb2, stage_pb2_grpc

NEW_TOKENS = 128
RAW_METADATA = owner_metadata(RAW_TCP_SECRET)
PROMPT = "Explain in a few paragraphs how a bicycle works."
RUNS = int(os.environ.get("BENCH_RUNS", "10"))
WARMUP = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_export(stages: int) -> Path:
    from pipeshard.exporter.export import export_model

    out = paths.shards_dir() / paths.export_name(paths.DEFAULT_MODEL, stages, "int4")
    if not (out / "manifest.json").exists():
        export_model(paths.default_model_dir(), out, stages=stages, weights="int4")
    return out


def start_raw_fleet(shards: Path, run_dir: Path) -> tuple[Fleet, list[tuple[str, int]]]:
    """Two stage processes serving both gRPC and the raw-TCP baseline."""
    run_dir.mkdir(parents=True, exist_ok=True)
    raw_ports = [_free_port(), _free_port()]
    fleet = Fleet(run_dir)
    env = dict(os.environ)
    s1 = spawn(
        "stage1",
        [
            "stage",
            "--stage",
            "1",
            "--shards",
            str(shards),
            "--port",
            "0",
            "--kv",
            "stateful",  # the raw-TCP baseline drives the stateful backend
            "--raw-tcp-port",
            str(raw_ports[1]),
            "--lease-grace-s",
            "3600",  # the raw driver holds no Results subscription (lease)
        ],
        run_dir,
        env,
        180,
    )
    s0 = spawn(
        "stage0",
        [
            "stage",
            "--stage",
            "0",
            "--shards",
            str(shards),
            "--port",
            "0",
            "--next-hop",
            s1.address,
            "--kv",
            "stateful",
            "--raw-tcp-port",
            str(raw_ports[0]),
            "--raw-tcp-next-hop",
            f"127.0.0.1:{raw_ports[1]}",
            "--lease-grace-s",
            "3600",
        ],
        run_dir,
        env,
        180,
    )
    fleet.processes = [s0, s1]
    return fleet, [("127.0.0.1", p) for p in raw_ports]


class RingDriver:
    """Runs greedy decodes over a gRPC ring from this process, on one private event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, addresses: list[str]):
        self.loop = loop
        self.ring = loop.run_until_complete(self._start(addresses))
        self.step_records: list[tuple[float, list[int]]] = []

    @staticmethod
    async def _start(addresses: list[str]) -> Ring:
        stages = RemoteStages(addresses, step_timeout_s=60)  # grpc.aio objects bind to the running loop
        await stages.start()
        await stages.wait_ready(60)
        return Ring(stages, FleetKv.agreed(AUTO, await stages.stage_infos()))

    def decode(self, ids: list[int], record: bool = False) -> dict:
        return self.loop.run_until_complete(self._decode(ids, record))

    async def _decode(self, ids: list[int], record: bool) -> dict:
        session = f"bench-{time.monotonic_ns()}"
        await self.ring.open_session(session)
        t0 = time.perf_counter()
        result = await self.ring.step(token_frame(session, 0, ids, 0, True))
        t_first = time.perf_counter()
        tokens = [int(result.top1.token_ids[-1])]
        position = len(ids)
        for step in range(1, NEW_TOKENS):
            ts = time.perf_counter()
            result = await self.ring.step(token_frame(session, step, [tokens[-1]], position, True))
            if record:
                self.step_records.append((time.perf_counter() - ts, list(result.stage_compute_micros)))
            position += 1
            tokens.append(int(result.top1.token_ids[-1]))
        t_end = time.perf_counter()
        await self.ring.release_session(session)
        return {
            "tokens": tokens,
            "ttft_ms": (t_first - t0) * 1000,
            "tok_s": (NEW_TOKENS - 1) / (t_end - t_first),
        }

    def close(self) -> None:
        self.loop.run_until_complete(self.ring.close())


class RawDriver:
    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        first: tuple[str, int],
        last: tuple[str, int],
        addresses: list[str],
    ):
        self.loop = loop
        self.raw = RawTcpRing(first, last)
        self.loop.run_until_complete(self.raw.connect())
        self._stubs = [stage_pb2_grpc.StageServiceStub(grpc.insecure_channel(a)) for a in addresses]
        self._n = 0

    def decode(self, ids: list[int]) -> dict:
        self._n += 1
        handle = 1_000_000 + self._n
        for stub in self._stubs:
            stub.OpenSession(
                stage_pb2.OpenSessionRequest(session_id=str(handle)), timeout=10, metadata=RAW_METADATA
            )
        out = self.loop.run_until_complete(self._decode(handle, ids))
        for stub in self._stubs:
            stub.ReleaseSession(
                stage_pb2.ReleaseSessionRequest(session_id=str(handle)), timeout=10, metadata=RAW_METADATA
            )
        return out

    async def _decode(self, handle: int, ids: list[int]) -> dict:
        t0 = time.perf_counter()
        tokens = [await self.raw.step(handle, 0, 0, ids)]
        t_first = time.perf_counter()
        position = len(ids)
        for step in range(1, NEW_TOKENS):
            tokens.append(await self.raw.step(handle, step, position, [tokens[-1]]))
            position += 1
        t_end = time.perf_counter()
        return {
            "tokens": tokens,
            "ttft_ms": (t_first - t0) * 1000,
            "tok_s": (NEW_TOKENS - 1) / (t_end - t_first),
        }


def local_decode(chain: LocalChain, ids: list[int]) -> dict:
    out = chain.generate_greedy(ids, NEW_TOKENS, ignore_eos=True)
    return {"tokens": out.token_ids, "ttft_ms": out.ttft_s * 1000, "tok_s": out.tok_s}


def rss_mb(pid: int) -> dict[str, float]:
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line
    )
    return {k: int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "VmHWM")}


def serialization_us(hidden: int) -> dict[str, float]:
    x = np.random.default_rng(0).standard_normal((1, 1, hidden)).astype(np.float32)
    n = 2000
    t = time.perf_counter()
    for _ in range(n):
        wire = encode(x).SerializeToString()
    enc = (time.perf_counter() - t) / n * 1e6
    from pipeshard.v1 import tensor_pb2

    t = time.perf_counter()
    for _ in range(n):
        decode(tensor_pb2.Tensor.FromString(wire))
    dec = (time.perf_counter() - t) / n * 1e6
    return {"encode_us": enc, "decode_us": dec}


def release_latency_ms(coordinator: str, stages: list[str]) -> float:
    stubs = [stage_pb2_grpc.StageServiceStub(grpc.insecure_channel(a)) for a in stages]
    with PipeshardClient(coordinator) as client:
        call = client.responses("Write a long essay about rivers.", max_tokens=300, ignore_eos=True)
        next(call)
        next(call)
        t0 = time.perf_counter()
        call.cancel()
    while any(s.GetStageInfo(stage_pb2.GetStageInfoRequest(), timeout=5).live_sessions for s in stubs):
        time.sleep(0.002)
    return (time.perf_counter() - t0) * 1000


def main() -> int:
    set_offline_defaults()
    run_dir = Path("run/bench-pipeline")
    model_dir = paths.default_model_dir()
    shards2, shards3 = ensure_export(2), ensure_export(3)
    reference = optimum_export(model_dir, paths.shards_dir() / "optimum-int4-reference")
    prompter = Prompter.from_dir(shards2)
    ids = prompter.encode("", [("user", PROMPT)])

    genai = GenAIPipeline(reference)
    chain = LocalChain(shards2)
    fleet2, raw_addresses = start_raw_fleet(shards2, run_dir / "d2")
    fleet3 = start_fleet(shards3, 3, run_dir / "d3")
    coordinator = spawn(
        "coordinator",
        ["coordinator", "--stages", ",".join(fleet2.stages), "--shards", str(shards2), "--port", "0"],
        run_dir / "d2",
        dict(os.environ),
        120,
    )
    fleet2.processes.append(coordinator)
    loop = asyncio.new_event_loop()
    d2, d3 = RingDriver(loop, fleet2.stages), RingDriver(loop, fleet3.stages)
    r2 = RawDriver(loop, raw_addresses[0], raw_addresses[1], fleet2.stages)
    client = PipeshardClient(fleet2.coordinator)

    def g2() -> dict:
        res = client.generate(PROMPT, max_tokens=NEW_TOKENS, ignore_eos=True)
        return {"tokens": res.token_ids, "ttft_ms": res.ttft_ms, "tok_s": res.tok_s}

    runners = {
        "A": lambda: genai.run(ids, NEW_TOKENS),
        "C2": lambda: local_decode(chain, ids),
        "D2": lambda: d2.decode(ids, record=True),
        "D3": lambda: d3.decode(ids),
        "R2": lambda: r2.decode(ids),
        "G2": g2,
    }
    try:
        samples, last = interleaved_generations(runners, RUNS, WARMUP)
        same = {n: last[n]["tokens"] == last["C2"]["tokens"] for n in ("D2", "D3", "R2", "G2")}
        d2_c2, d2_c2_ci = ratio_ci(samples["D2"], samples["C2"])
        d2_r2, d2_r2_ci = ratio_ci(samples["D2"], samples["R2"])
        records = d2.step_records[-(RUNS * (NEW_TOKENS - 1)) :]
        walls = np.array([w for w, _ in records]) * 1000
        computes = np.array([sum(c) for _, c in records]) / 1000
        per_stage = np.array([c for _, c in records]) / 1000
        transfers = 3  # coordinator -> stage 0 -> stage 1 -> coordinator
        hop = (walls - computes) / transfers
        ser = serialization_us(576)
        ttft = {}
        for n_tokens in (8, 128, 1024):
            text = " ".join(["word"] * n_tokens)
            prompt_ids = prompter.encode(text, [])[:n_tokens]
            ttft[str(n_tokens)] = {
                "A": median([genai.run(prompt_ids, 1)["ttft_ms"] for _ in range(3)]),
                "C2": median([chain.generate_greedy(prompt_ids, 1).ttft_s * 1000 for _ in range(3)]),
                "D2": median([d2.decode(prompt_ids)["ttft_ms"] for _ in range(1)]),
            }
        result = {
            "runs": RUNS,
            "baseline": "C2 (in-process 2-stage chain) for D2_over_C2; R2 (raw TCP) for D2_over_R2",
            "tok_s": {n: median(v) for n, v in samples.items()},
            "tok_s_range": {n: summary(v) for n, v in samples.items()},
            "D2_over_C2": d2_c2,
            "D2_over_C2_ci": d2_c2_ci,
            "D2_over_R2": d2_r2,
            "D2_over_R2_ci": d2_r2_ci,
            "D3_over_C2": ratio_ci(samples["D3"], samples["C2"])[0],
            "D2_over_A": ratio_ci(samples["D2"], samples["A"])[0],
            "hop_overhead_p50_ms": float(np.percentile(hop, 50)),
            "hop_overhead_p95_ms": float(np.percentile(hop, 95)),
            "hop_method": "(step wall time - sum of stage compute) / 3 transfers, D2 decode steps",
            "per_token_ms_D2": {
                "wall_p50": float(np.percentile(walls, 50)),
                "stage_compute_p50": [
                    float(np.percentile(per_stage[:, k], 50)) for k in range(per_stage.shape[1])
                ],
                "serialization_us_per_hidden_frame": ser,
                "transport_and_wait_p50": float(np.percentile(walls - computes, 50)),
            },
            "ttft_ms": ttft,
            "tokens_identical_to_C2": same,
            "release_latency_ms": release_latency_ms(fleet2.coordinator, fleet2.stages),
            "rss_mb": {p.name: rss_mb(p.popen.pid) for p in [*fleet2.processes, *fleet3.processes]},
        }
    finally:
        client.close()
        d2.close()
        d3.close()
        fleet2.stop()
        fleet3.stop()
    write_result("pipeline", json.loads(json.dumps(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
