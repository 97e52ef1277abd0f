"""`make bench-latency`: the fleet's own cost per step and per row (issue 29).

1. A per-token timeline of one decode step across the processes of a 2-stage fleet, from their own
   clocks: a fleet started with ``PIPESHARD_TRACE_DIR`` (pipeshard/trace.py) logs each step's
   events; after it stops they are joined by (session, step) into median offsets and segments, and
   ``hop_overhead_ms_p50`` (sender's send call -> receiver's handler, per hop, median).
2. Paired, interleaved rounds (bench/stats.py; ratio of medians with a 95% bootstrap interval), 128
   greedy tokens, eos ignored, several natural prompts: one user on the 2-stage fleet against the
   same export in this process (``generate --local``'s batched_ring + Generation), against
   openvino_genai.LLMPipeline and ContinuousBatchingPipeline on the unsplit INT4 optimum export
   (bench/reference.py), the default (exact) fleet against a `fast` one, a 3-stage fleet
   against its in-process ring; TTFT of a ~30-token prompt, fleet against in-process; 16 users
   aggregate against ContinuousBatchingPipeline; 8 users against the fleet of BENCH_BEFORE
   (default e2242a2, checked out and served as bench/commits.py does).
3. BENCH_PROFILE=1: a py-spy sampling profile (``py-spy record --format raw``) of every fleet
   process during a 1-user run (part ``1user``) and a 16-user run (part ``16users``); the top
   frames per process go into the result.

Runtime: about 25 minutes in full on 2 quiet cores (2026-12-02: 24 min with BENCH_PROFILE=1; the
16users part alone 5 min). BENCH_QUICK=1: 3 rounds after 1 warm-up (under 10 minutes on 2 loaded
cores); BENCH_RUNS overrides.
BENCH_PART (comma-separated, default all): ``timeline``, ``1user`` (the 1-user keys and the short
prompt's TTFT), ``16users``, ``8users``; the result holds the keys of the parts run.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import grpc

from bench.stats import interleaved, median, ratio_ci, summary, write_result
from pipeshard import paths
from pipeshard.offline import set_offline_defaults
from pipeshard.v1 import coordinator_pb2, coordinator_pb2_grpc

QUICK = os.environ.get("BENCH_QUICK") == "1"
RUNS = int(os.environ.get("BENCH_RUNS", "3" if QUICK else "10"))
WARMUP = 1 if QUICK else 2
NEW_TOKENS = 128
BEFORE = os.environ.get("BENCH_BEFORE", "e2242a2")
PARTS = ("timeline", "1user", "16users", "8users")
PROMPTS = [
    "Explain in a few paragraphs how a bicycle works.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the main differences between a list and a tuple in Python? Give examples.",
    "Describe the water cycle to a ten-year-old.",
]
# About 30 tokens once chat-templated (the TTFT of a short prompt).
SHORT_PROMPT = "Hi, what is the capital of France?"
# The order one decode step's events happen in (process, event); the timeline's segments join them.
TIMELINE = [
    ("coordinator", "gen_send"),
    ("coordinator", "plan_build"),
    ("coordinator", "plan_send"),
    ("coordinator", "hop_send"),
    ("stage0", "recv"),
    ("stage0", "decoded"),
    ("stage0", "inferred"),
    ("stage0", "encoded"),
    ("stage0", "hop_send"),
    ("stage1", "recv"),
    ("stage1", "decoded"),
    ("stage1", "inferred"),
    ("stage1", "published"),
    ("stage1", "results_written"),
    ("coordinator", "result_recv"),
    ("coordinator", "gen_result"),
    ("coordinator", "emitted"),
    ("coordinator", "streamed"),
]
# One way per hop: the sender's send call -> the receiver's handler.
HOPS = {
    "coordinator->stage0": (("coordinator", "hop_send"), ("stage0", "recv")),
    "stage0->stage1": (("stage0", "hop_send"), ("stage1", "recv")),
    "stage1->coordinator (results)": (("stage1", "published"), ("coordinator", "result_recv")),
}


def export(stages: int) -> Path:
    out = paths.shards_dir() / paths.export_name(paths.DEFAULT_MODEL, stages, "int4")
    if not (out / "manifest.json").exists():
        from pipeshard.exporter.export import export_model

        export_model(paths.default_model_dir(), out, stages=stages, weights="int4")
    return out


def request(prompt: str, tokens: int = NEW_TOKENS) -> coordinator_pb2.GenerateRequest:
    return coordinator_pb2.GenerateRequest(
        messages=[coordinator_pb2.ChatMessage(role="user", content=prompt)],
        params=coordinator_pb2.SamplingParams(max_tokens=tokens, ignore_eos=True),
    )


class FleetClient:
    """Generations through a running fleet's coordinator (one channel, as a client keeps)."""

    prompts = PROMPTS  # what `aggregate`'s users send, in turn

    def __init__(self, address: str):
        self.channel = grpc.insecure_channel(address)
        self.stub = coordinator_pb2_grpc.CoordinatorServiceStub(self.channel)

    def request(self, prompt: str, tokens: int) -> coordinator_pb2.GenerateRequest:
        return request(prompt, tokens)

    def run(self, prompt: str, tokens: int = NEW_TOKENS) -> dict:
        t0 = time.perf_counter()
        first, last, ids = None, t0, []
        for response in self.stub.Generate(self.request(prompt, tokens), timeout=600):
            if response.HasField("chunk") and response.chunk.token_ids:
                last = time.perf_counter()
                first = first or last
                ids.extend(response.chunk.token_ids)
        first = first or last
        rate = (len(ids) - 1) / (last - first) if len(ids) > 1 and last > first else 0.0
        return {"tok_s": rate, "ttft_ms": (first - t0) * 1000, "tokens": ids}

    def aggregate(self, users: int) -> float:
        """Tokens per second over ``users`` concurrent generations, first request to last token."""
        counts = [0] * users

        def one(i: int) -> None:
            counts[i] = len(self.run(self.prompts[i % len(self.prompts)])["tokens"])

        threads = [threading.Thread(target=one, args=(i,)) for i in range(users)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return sum(counts) / (time.perf_counter() - t0)


class Local:
    """``pipeshard generate --local``: Generation over the paged in-process ring, in this process."""

    def __init__(self, export_dir: Path, precision: str | None = None):
        from pipeshard.precision import DEFAULT_PRECISION
        from pipeshard.services.coordinator.generation import Generation
        from pipeshard.services.coordinator.in_process import batched_ring
        from pipeshard.shard.prompting import Prompter

        self.prompter = Prompter.from_dir(export_dir)
        self.ring = batched_ring(export_dir, precision or DEFAULT_PRECISION)
        self.ring.stages.warmup()
        self.generation = Generation(
            self.ring, self.prompter.tokenizer, self.prompter.eos_ids, prefill_chunk=self.ring.prefill_chunk
        )
        self.loop = asyncio.new_event_loop()

    def ids(self, prompt: str) -> list[int]:
        return self.prompter.encode("", [("user", prompt)])

    async def _one(self, prompt: str, tokens: int) -> dict:
        from pipeshard.services.coordinator.generation import Chunk
        from pipeshard.services.coordinator.sampling import SamplingParams

        params = SamplingParams(max_tokens=tokens, ignore_eos=True)
        t0 = time.perf_counter()
        first, last, ids = None, t0, []
        async for event in self.generation.run(self.ids(prompt), params):
            if isinstance(event, Chunk) and event.token_ids:
                last = time.perf_counter()
                first = first or last
                ids.extend(event.token_ids)
        first = first or last
        rate = (len(ids) - 1) / (last - first) if len(ids) > 1 and last > first else 0.0
        return {"tok_s": rate, "ttft_ms": (first - t0) * 1000, "tokens": ids}

    def run(self, prompt: str, tokens: int = NEW_TOKENS) -> dict:
        return self.loop.run_until_complete(self._one(prompt, tokens))

    def close(self) -> None:
        """Ends the generation's engine task, then this loop: no task is left pending."""
        self.loop.run_until_complete(self.generation.close())
        self.loop.close()


class Continuous:
    """openvino_genai.ContinuousBatchingPipeline on the unsplit export: 1 or N generations at once."""

    def __init__(self, folder: Path):
        import openvino_genai as g

        self.g = g
        scheduler = g.SchedulerConfig()
        scheduler.cache_size = 1  # GB of KV blocks: 16 users x 200 positions need far less
        self.pipe = g.ContinuousBatchingPipeline(str(folder), scheduler, "CPU")

    def aggregate(self, prompt_ids: list[list[int]]) -> float:
        import numpy as np
        import openvino as ov

        configs = []
        for _ in prompt_ids:
            c = self.g.GenerationConfig()
            c.max_new_tokens = c.min_new_tokens = NEW_TOKENS
            c.ignore_eos, c.do_sample = True, False
            configs.append(c)
        inputs = [ov.Tensor(np.asarray([ids], dtype=np.int64)) for ids in prompt_ids]
        t0 = time.perf_counter()
        results = self.pipe.generate(inputs, configs)
        elapsed = time.perf_counter() - t0
        return sum(len(r.m_generation_ids[0]) for r in results) / elapsed


def start(shards: Path, stages: int, run_dir: Path, precision: str | None = None, env: dict | None = None):
    from pipeshard.services.launcher import start_fleet

    saved = dict(os.environ)
    os.environ.update(env or {})
    try:
        kwargs = {"precision": precision} if precision else {}
        # The default open fleet: its users all connect from loopback, one identity (pipeshard/
        # auth.py), which runs all 16 at once since no other identity waits (scheduler.py).
        return start_fleet(shards, stages, run_dir, **kwargs)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def timeline(trace_dir: Path) -> dict:
    """Joins a trace by step: each event's offset from the step's ``gen_send``, the segments
    between consecutive events (p50, p90 and mean: the means add up to the mean step), one-way
    hop times, and the step's period (to the next ``gen_send`` of its session) against the stages'
    compute. Decode steps only (a step whose session sent a next one)."""
    events: dict[tuple[str, int], dict[tuple[str, str], int]] = defaultdict(dict)
    rows: Counter = Counter()  # rows of each plan frame, by its key
    for path in trace_dir.glob("*.tsv"):
        for line in path.read_text().splitlines():
            t, process, event, session, step = line.split("\t")
            events[(session, int(step))].setdefault((process, event), int(t))
            rows[(session, int(step))] += event == "plan_row"
    full = {k: e for k, e in events.items() if all(x in e for x in TIMELINE)}
    segments: dict[str, list[float]] = defaultdict(list)
    offsets: dict[str, list[float]] = defaultdict(list)
    hops: dict[str, list[float]] = defaultdict(list)
    periods, compute, step_rows = [], [], []
    for (session, step), e in full.items():
        nxt = full.get((session, step + 1))
        if step == 0 or nxt is None:
            continue
        step_rows.append(rows[(session, step)])
        ms = lambda a, b: (b - a) / 1e6  # noqa: E731
        periods.append(ms(e[TIMELINE[0]], nxt[TIMELINE[0]]))
        compute.append(sum(ms(e[(s, "decoded")], e[(s, "inferred")]) for s in ("stage0", "stage1")))
        for key in TIMELINE:
            offsets[".".join(key)].append(ms(e[TIMELINE[0]], e[key]))
        for a, b in itertools.pairwise([*TIMELINE, None]):
            end = nxt[TIMELINE[0]] if b is None else e[b]
            segments[f"{'.'.join(a)} -> {'next step' if b is None else '.'.join(b)}"].append(ms(e[a], end))
        for name, (a, b) in HOPS.items():
            hops[name].append(ms(e[a], e[b]))
    if not periods:
        return {"steps": 0}
    spread = lambda v: {"p50": median(v), "p90": sorted(v)[int(0.9 * (len(v) - 1))], "mean": sum(v) / len(v)}  # noqa: E731
    return {
        "steps": len(periods),
        "step_ms": spread(periods),
        "compute_ms": spread(compute),
        "rows_per_step": spread(step_rows),
        "overhead_ms_p50": median(periods) - median(compute),
        "offsets_ms_p50": {k: median(v) for k, v in offsets.items()},
        "segments_ms": {k: spread(v) for k, v in segments.items()},
        "hops_ms_p50": {k: median(v) for k, v in hops.items()},
        "hop_overhead_ms_p50": median([x for v in hops.values() for x in v]),
    }


def plot(line: dict, path: Path) -> None:
    """One typical decode step: each segment's median laid end to end on a lane per process (median
    offsets of separate events need not be in order; the segments' medians are)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    segments = line["segments_ms"]
    lanes = ["coordinator", "stage0", "stage1"]
    fig, ax = plt.subplots(figsize=(10, 3))
    start = 0.0
    for a, b in itertools.pairwise(TIMELINE):
        width = max(segments[f"{'.'.join(a)} -> {'.'.join(b)}"]["p50"], 0.0)
        lane = lanes.index(a[0] if a[0] == b[0] else b[0])
        compute = a[1] == "decoded" and b[1] == "inferred"
        ax.barh(lane, max(width, 0.05), left=start, color="tab:blue" if compute else "tab:orange")
        start += width
    ax.axvline(line["step_ms"]["p50"], color="k", linestyle="--", label="next step sent (p50)")
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_xlabel("ms (median of each segment, end to end); blue: inference, orange: the rest")
    ax.legend(loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def traced(shards: Path, work: Path, users: int) -> dict:
    """A traced 2-stage fleet: one warm-up, one run of ``users`` users, then its joined timeline."""
    trace_dir = work / f"trace-{users}"
    fleet = start(shards, 2, work / f"run-trace-{users}", env={"PIPESHARD_TRACE_DIR": str(trace_dir)})
    try:
        client = FleetClient(fleet.coordinator)
        client.run(PROMPTS[0], 16)
        client.aggregate(users) if users > 1 else client.run(PROMPTS[0])
    finally:
        fleet.stop()
    return timeline(trace_dir)


def profile(fleet, client: FleetClient, users: int, out: Path) -> dict:
    """py-spy (raw collapsed stacks) of every fleet process during one run of ``users`` users:
    each process's top leaf frames and top inclusive frames, as shares of its samples."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    seconds = 6 if users == 1 else 10
    procs = []
    for p in fleet.processes:
        path = out / f"{p.name}-{users}u.txt"
        cmd = [spy, "record", "--gil", "--format", "raw", "--rate", "200", "--duration", str(seconds)]
        procs.append((p.name, path, subprocess.Popen([*cmd, "-o", str(path), "--pid", str(p.popen.pid)])))
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        client.aggregate(users) if users > 1 else client.run(PROMPTS[0])
    report = {}
    for name, path, proc in procs:
        proc.wait()
        report[name] = top_frames(path)
    return report


def top_frames(path: Path, n: int = 8) -> dict:
    leaf, inclusive, total = Counter(), Counter(), 0
    if not path.exists():
        return {}
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        frames = [f.split(" (")[0] for f in stack.split(";")]
        total += int(count)
        leaf[frames[-1]] += int(count)
        for f in set(frames):
            inclusive[f] += int(count)
    share = lambda c: {f: round(k / total, 3) for f, k in c.most_common(n)}  # noqa: E731
    return {"samples": total, "leaf": share(leaf), "inclusive": share(inclusive)}


def main() -> int:
    set_offline_defaults()
    from bench.reference import GenAIPipeline, optimum_export

    parts = os.environ.get("BENCH_PART", ",".join(PARTS)).split(",")
    unknown = set(parts) - set(PARTS)
    if unknown:
        sys.exit(f"BENCH_PART: unknown part(s) {sorted(unknown)}; choose from {', '.join(PARTS)}")
    shards, shards3 = export(2), export(3)
    work = Path(tempfile.mkdtemp(prefix="pipeshard-latency-"))
    result: dict = {
        "runs": RUNS,
        "warmup": WARMUP,
        "new_tokens": NEW_TOKENS,
        "prompts": PROMPTS,
        "parts": parts,
    }
    if "timeline" in parts:
        result["timeline_1user"] = traced(shards, work, 1)
        print("timeline 1 user:", result["timeline_1user"], file=sys.stderr)
        result["timeline_16users"] = traced(shards, work, 16)
        result["hop_overhead_ms_p50"] = result["timeline_1user"].get("hop_overhead_ms_p50")
        for key, image in (
            ("timeline_1user", "latency_timeline"),
            ("timeline_16users", "latency_timeline_16users"),
        ):
            if result[key].get("steps"):
                plot(result[key], Path(f"docs/img/{image}.png"))

    reference = optimum_export(paths.default_model_dir(), paths.shards_dir() / "optimum-int4-reference")
    fleets = {"fleet": start(shards, 2, work / "run-fleet")}
    if "1user" in parts:
        # the default fleet runs `exact`; the "default" baseline is today's `fast`
        fleets["fleet_fast"] = start(shards, 2, work / "run-fast", precision="fast")
        fleets["fleet3"] = start(shards3, 3, work / "run-fleet3")
    local: Local | None = None
    try:
        clients = {name: FleetClient(f.coordinator) for name, f in fleets.items()}
        local = Local(shards)
        cb = Continuous(reference)
        if "1user" in parts:
            local3 = Local(shards3)
            try:
                one_user(result, clients, local, local3, GenAIPipeline(reference), cb)
            finally:
                local3.close()
        if "16users" in parts:
            sixteen_users(result, clients["fleet"], local, cb)
        profiled = [users for users, part in ((1, "1user"), (16, "16users")) if part in parts]
        if os.environ.get("BENCH_PROFILE") == "1" and profiled:
            out = Path("bench/results/profiles")
            out.mkdir(parents=True, exist_ok=True)
            result["profile"] = {
                f"{users}u": profile(fleets["fleet"], clients["fleet"], users, out) for users in profiled
            }
        for name in ("fleet_fast", "fleet3"):
            if name in fleets:
                fleets.pop(name).stop()
        if "8users" in parts:
            eight_users(result, clients["fleet"], shards, work)
    finally:
        if local is not None:
            local.close()
        for fleet in fleets.values():
            fleet.stop()
    part = f"BENCH_PART={os.environ['BENCH_PART']} " if "BENCH_PART" in os.environ else ""
    write_result("latency", result, command=("BENCH_QUICK=1 " if QUICK else "") + part + "make bench-latency")
    return 0


def one_user(result: dict, clients: dict, local: Local, local3: Local, mono, cb: Continuous) -> None:
    """The 1-user keys (paired, interleaved) and the short prompt's TTFT, fleet against in-process."""
    rounds = iter(range(10**9))

    def prompt() -> str:
        return PROMPTS[next(rounds) % len(PROMPTS)]

    one = {
        **{name: (lambda c=c: c.run(prompt())["tok_s"]) for name, c in clients.items()},
        "local": lambda: local.run(prompt())["tok_s"],
        "local3": lambda: local3.run(prompt())["tok_s"],
        "mono": lambda: mono.run(local.ids(prompt()), NEW_TOKENS)["tok_s"],
        # CB is timed like an aggregate (tokens over the call, prefill included): the fleet too.
        "cb": lambda: cb.aggregate([local.ids(prompt())]),
        "fleet_aggregate": lambda: clients["fleet"].aggregate(1),
    }
    tok_s = interleaved(one, RUNS, warmup=WARMUP)
    result["tok_s_1user"] = {n: summary(v) for n, v in tok_s.items()}
    for key, (num, den) in {
        "fleet_over_local_1user": ("fleet", "local"),
        "fleet_over_mono_1user": ("fleet", "mono"),
        "fleet_over_cb_1user": ("fleet_aggregate", "cb"),
        "exact_over_default_1user": ("fleet", "fleet_fast"),
        "fleet3_over_local3_1user": ("fleet3", "local3"),
    }.items():
        result[key], result[f"{key}_ci"] = ratio_ci(tok_s[num], tok_s[den])
    ttft = interleaved(
        {
            "fleet": lambda: clients["fleet"].run(SHORT_PROMPT, 1)["ttft_ms"],
            "local": lambda: local.run(SHORT_PROMPT, 1)["ttft_ms"],
        },
        RUNS,
        warmup=WARMUP,
    )
    result["short_prompt_tokens"] = len(local.ids(SHORT_PROMPT))
    result["ttft_ms_short"] = {n: summary(v) for n, v in ttft.items()}
    result["ttft_fleet_over_local_short"], result["ttft_fleet_over_local_short_ci"] = ratio_ci(
        ttft["fleet"], ttft["local"]
    )


def sixteen_users(result: dict, client: FleetClient, local: Local, cb: Continuous) -> None:
    """16 concurrent generations, aggregate tok/s, the fleet against ContinuousBatchingPipeline."""
    ids16 = [local.ids(PROMPTS[i % len(PROMPTS)]) for i in range(16)]
    agg = interleaved(
        {"fleet": lambda: client.aggregate(16), "cb": lambda: cb.aggregate(ids16)}, RUNS, warmup=WARMUP
    )
    result["tok_s_16users"] = {n: summary(v) for n, v in agg.items()}
    result["fleet_over_cb_16users"], result["fleet_over_cb_16users_ci"] = ratio_ci(agg["fleet"], agg["cb"])


def eight_users(result: dict, client: FleetClient, shards: Path, work: Path) -> None:
    """8 users' aggregate against the fleet of BENCH_BEFORE, alternating (it must not fall)."""
    from bench.commits import checkout
    from bench.commits import start as start_commit

    before = checkout(BEFORE, work)
    # As its own `make setup` installs it: a commit from before uvloop became a dependency
    # would pick up the one installed here through its run_server.
    if "uvloop" not in (before.tree / "pyproject.toml").read_text():
        (before.overlay / "uvloop.py").write_text("raise ImportError('not installed at this commit')\n")
    try:
        start_commit(before, shards, work)
        before_client = FleetClient(before.address)
        eight = interleaved(
            {"after": lambda: client.aggregate(8), "before": lambda: before_client.aggregate(8)},
            RUNS,
            warmup=WARMUP,
        )
    finally:
        if before.process is not None:
            before.process.stdin.close()
            before.process.wait(timeout=60)
        subprocess.run(["git", "worktree", "remove", "--force", str(before.tree)], check=False)
    result["before"] = BEFORE
    result["tok_s_8users"] = {n: summary(v) for n, v in eight.items()}
    result["aggregate_8users_over_before"], result["aggregate_8users_over_before_ci"] = ratio_ci(
        eight["after"], eight["before"]
    )


if __name__ == "__main__":
    sys.exit(main())
