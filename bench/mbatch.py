"""`make bench-mbatch`: many concurrent streams interleaved across the stages of one fleet.

Per configuration, c clients each stream BENCH_TOKENS (128) tokens (eos ignored, the same chat
prompt) at the same time through the coordinator: 2- and 3-stage loopback fleets with plain
decoding, the 2-stage fleet with every stream speculating (prompt lookup, fixed K), and a 2-stage
fleet on the WAN emulator at 50 ms one-way per hop, plain and speculative. Reported per
configuration: aggregate tok/s (all generated tokens / wall time of the batch), per-stream decode
tok/s, p50/p95 gap between streamed chunks (a speculative chunk carries every token one verify
kept), TTFT under load, and acceptance for the speculative ones. Every configuration, the
reference (LLMPipeline, one user) included, runs once per shuffled round, BENCH_RUNS (10) rounds
after a warm-up round. Isolation: every stream of every round must give the tokens of a solo
stream of the same decoding on the same shards (speculative against speculative with the same K:
at the CPU's default bf16 precision a K+1-row verify may round differently from a plain step).
Fleets run with the default OpenVINO threads (2 per stage process on this 2-core machine), and
one 2-stage fleet with one thread per stage: the two-stream ratio's baseline is whichever of the
two is faster with one stream.

Then, in this process: batch-dimension stacking against interleaving (bench/stacking.py).

The ``local_*`` series (continuous batching, issue #16) serve 1-8 users with different prompts
(bench/batched.py) through every stage in this process: the paged ``batched_ring`` (all users'
rows in each inference) in exact mode at 1 thread and at the default precision with the plugin's
threads, and the stateful ``local_ring`` with one user as the single-user baselines. Their keys:
``four_users_over_one`` / ``eight_users_over_one`` (paged exact, over its own single user),
``four_users_over_best_single`` (the best 4-user configuration over the best single-user one of
any backend, precision and thread setting), ``full_stack_over_mono`` (the best up to 8 users
over LLMPipeline), per-user TTFT and inter-token p50/p95, and isolation against solo runs.
The ``2s_paged`` / ``2s_paged_exact`` series run the 2-stage fleet with ``--kv paged`` on stages and
coordinator (plan frames: every user's row in each inference), at the default precision and in
exact mode with 1 thread per stage; when present, they give ``four_users_over_one`` and
``eight_users_over_one`` (exact) and their ``_default`` twins instead of the local series.

Issue #17 (several batches in flight, fair latency, many users over slow hops): every fleet user
streams its own prompt (bench/batched.py PROMPTS: 16 natural prompts checked not to loop; the
run reports their repetition rate, the share of solo answers with a 4-gram more than 3 times).
``2s_paged`` goes to 16 users; ``2s_paged_ifn`` / ``3s_paged_ifn`` run the paged fleets with one
batch in flight per stage (``--inflight 0``, a second coordinator on the same stages) against the
default, one batch (``inflight_gain_{2,3}stages_loopback``); ``ttft_idle`` / ``ttft_busy8`` time the
first token of probe requests on the paged 2-stage fleet idle and with 8 users decoding
(``ttft_p95_loaded_over_idle``: the probes' p95 busy over their median idle); the ``wan50_3s_paged*``
series run a 3-stage paged fleet on the WAN emulator at 50 ms per hop: 1/4/8/16 users plain
(``sixteen_users_over_one_at_50ms``), 8 users with a batch in flight per stage
(``inflight_gain_3stages_50ms``),
and 1/4 users speculating per session (prompt lookup, K=BENCH_SPEC_K_WAN, and with adaptive,
batch-aware K in ``wan50_3s_paged_spec_auto``; its verify rows ride in the batch:
``full_stack_over_plain_at_50ms`` over one plain user). The emulator is one per machine,
so series on different WAN fleets run in separate phases, each interleaved on its own; every ratio
is taken within one phase. ``isolation_ok`` covers the series that must be isolated (stateful, and
paged exact at 1 thread); the others report their agreement with the solo runs, and at each
divergence the teacher-forced top-2 logit margin of the solo run there (``divergences``).
``paged_exact_2t_over_1t`` compares 2 threads per stage with 1 on the paged exact fleet.
BENCH_QUICK=1 runs the series that give every #17 key (3 rounds, 64 tokens) in well under an hour.

Knobs: BENCH_SERIES (comma-separated series names, default all; a subset skips stacking, the plot
and the ratios whose inputs it lacks), BENCH_DRAFT=<draft export> speculates with that draft
(`self`, for example a distilled one) instead of prompt lookup, BENCH_SPEC_K (3) and
BENCH_SPEC_K_WAN (8) set the fixed K of the speculative series, BENCH_MAX_USERS caps the user
counts of every series.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np

from bench import stacking
from bench.batched import PROMPTS, LocalUsers, latency, repetition, top2_margins
from bench.pipeline import ensure_export
from bench.reference import GenAIPipeline, optimum_export
from bench.spec import spec_stats
from bench.stats import interleaved, median, ratio_ci, summary, write_result
from pipeshard import paths
from pipeshard.clients.client import AsyncPipeshardClient, GenerateResult, fold
from pipeshard.offline import set_offline_defaults
from pipeshard.services.launcher import coordinator_args, fleet_env, spawn, start_fleet
from pipeshard.services.wan.emulator import CONTROL_PORT, WanFleet
from pipeshard.shard.prompting import Prompter

QUICK = os.environ.get("BENCH_QUICK") == "1"
TOKENS = int(os.environ.get("BENCH_TOKENS", "64" if QUICK else "128"))
RUNS = int(os.environ.get("BENCH_RUNS", "3" if QUICK else "10"))
# bench-spec: prompt lookup did best at small K on one node, larger K at high latency per hop.
SPEC_K = int(os.environ.get("BENCH_SPEC_K", "3"))
SPEC_K_WAN = int(os.environ.get("BENCH_SPEC_K_WAN", "8"))
DRAFT = os.environ.get("BENCH_DRAFT")
SPEC_SOURCE = "self" if DRAFT else "ngram"
WAN_DELAY_MS = 50.0
# emulator: the WAN series run on the WAN emulator (namespaces, one per machine: a phase each);
# hop: on loopback, every process delaying what it sends by --hop-delay-ms (the same N+1 delayed
# hops, no bandwidth cap; for a machine whose emulator is busy or that has no root).
LATENCY = os.environ.get("BENCH_LATENCY", "emulator")
WAN_RATE_MBIT = 100.0
TTFT_BUSY = 8  # users decoding while the TTFT probes arrive
MAX_MARGINS = 40  # divergences per (stages, precision) whose margin is measured
TTFT_PROBES = 3  # probe requests per round, one after another (prompts no busy user has)
# All users connect from loopback, one identity (the peer's host) without API keys: the
# per-identity cap (12 by default) is lifted to the 16 users measured.
COORDINATOR_ARGS = ["--max-running", "16", "--max-running-per-identity", "16", "--step-timeout-s", "120"] + (
    ["--self-draft", DRAFT] if DRAFT else []
)


class Series(NamedTuple):
    label: str
    stages: int
    k: int  # fixed draft length of prompt-lookup speculation; 0: plain decoding; -1: adaptive K
    wan: bool
    levels: tuple[int, ...]
    threads: int = 0  # OpenVINO inference threads per stage; 0: the plugin's choice (2 here)
    kv: str = "stateful"  # paged: stages and coordinator batch every session per step (#16)
    precision: str = "default"
    # paged: a second coordinator with --inflight N (0: one per stage); None: the fleet's own (1)
    inflight: int | None = None

    @property
    def door(self) -> tuple[tuple[int, int, bool, str, str], int]:
        """The coordinator: the fleet's own (inflight None) or a second one on the same stages."""
        return self.fleet, self.inflight

    @property
    def isolated(self) -> bool:
        """Whether its streams must equal their solo runs (else: agreement and margins reported)."""
        return self.kv == "stateful" or (self.precision == "exact" and self.threads == 1)

    @property
    def fleet(self) -> tuple[int, int, bool, str, str]:
        return self.stages, self.threads, self.wan, self.kv, self.precision

    @property
    def loopback(self) -> tuple[int, int, bool, str, str]:
        return self.stages, self.threads, False, self.kv, self.precision


