"""`make soak SOAK_MODE=hostile`: the hostile-input attack mix against a live fleet while normal
users are served, and every process's memory at the end held against its start.

A 2-stage INT4 loopback fleet with the OpenAI gateway (real processes). SOAK_ROUNDS rounds
(default 6); in each, 4 normal clients send greedy requests (each answer must equal its solo run)
while one attacker runs the whole mix once: quantum-codec bombs and garbage frames for sessions it
does not hold (Forward to stage 1), a malformed draft tree, a restore stream of 100,000 parts,
capture chunks of 1 byte, 10,000-character session ids, 40 sessions of one owner, 20 Results
subscriptions, a 100,000-entry stop list and random fields in Generate, random JSON bodies and 6
never-read streams through the gateway. Checked, and the run fails (exit 1) otherwise:
  * every normal request is answered and equals its solo run;
  * no attack is answered INTERNAL or UNKNOWN (or 5xx by the gateway);
  * no session is left on any stage afterwards;
  * each process's resident memory (VmRSS) at the end is at most SOAK_RSS_TOLERANCE (10%) above
    its start, and so is its anonymous part (heap and other anonymous mappings): a host short of
    memory drops file-backed pages (weights, libraries), which lowers RSS (a fall is reported,
    not failed: it is the host's doing, and the per-round regions show which pages went) and
    would hide anonymous growth. The start is taken after the first round, so one-time
    allocations of every path the mix reaches (allocator arenas, compiled kernels, grammar
    caches) count as the start.
Figures go to bench/results/soak_hostile.json.
"""

from __future__ import annotations

import json
import os
import random
import socket
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx2 as httpx
import numpy as np
import zstandard

from bench.soak import PROMPTS, _free_port, _live_sessions, _rss_mib, _shards
from bench.stats import write_result
from pipeshard.clients.client import PipeshardClient
from pipeshard.offline import set_offline_defaults
from pipeshard.ownership import owner_key, owner_metadata
from pipeshard.services.launcher import start_fleet
from pipeshard.services.stage.wire import token_frame
from pipeshard.tensor_codec import Codec, Dtype
from pipeshard.v1 import coordinator_pb2, coordinator_pb2_grpc, stage_pb2, stage_pb2_grpc, tensor_pb2

ROUNDS = int(os.environ.get("SOAK_ROUNDS", "6"))
TOLERANCE = float(os.environ.get("SOAK_RSS_TOLERANCE", "0.10"))
SEED = int(os.environ.get("SOAK_SEED", "53"))
SETTLE_S = float(os.environ.get("SOAK_SETTLE_S", "2"))
USERS = 4
REQUESTS_PER_USER = 4
MAX_TOKENS = 16
HIDDEN = 576  # SmolLM2-135M
FORBIDDEN = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}