ALL_SERIES = {
    "2s": Series("2 stages", 2, 0, False, (1, 2, 3, 4, 8)),
    "2s_1t": Series("2 stages, 1 thread per stage", 2, 0, False, (1, 2), threads=1),
    "3s": Series("3 stages", 3, 0, False, (1, 3)),
    "2s_paged": Series("2 stages, paged, batched", 2, 0, False, (1, 2, 4, 8, 16), kv="paged"),
    "2s_paged_ifn": Series("2 stages, paged, N batches in flight", 2, 0, False, (8,), kv="paged", inflight=0),
    "3s_paged": Series("3 stages, paged, batched", 3, 0, False, (1, 8), kv="paged"),
    "3s_paged_ifn": Series("3 stages, paged, N batches in flight", 3, 0, False, (8,), kv="paged", inflight=0),
    "2s_paged_exact": Series(
        "2 stages, paged, batched, exact, 1 thread",
        2,
        0,
        False,
        (1, 4, 8),
        threads=1,
        kv="paged",
        precision="exact",
    ),
    "2s_paged_exact_2t": Series(
        "2 stages, paged, batched, exact, 2 threads",
        2,
        0,
        False,
        (1, 4, 8),
        threads=2,
        kv="paged",
        precision="exact",
    ),
    "2s_spec": Series(f"2 stages, {SPEC_SOURCE} K={SPEC_K}", 2, SPEC_K, False, (1, 2, 4)),
    "wan50": Series("2 stages, WAN 50 ms/hop", 2, 0, True, (1, 4, 8)),
    "wan50_spec": Series(
        f"2 stages, WAN 50 ms/hop, {SPEC_SOURCE} K={SPEC_K_WAN}", 2, SPEC_K_WAN, True, (4, 8)
    ),
    "wan50_3s_paged": Series("3 stages, paged, WAN 50 ms/hop", 3, 0, True, (1, 4, 8, 16), kv="paged"),
    "wan50_3s_paged_ifn": Series(
        "3 stages, paged, WAN 50 ms/hop, N in flight", 3, 0, True, (8,), kv="paged", inflight=0
    ),
    "wan50_3s_paged_spec": Series(
        f"3 stages, paged, WAN 50 ms/hop, {SPEC_SOURCE} K={SPEC_K_WAN}",
        3,
        SPEC_K_WAN,
        True,
        (1, 4),
        kv="paged",
    ),
    "wan50_3s_paged_spec_auto": Series(
        f"3 stages, paged, WAN 50 ms/hop, {SPEC_SOURCE} adaptive batch-aware K",
        3,
        -1,
        True,
        (1, 4),
        kv="paged",
    ),
}
# What BENCH_QUICK=1 runs: every #17 key (and the #16 paged keys) in one WAN phase.
QUICK_SERIES = (
    "2s_paged",
    "2s_paged_ifn",
    "3s_paged",
    "3s_paged_ifn",
    "2s_paged_exact",
    "2s_paged_exact_2t",
    "wan50_3s_paged",
    "wan50_3s_paged_ifn",
    "wan50_3s_paged_spec",
)


class LocalSeries(NamedTuple):
    label: str
    paged: bool
    precision: str
    threads: int | None
    levels: tuple[int, ...]


ALL_LOCAL = {
    "local_exact": LocalSeries("in-process paged, exact, 1 thread", True, "exact", 1, (1, 2, 4, 8)),
    "local_default": LocalSeries("in-process paged, default precision", True, "default", None, (1, 2, 4, 8)),
    "local_stateful_exact": LocalSeries("in-process stateful, exact, 1 thread", False, "exact", 1, (1,)),
    "local_stateful_default": LocalSeries(
        "in-process stateful, default precision", False, "default", None, (1,)
    ),
}
_WANTED = os.environ.get(
    "BENCH_SERIES", ",".join(QUICK_SERIES if QUICK else [*ALL_SERIES, *ALL_LOCAL])
).split(",")
# BENCH_MAX_USERS caps every series' user counts (0: no cap), so a run can stop at the 8 users #16 asks for.
MAX_USERS = int(os.environ.get("BENCH_MAX_USERS", "0"))


def _capped(levels: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(c for c in levels if not MAX_USERS or c <= MAX_USERS)


SERIES = {n: s._replace(levels=_capped(s.levels)) for n, s in ALL_SERIES.items() if n in _WANTED}
LOCAL = {n: s._replace(levels=_capped(s.levels)) for n, s in ALL_LOCAL.items() if n in _WANTED}
SERIES = {n: s for n, s in SERIES.items() if s.levels}
LOCAL = {n: s for n, s in LOCAL.items() if s.levels}
COMPLETE = SERIES == ALL_SERIES and LOCAL == ALL_LOCAL


async def _stream(address: str, k: int, user: int, max_tokens: int = TOKENS, started=None) -> dict:
    """User ``user`` streams its own prompt; ``started`` (a future) learns of its first chunk."""
    async with AsyncPipeshardClient(address, timeout_s=600) as client:
        t0 = time.perf_counter()
        arrivals, result = [], GenerateResult()
        responses = client.responses(
            PROMPTS[user % len(PROMPTS)],
            max_tokens=max_tokens,
            ignore_eos=True,
            speculative=SPEC_SOURCE if k else "",
            k=max(k, 0),
        )
        async for response in responses:
            if response.HasField("chunk"):
                arrivals.append((time.perf_counter(), len(response.chunk.token_ids)))
                if started is not None and not started.done():
                    started.set_result(None)
            fold(result, response)
        return {"t0": t0, "arrivals": arrivals, "result": result}


def _first_difference(tokens: list[int], solo: list[int]) -> int:
    return next(
        (i for i, (a, b) in enumerate(zip(tokens, solo, strict=False)) if a != b), min(len(tokens), len(solo))
    )


def run_batch(loop: asyncio.AbstractEventLoop, address: str, c: int, k: int, record: dict) -> float:
    """One round of c concurrent users (user i: prompt i); keeps the streams in ``record``, counts
    those equal to their solo runs and notes where the others first differ."""

    async def batch():
        return await asyncio.gather(*(_stream(address, k, i) for i in range(c)))

    start = time.perf_counter()
    streams = loop.run_until_complete(batch())
    wall = time.perf_counter() - start
    record["streams"] = streams
    for i, stream in enumerate(streams):
        tokens, solo = stream["result"].token_ids, record["solo"][i]
        record["compared"] = record.get("compared", 0) + 1
        if tokens != solo:
            record.setdefault("divergences", set()).add((i, _first_difference(tokens, solo)))
    record["isolated"] = not record.get("divergences")
    return sum(len(s["result"].token_ids) for s in streams) / wall


def ttft_round(loop: asyncio.AbstractEventLoop, address: str, busy: int, record: list) -> float:
    """TTFT of TTFT_PROBES probe requests, one after another, while ``busy`` users decode (they
    start first and are cancelled after the probes); keeps each probe's TTFT (ms) in ``record``,
    returns the round's median."""

    async def probes() -> list[float]:
        started = [loop.create_future() for _ in range(busy)]
        users = [
            asyncio.create_task(_stream(address, 0, i, max_tokens=4 * TOKENS, started=f))
            for i, f in enumerate(started)
        ]
        if users:  # wait until every busy user is decoding (a user failing first raises here)
            ready = asyncio.ensure_future(asyncio.gather(*started))
            await asyncio.wait([ready, *users], return_when=asyncio.FIRST_COMPLETED)
            if not ready.done():
                ready.cancel()
                next(u for u in users if u.done()).result()
                raise RuntimeError("a busy user finished before its first token")
        ttfts = []
        for j in range(TTFT_PROBES):
            probe = await _stream(address, 0, len(PROMPTS) - 1 - j, max_tokens=2)
            ttfts.append((probe["arrivals"][0][0] - probe["t0"]) * 1000)
        for user in users:
            user.cancel()
        await asyncio.gather(*users, return_exceptions=True)
        return ttfts

    ttfts = loop.run_until_complete(probes())
    record.extend(ttfts)
    return median(ttfts)


def stream_stats(streams: list[dict]) -> dict:
    """The last round's streams; speculation counts summed over them."""
    gaps = np.concatenate([np.diff([t for t, _ in s["arrivals"]]) for s in streams]) * 1000
    per_stream = []
    for s in streams:
        (first, _), (last, _) = s["arrivals"][0], s["arrivals"][-1]
        per_stream.append(sum(n for _, n in s["arrivals"][1:]) / (last - first))
    counts = {
        key: sum(getattr(s["result"], key) for s in streams)
        for key in ("verify_steps", "draft_tokens", "accepted_tokens")
    }
    return {
        "per_stream_tok_s": median(per_stream),
        "inter_chunk_ms": {"p50": float(np.percentile(gaps, 50)), "p95": float(np.percentile(gaps, 95))},
        "ttft_ms_under_load": median([(s["arrivals"][0][0] - s["t0"]) * 1000 for s in streams]),
        "ttft_ms_under_load_p95": float(
            np.percentile([(s["arrivals"][0][0] - s["t0"]) * 1000 for s in streams], 95)
        ),
        "spec": {**counts, **spec_stats(counts)},
    }


def best(samples: dict[str, list[float]], names: list[str], over: str) -> dict:
    """The fastest of ``names`` by median, as a ratio over ``over`` with its interval."""
    name = max(names, key=lambda n: median(samples[n]))
    ratio, ci = ratio_ci(samples[name], samples[over])
    return {"ratio": ratio, "ci": ci, "config": name}


def plot(samples: dict[str, list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for prefix, series in [*SERIES.items(), *LOCAL.items()]:
        points = [summary(samples[f"{prefix}_x{c}"]) for c in series.levels]
        mid = [p["median"] for p in points]
        err = [
            [m - p["min"] for m, p in zip(mid, points, strict=True)],
            [p["max"] - m for m, p in zip(mid, points, strict=True)],
        ]
        ax.errorbar(series.levels, mid, yerr=err, marker="o", capsize=3, label=series.label)
    ax.axhline(median(samples["A"]), color="black", linestyle="--", label="LLMPipeline, 1 user")
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel(f"aggregate tok/s (median, min-max; {TOKENS} tokens each)")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(ScalarFormatter())
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _local_round(users: LocalUsers, c: int, rounds: list, record: dict) -> float:
    """One round of c in-process users; keeps its latencies and ANDs its isolation."""
    out = users.run(c)
    rounds.append(out)
    record["isolated"] = record["isolated"] and out.tokens == record["solo"]
    return out.tok_s


def _fleet_name(key: tuple[int, int, bool, str, str]) -> str:
    stages, threads, wan, kv, precision = key
    return f"{stages}s-{threads or 'default'}t-{kv}-{precision}" + ("-wan" if wan else "")


def start(key: tuple[int, int, bool, str, str], shards: Path, run_dir: Path):
    """The stages of one fleet key and its default coordinator (on the WAN emulator or loopback)."""
    stages, threads, wan, kv, precision = key
    stage_args = ["--num-threads", str(threads)] if threads else []
    stage_args += ["--kv", kv]
    extra = [*COORDINATOR_ARGS, "--kv", kv]
    if wan and LATENCY == "hop":
        stage_args += ["--hop-delay-ms", str(WAN_DELAY_MS)]
        extra += ["--hop-delay-ms", str(WAN_DELAY_MS)]
    kwargs = dict(precision=precision, extra_stage_args=stage_args, extra_coordinator_args=extra)
    if wan and LATENCY == "emulator":
        return WanFleet(shards, stages, WAN_DELAY_MS, WAN_RATE_MBIT, run_dir / _fleet_name(key), **kwargs)
    return start_fleet(shards, stages, run_dir / _fleet_name(key), **kwargs)


def add_coordinator(fleet, key: tuple[int, int, bool, str, str], inflight: int, shards: Path) -> str:
    """A second coordinator on the same stages with ``--inflight``; stopped with the fleet."""
    processes = fleet.fleet if isinstance(fleet, WanFleet) else fleet
    doors = (
        [f"{link.root_ip}:{CONTROL_PORT}" for link in fleet.links]
        if isinstance(fleet, WanFleet)
        else fleet.stages
    )
    extra = [*COORDINATOR_ARGS, "--kv", key[3], "--inflight", str(inflight)]
    if key[2] and LATENCY == "hop":
        extra += ["--hop-delay-ms", str(WAN_DELAY_MS)]
    proc = spawn(
        f"coordinator-inflight{inflight}",
        coordinator_args(doors, shards, 0, "json", extra),
        processes.run_dir,
        fleet_env(),
        180.0,
    )
    processes.processes.append(proc)
    return proc.address


def main() -> int:
    set_offline_defaults()
    run_dir = Path("run/bench-mbatch")
    reference = optimum_export(paths.default_model_dir(), paths.shards_dir() / "optimum-int4-reference")
    stage_counts = {s.stages for s in SERIES.values()} | {2} | ({1} if COMPLETE else set())
    shards = {n: ensure_export(n) for n in sorted(stage_counts)}
    prompter = Prompter.from_dir(shards[2])
    ids = prompter.encode("", [("user", PROMPTS[0])])
    genai = GenAIPipeline(reference)
    loop = asyncio.new_event_loop()
    fleets: dict = {}
    doors: dict = {}
    records: dict[str, dict] = {}
    # The WAN emulator is one per machine: each WAN fleet's series form a phase of their own; the
    # loopback series, the in-process ones and the reference ride in the first phase.
    wan_keys = sorted({s.fleet for s in SERIES.values() if s.wan and LATENCY == "emulator"})
    phases: list[dict] = [{"A": lambda: genai.run(ids, TOKENS)["tok_s"]}] + [{} for _ in wan_keys[1:]]

    def phase_of(series: Series) -> dict:
        return phases[wan_keys.index(series.fleet)] if series.fleet in wan_keys else phases[0]

    for prefix, series in SERIES.items():
        for c in series.levels:
            name = f"{prefix}_x{c}"
            records[name] = {}
            phase_of(series)[name] = lambda s=series, c=c, name=name: run_batch(
                loop, doors[s.door], c, s.k, records[name]
            )
    ttft: dict[str, list[float]] = {}
    ttft_series = SERIES.get("2s_paged")
    if ttft_series is not None:
        for name, busy in (("ttft_idle", 0), (f"ttft_busy{TTFT_BUSY}", TTFT_BUSY)):
            ttft[name] = []
            phases[0][name] = lambda busy=busy, name=name: ttft_round(
                loop, doors[ttft_series.door], busy, ttft[name]
            )
    users = {
        n: LocalUsers(shards[2], paged=s.paged, precision=s.precision, threads=s.threads, tokens=TOKENS)
        for n, s in LOCAL.items()
    }
    rounds: dict[str, list] = {}
    for prefix, series in LOCAL.items():
        for c in series.levels:
            name = f"{prefix}_x{c}"
            rounds[name] = []
            records[name] = {"solo": users[prefix].solo_runs(c), "isolated": True}
            phases[0][name] = lambda u=users[prefix], c=c, name=name: _local_round(
                u, c, rounds[name], records[name]
            )
    samples: dict[str, list[float]] = {}
    emulation = None
    solos: dict = {}
    try:
        # Every loopback fleet (the series' own and the WAN series' twins for the solo references).
        loopbacks = {s.loopback for s in SERIES.values()} | {
            s.fleet for s in SERIES.values() if s.fleet not in wan_keys
        }
        for key in sorted(loopbacks):
            fleets[key] = start(key, shards[key[0]], run_dir)
        # Solo references on loopback: the same shards, precision and threads give the same tokens at
        # any delay (the thread count may change the kernels' rounding, so it is part of the key).
        for prefix, series in SERIES.items():
            key = (series.loopback, series.k)
            wanted = max(series.levels)
            have = solos.setdefault(key, [])
            while len(have) < wanted:
                solo = loop.run_until_complete(
                    _stream(fleets[series.loopback].coordinator, series.k, len(have))
                )
                have.append(solo["result"].token_ids)
            for c in series.levels:
                records[f"{prefix}_x{c}"]["solo"] = have
        for index, phase in enumerate(phases):
            wan = wan_keys[index] if index < len(wan_keys) else None
            if wan is not None:
                fleets[wan] = start(wan, shards[wan[0]], run_dir)
                emulation = fleets[wan].emulation
            for series in SERIES.values():
                if series.door in doors or series.fleet not in fleets:
                    continue
                fleet = fleets[series.fleet]
                doors[series.door] = (
                    fleet.coordinator
                    if series.inflight is None
                    else add_coordinator(fleet, series.fleet, series.inflight, shards[series.stages])
                )
            print(f"phase {index + 1}/{len(phases)}: {sorted(phase)}", file=sys.stderr)
            samples |= interleaved(phase, RUNS, warmup=1)
            if wan is not None:
                fleets.pop(wan).stop()  # the next phase's WAN fleet needs the emulator
    finally:
        for fleet in fleets.values():
            fleet.stop()
    # At each divergence from the solo run, the solo run's top-2 logit margin there (teacher-forced
    # through the paged backend in this process at the series' precision).
    divergences = []
    cases: dict[tuple[int, str], list] = {}
    for prefix, series in SERIES.items():
        for c in series.levels:
            for user, at in sorted(records[f"{prefix}_x{c}"].get("divergences", ())):
                solo = records[f"{prefix}_x{c}"]["solo"][user]
                if at >= len(solo):
                    continue
                divergences.append({"config": f"{prefix}_x{c}", "user": user, "position": at})
                prompt = Prompter.from_dir(shards[series.stages]).encode("", [("user", PROMPTS[user])])
                cases.setdefault((series.stages, series.precision), []).append(
                    (prompt, solo, at, divergences[-1])
                )
    for (stages, precision), group in cases.items():
        margins = top2_margins(shards[stages], precision, [(p, s, at) for p, s, at, _ in group[:MAX_MARGINS]])
        for (_, _, _, entry), margin in zip(group, margins, strict=False):
            entry |= margin
    result: dict = {
        "runs": RUNS,
        "tokens": TOKENS,
        "series": list(SERIES),
        "spec_source": DRAFT or SPEC_SOURCE,
        "spec_k": SPEC_K,
        "spec_k_wan": SPEC_K_WAN,
        "emulation": emulation,
        "latency": LATENCY,
        "quick": QUICK,
        "prompts": list(PROMPTS),
        "tok_s": {k: median(v) for k, v in samples.items() if k not in ttft},
        "tok_s_range": {k: summary(v) for k, v in samples.items() if k not in ttft},
        "streams": {name: stream_stats(r["streams"]) for name, r in records.items() if "streams" in r},
        "local_latency": {name: latency(r) for name, r in rounds.items()},
        "local_series": {n: s.label for n, s in LOCAL.items()},
    }
    # The baseline: the thread count per stage that maximises single-stream speed.
    singles = [p for p in ("2s", "2s_1t") if f"{p}_x1" in samples and f"{p}_x2" in samples]
    if singles:
        single = max(singles, key=lambda p: median(samples[f"{p}_x1"]))
        two, two_ci = ratio_ci(samples[f"{single}_x2"], samples[f"{single}_x1"])
        result |= {
            "two_stream_over_single": two,
            "two_stream_over_single_ci": two_ci,
            "two_stream_over_single_config": f"{single}_x2 over {single}_x1 ({SERIES[single].label}: the "
            "faster thread setting with one stream)",
        }
    ratios = {
        "full_stack_over_mono": (
            [f"2s_x{c}" for c in (1, 2, 3, 4)]
            + [f"2s_spec_x{c}" for c in (1, 2, 4)]
            + [
                f"{p}_x{c}"
                for p, s in [*SERIES.items(), *LOCAL.items()]
                if p in LOCAL or ("paged" in p and not s.wan)
                for c in s.levels
            ],
            "A",
        ),
        "full_stack_over_plain_at_50ms": (["wan50_x1", "wan50_x4", "wan50_spec_x4"], "wan50_x1"),
        "best_at_50ms_any_concurrency": (
            [n for n in samples if n.startswith(("wan50_x", "wan50_spec_x"))],
            "wan50_x1",
        ),
        "inflight_gain_2stages_loopback": (["2s_paged_ifn_x8"], "2s_paged_x8"),
        "inflight_gain_3stages_loopback": (["3s_paged_ifn_x8"], "3s_paged_x8"),
        "inflight_gain_3stages_50ms": (["wan50_3s_paged_ifn_x8"], "wan50_3s_paged_x8"),
        "sixteen_users_over_one_at_50ms": (["wan50_3s_paged_x16"], "wan50_3s_paged_x1"),
        "sixteen_users_over_one": (["2s_paged_x16"], "2s_paged_x1"),
    }
    if "wan50_3s_paged_x1" in samples:  # #17: speculation riding in the batch, over one plain user
        ratios["full_stack_over_plain_at_50ms"] = (
            [f"wan50_3s_paged{m}_x{c}" for m in ("", "_spec", "_spec_auto") for c in (1, 2, 3, 4)],
            "wan50_3s_paged_x1",
        )
    # The ratios on the paged 2-stage fleet in exact mode, else on the in-process paged ring.
    for key, users in (("four_users_over_one", 4), ("eight_users_over_one", 8)):
        for prefix in ("2s_paged_exact", "local_exact"):
            if f"{prefix}_x{users}" in samples and f"{prefix}_x1" in samples:
                ratios[key] = ([f"{prefix}_x{users}"], f"{prefix}_x1")
                break
        for prefix in ("2s_paged", "local_default"):
            if f"{prefix}_x{users}" in samples and f"{prefix}_x1" in samples:
                ratios[f"{key}_default"] = ([f"{prefix}_x{users}"], f"{prefix}_x1")
                break
    singles = [n for n in samples if n.endswith("_x1") and n != "A"]
    if singles:
        ratios["four_users_over_best_single"] = (
            [n for n in samples if n.endswith("_x4")],
            max(singles, key=lambda n: median(samples[n])),
        )
    for key, (names, over) in ratios.items():
        present = [n for n in names if n in samples]
        if present and over in samples:
            top = best(samples, present, over)
            result |= {
                key: top["ratio"],
                f"{key}_ci": top["ci"],
                f"{key}_config": f"{top['config']} over {over}",
            }
    isolation = {name: record["isolated"] for name, record in records.items()}
    must = {f"{p}_x{c}" for p, s in SERIES.items() if s.isolated for c in s.levels} | set(rounds)
    result |= {
        "isolation": isolation,
        "isolation_ok": all(isolation[n] for n in must),
        "isolation_ok_covers": sorted(must),
        "agreement": {
            name: 1 - len(r.get("divergences", ())) / r["compared"]
            for name, r in records.items()
            if r.get("compared")
        },
        "divergences": divergences,
        "max_margin_at_divergence": max(
            (d["top2_margin"] for d in divergences if "top2_margin" in d), default=None
        ),
        # The prompt set's repetition rate: of each solo set at the default precision (every one
        # the speculative figures compare with among them).
        "prompt_repetition": {
            f"{_fleet_name(key)}-k{k}": repetition(tokens)
            for (key, k), tokens in solos.items()
            if key[4] == "default"
        },
    }
    if ttft:
        ttft = {name: v[-RUNS * TTFT_PROBES :] for name, v in ttft.items()}  # the warm-up round's out
        busy = ttft[f"ttft_busy{TTFT_BUSY}"]
        ratio, ci = ratio_ci(samples[f"ttft_busy{TTFT_BUSY}"], samples["ttft_idle"])
        result |= {
            "ttft_ms": {
                name: {"p50": float(np.percentile(v, 50)), "p95": float(np.percentile(v, 95)), "n": len(v)}
                for name, v in ttft.items()
            },
            "ttft_p95_loaded_over_idle": float(np.percentile(busy, 95)) / median(ttft["ttft_idle"]),
            "ttft_p95_loaded_over_idle_config": f"{TTFT_PROBES} probes a round on 2s_paged: p95 with "
            f"{TTFT_BUSY} users decoding over the idle median",
            "ttft_median_loaded_over_idle": ratio,
            "ttft_median_loaded_over_idle_ci": ci,
        }
    exact_2t = {}
    for c in SERIES.get("2s_paged_exact_2t", Series("", 0, 0, False, ())).levels:
        if f"2s_paged_exact_x{c}" in samples:
            r, ci = ratio_ci(samples[f"2s_paged_exact_2t_x{c}"], samples[f"2s_paged_exact_x{c}"])
            exact_2t[str(c)] = {"ratio": r, "ci": ci}
    if exact_2t:
        result["paged_exact_2t_over_1t"] = exact_2t
    if COMPLETE:
        result["stacking"] = stacking.measure(shards[1], ids, RUNS)
        plot_path = Path("docs/img/bench-mbatch.png")
        plot(samples, plot_path)
        result["plot"] = str(plot_path)
    elif LOCAL:
        plot_path = Path("docs/img/bench-mbatch-subset.png")
        plot(samples, plot_path)
        result["plot"] = str(plot_path)
    knobs = (
        "BENCH_QUICK",
        "BENCH_LATENCY",
        "BENCH_SERIES",
        "BENCH_MAX_USERS",
        "BENCH_DRAFT",
        "BENCH_SPEC_K",
        "BENCH_SPEC_K_WAN",
        "BENCH_RUNS",
        "BENCH_TOKENS",
    )
    command = " ".join(f"{k}={os.environ[k]}" for k in knobs if k in os.environ)
    write_result("mbatch" if COMPLETE else "mbatch-subset", result, f"{command} make bench-mbatch".strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