class Attacker:
    """One hostile party: its own owner secret on stage 1, and the fleet's public doors."""

    def __init__(self, fleet, rng: random.Random):
        self.fleet, self.rng = fleet, rng
        secret = "soak-attacker-secret-" + "x" * 16
        self.metadata, self.owner = owner_metadata(secret), owner_key(secret)
        self.stage = grpc.insecure_channel(
            fleet.stages[1], options=[("grpc.max_send_message_length", 64 << 20)]
        )
        self.stub = stage_pb2_grpc.StageServiceStub(self.stage)
        self.outcomes: Counter[str] = Counter()
        self.step = 0

    def close(self) -> None:
        self.stage.close()

    def _record(self, attack: str, call) -> None:
        try:
            call()
            self.outcomes[f"{attack}:served"] += 1
        except grpc.RpcError as exc:
            code = exc.code()
            self.outcomes[f"{attack}:{code.name}"] += 1
            if code in FORBIDDEN:
                raise AssertionError(f"{attack}: {code.name} {exc.details()}") from None

    def _frame(self, session: str, tokens: int, tensor: tensor_pb2.Tensor):
        frame = token_frame(session, self.step, [0] * tokens, 0, True)
        self.step += 1
        frame.owner = self.owner
        del frame.tensors[:]
        frame.tensors.append(tensor_pb2.NamedTensor(name="hidden_states", tensor=tensor))
        return stage_pb2.ForwardRequest(frame=frame)

    def forward_bombs(self) -> None:
        """Bombs and garbage on one Forward stream; every frame must come back as a named error."""
        self.stub.OpenSession(
            stage_pb2.OpenSessionRequest(session_id="mine", capacity=64), metadata=self.metadata
        )
        values = 29127 * HIDDEN  # 64 MiB of floats declared for a 4-position frame
        exponents = zstandard.ZstdCompressor().compress(bytes([113]) * values)
        head = np.asarray([-14 + 128, 0, len(exponents)], dtype="<u4").tobytes()
        bomb = tensor_pb2.Tensor(
            dtype=Dtype.DTYPE_FP32,
            shape=[1, 29127, HIDDEN],
            data=head + exponents + bytes((values + 7) // 8),
            codec=Codec.CODEC_QUANTUM_ZSTD,
            raw_size=values * 4,
        )
        garbage = tensor_pb2.Tensor(
            dtype=Dtype.DTYPE_FP32, shape=[1, 4, HIDDEN], data=b"junk", codec=Codec.CODEC_QUANTUM_ZSTD
        )
        tree = self._frame("mine", 4, garbage)
        tree.frame.plan.rows[0].tree_parents[:] = [-1, 7, 0, 1]
        frames = [self._frame("mine", 4, bomb), self._frame("not-mine", 4, garbage), tree]
        errors = 0
        for response in self.stub.Forward(iter(frames), metadata=self.metadata, timeout=60):
            if response.HasField("error"):
                errors += 1
                self.outcomes[f"forward:{response.error.code}"] += 1
                if response.error.code in ("INTERNAL", "UNKNOWN"):
                    raise AssertionError(f"forward: {response.error.code} {response.error.message}")
            if errors == len(frames):
                break
        self.stub.ReleaseSession(stage_pb2.ReleaseSessionRequest(session_id="mine"), metadata=self.metadata)

    def stage_floods(self) -> None:
        def parts():
            for i in range(100_000):
                yield stage_pb2.RestoreKvStreamRequest(
                    session_id="flood", snapshot_bytes=1, snapshot_chunk=b"x", next_part=i > 0
                )

        self._record(
            "restore_stream", lambda: self.stub.RestoreKvStream(parts(), metadata=self.metadata, timeout=60)
        )
        capture = stage_pb2.CaptureKvStreamRequest(
            capture=stage_pb2.CaptureKvRequest(session_id="x"), chunk_bytes=1
        )
        self._record(
            "capture_chunks",
            lambda: list(self.stub.CaptureKvStream(capture, metadata=self.metadata, timeout=30)),
        )
        long_id = stage_pb2.OpenSessionRequest(session_id="s" * 10_000)
        self._record("long_id", lambda: self.stub.OpenSession(long_id, metadata=self.metadata, timeout=30))
        opened = []
        for i in range(40):
            request = stage_pb2.OpenSessionRequest(session_id=f"hog{i}", capacity=16)
            try:
                self.stub.OpenSession(request, metadata=self.metadata, timeout=30)
                opened.append(request.session_id)
            except grpc.RpcError as exc:
                self.outcomes[f"session_hog:{exc.code().name}"] += 1
                assert exc.code() not in FORBIDDEN, exc.details()
        for session in opened:
            self.stub.ReleaseSession(
                stage_pb2.ReleaseSessionRequest(session_id=session), metadata=self.metadata
            )
        streams = [
            self.stub.Results(stage_pb2.ResultsRequest(subscriber_id=f"sub{i}"), metadata=self.metadata)
            for i in range(20)
        ]
        for stream in streams:
            stream.cancel()

    def coordinator_floods(self) -> None:
        with grpc.insecure_channel(self.fleet.coordinator) as channel:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
            flood = coordinator_pb2.GenerateRequest(prompt="Hi")
            flood.params.stop.extend(f"s{i}" for i in range(100_000))
            self._record("stop_flood", lambda: list(stub.Generate(flood, timeout=30)))
            for _ in range(10):
                request = coordinator_pb2.GenerateRequest(prompt=self.rng.choice(PROMPTS))
                request.params.max_tokens = self.rng.choice([1, 4, 0, -1, 2**31 - 1])
                request.params.temperature = self.rng.choice([0.0, 0.7, -1.0, float("nan"), 1e30])
                request.params.top_p = self.rng.choice([0.5, 1.0, 0.0, 2.0])
                request.params.stop_token_ids.extend(
                    self.rng.sample(range(-5, 60000), self.rng.randint(0, 80))
                )
                request.params.grammar.regex = self.rng.choice(["", "[a-z]+", "(", "a{99999999}"])
                request.speculative = self.rng.choice(["", "ngram", "/etc", "self"])
                request.k = self.rng.randint(-2, 40)
                self._record("generate_fields", lambda r=request: list(stub.Generate(r, timeout=30)))

    def gateway_floods(self) -> None:
        url = f"http://{self.fleet.gateway}"
        bodies = [b"\x00\xff", b"[1,2]", b'{"messages": 5}', b'{"prompt": {"a": [1]}, "max_tokens": -3}']
        bodies += [json.dumps({"prompt": "Hi", "stop": ["x"] * self.rng.randint(5, 500)}).encode()]
        bodies += [json.dumps({"prompt": "Hi", "n": self.rng.randint(9, 10**6)}).encode()]
        with httpx.Client(base_url=url, timeout=60) as client:
            for body in bodies * 3:
                for route in ("/v1/chat/completions", "/v1/completions"):
                    reply = client.post(route, content=body, headers={"content-type": "application/json"})
                    self.outcomes[f"http_body:{reply.status_code}"] += 1
                    if reply.status_code >= 500:
                        raise AssertionError(f"http_body: {reply.status_code} {reply.text}")
        host, port = self.fleet.gateway.rsplit(":", 1)
        socks = []
        body = json.dumps({"prompt": "Count to a thousand.", "stream": True, "max_tokens": 2000}).encode()
        for _ in range(6):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect((host, int(port)))
            head = (
                "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n"
            )
            sock.sendall(head.encode() + body)
            socks.append(sock)
        time.sleep(5)  # never read; the gateway's chunk deadline or the caller's close ends them
        for sock in socks:
            sock.close()
        self.outcomes["idle_streams:opened"] += len(socks)

    def round(self) -> None:
        self.forward_bombs()
        self.stage_floods()
        self.coordinator_floods()
        self.gateway_floods()


def _users(fleet, solo: dict[str, list[int]], rng: random.Random) -> Counter:
    outcomes: Counter[str] = Counter()

    def user(seed: int) -> None:
        local = random.Random(seed)
        with PipeshardClient(fleet.coordinator, timeout_s=300) as client:
            for _ in range(REQUESTS_PER_USER):
                prompt = local.choice(PROMPTS)
                tokens = local.randint(4, MAX_TOKENS)
                answer = client.generate(prompt, max_tokens=tokens, ignore_eos=True).token_ids
                outcomes["ok" if answer == solo[prompt][:tokens] else "mismatch"] += 1

    with ThreadPoolExecutor(USERS) as pool:
        list(pool.map(user, [rng.randrange(1 << 30) for _ in range(USERS)]))
    return outcomes


def _idle_rss(fleet) -> dict[str, float]:
    """Every process's RSS once the fleet is idle: no session left (at most 30 s), then SETTLE_S
    more, in which an idle stage hands its free heap pages back (pipeshard/allocator.py)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(_live_sessions(a) for a in fleet.stages):
        time.sleep(0.2)
    time.sleep(SETTLE_S)
    return {p.name: _rss_mib(p.popen.pid) for p in fleet.processes}


def _rss_regions(pid: int) -> dict[str, float]:
    """A process's resident memory by region (MiB), from /proc/PID/smaps: ``heap`` (the main
    malloc arena, brk), ``anon`` (other anonymous mappings: mmap'd allocations such as a paged
    stage's KV pool, other malloc arenas, Python's arenas, thread stacks), ``largest_anon`` (the
    largest of those: on a stage, the KV pool, whose pages are resident once a session has
    written them) and ``file`` (mapped files: weights, libraries, which the kernel drops and
    reloads under pressure)."""
    regions = {"heap": 0, "anon": 0, "largest_anon": 0, "file": 0}
    name = ""
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and not head[0].endswith(":"):
            name = head[5] if len(head) > 5 else ""
        elif head[0] == "Rss:":
            kib = int(head[1])
            if name == "[heap]":
                regions["heap"] += kib
            elif name.startswith("/"):
                regions["file"] += kib
            else:
                regions["anon"] += kib
                regions["largest_anon"] = max(regions["largest_anon"], kib)
    return {k: round(v / 1024, 1) for k, v in regions.items()}


def _anonymous(regions: dict[str, float]) -> float:
    """Anonymous resident memory (MiB): what a host short of memory cannot drop without swap."""
    return round(regions["heap"] + regions["anon"], 1)


def _slope(series: list[float]) -> float:
    """MiB a round over the second half of the rounds (least squares): about 0 once memory has
    levelled off, the leak's rate if it has not."""
    half = series[len(series) // 2 :]
    if len(half) < 2:
        return 0.0
    return round(float(np.polyfit(np.arange(len(half)), half, 1)[0]), 2)


def main() -> int:
    set_offline_defaults()
    shards = _shards()
    run_dir = Path(tempfile.mkdtemp(prefix="pipeshard-soak-hostile-"))
    fleet = start_fleet(shards, 2, run_dir, stage_ports=[_free_port(), _free_port()], gateway_port=0)
    rng = random.Random(SEED)
    attacker = Attacker(fleet, rng)
    rounds, users, failures = [], Counter(), []
    start: dict[str, float] = {}
    started = time.monotonic()
    try:
        with PipeshardClient(fleet.coordinator, timeout_s=300) as client:
            solo = {p: client.generate(p, max_tokens=MAX_TOKENS, ignore_eos=True).token_ids for p in PROMPTS}
        for k in range(ROUNDS):
            with ThreadPoolExecutor(1) as pool:
                normal = pool.submit(_users, fleet, solo, rng)
                try:
                    attacker.round()
                except AssertionError as exc:
                    failures.append(str(exc))
                users.update(normal.result())
            rss = _idle_rss(fleet)
            rounds.append(
                {
                    "round": k + 1,
                    "rss_mib": {n: round(v, 1) for n, v in rss.items()},
                    "regions_mib": {p.name: _rss_regions(p.popen.pid) for p in fleet.processes},
                }
            )
            print(
                f"round {k + 1}/{ROUNDS}: rss MiB {rounds[-1]['rss_mib']} {rounds[-1]['regions_mib']}",
                flush=True,
            )
            if k == 0:
                start = rss
        end = _idle_rss(fleet)
        end_regions = {p.name: _rss_regions(p.popen.pid) for p in fleet.processes}
        sessions_left = [_live_sessions(a) for a in fleet.stages]
    finally:
        attacker.close()
        fleet.stop()
    change = {n: round(end[n] / start[n] - 1, 4) for n in start}
    slope = {n: _slope([r["rss_mib"][n] for r in rounds]) for n in start}
    anon_start = {n: _anonymous(r) for n, r in rounds[0]["regions_mib"].items()}
    anon_end = {n: _anonymous(r) for n, r in end_regions.items()}
    anon_change = {n: round(anon_end[n] / anon_start[n] - 1, 4) for n in anon_start}
    if users["mismatch"] or users["ok"] != ROUNDS * USERS * REQUESTS_PER_USER:
        failures.append(f"normal requests: {dict(users)}")
    if any(sessions_left):
        failures.append(f"sessions left on the stages: {sessions_left}")
    if any(c > TOLERANCE for c in change.values()):
        failures.append(f"RSS at the end over {TOLERANCE:.0%} above the start: {change}")
    if any(c > TOLERANCE for c in anon_change.values()):
        failures.append(f"anonymous memory at the end over {TOLERANCE:.0%} above the start: {anon_change}")
    result = {
        "rounds": ROUNDS,
        "seconds": round(time.monotonic() - started, 1),
        "normal_requests": dict(users),
        "attack_outcomes": dict(attacker.outcomes),
        "rss_start_mib": {n: round(v, 1) for n, v in start.items()},
        "rss_end_mib": {n: round(v, 1) for n, v in end.items()},
        "rss_change": change,
        "rss_slope_mib_per_round": slope,
        "anon_start_mib": anon_start,
        "anon_end_mib": anon_end,
        "anon_change": anon_change,
        "per_round": rounds,
        "sessions_left": sessions_left,
        "seed": SEED,
        "failures": failures,
        "passed": not failures,
    }
    write_result("soak_hostile", result, command="make soak SOAK_MODE=hostile")
    shown = ("rss_change", "anon_change", "rss_slope_mib_per_round", "normal_requests", "failures")
    print(json.dumps({k: result[k] for k in shown}), flush=True)
    for failure in failures:
        print(f"soak FAILED: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
