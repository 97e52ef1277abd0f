"""`make bench-prefix`: time to first token of a chat's next turn, warm (prefix cache) against cold.

Per KV backend (BENCH_KV: ``stateful`` and ``paged``, the paged stages at one thread each), two
2-stage INT4 loopback fleets on the same shards: ``warm`` (prefix caching on, the default) and
``cold`` (``--prefix-cache off``). Each round and history length H builds a conversation of its
own (a first user message of about H tokens, unique per round, so no round hits another's cache),
runs its first turn on the warm fleet (untimed: it leaves the history in the stages' caches), then
times the next turn (the history, the assistant's reply, a new message of about 30 tokens) on
both fleets, in random order, back to back. TTFT is client wall time from the call to the first
token. ``identical``: every turn answered the same tokens on both fleets (``identical_turns``: how
many did; at the default precision a warm suffix may round differently at a near-tie).

Shared system prompt (on the last backend listed, paged by default: it batches the users): 8
users at once, each with the same system prompt of about 512 tokens and a message of its own,
REPLY_TOKENS x 2 tokens each; aggregate tok/s (every user's tokens over the wall time of the
round) on the warm fleet, where the prompt is kept once and restored for every user, against
the cold one, where every user prefills it.

Then, in this process (for each backend listed), capture and restore per stage at each H:
``export_kv``/``import_kv`` of a blob with its checksum (what CaptureKv/RestoreKv send over the
wire to move a session) and the prefix-cache path (keep into / restore from the stage's block
store), with the bytes per stage.

Knobs (environment): BENCH_RUNS (rounds, default 10), BENCH_WARMUP (default 1), BENCH_LENGTHS
(default 256,1024,2048), BENCH_PRECISION (default exact), BENCH_KV_REPS (default 5), BENCH_SHARDS
(a 2-stage INT4 export to use; default shards/<model>-2s-int4, exported when missing), BENCH_KV
(default stateful,paged), BENCH_USERS (default 8; 0 skips the shared-prompt figure), BENCH_KV_REPS=0
skips the capture/restore costs, BENCH_PAGED_THREADS (a paged stage's --num-threads, default 1;
0: all cores, what `make up` runs).
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from bench.stats import command_with_knobs, median, ratio_ci, summary, write_result
from pipeshard import paths
from pipeshard.clients.client import PipeshardClient
from pipeshard.offline import set_offline_defaults
from pipeshard.services.launcher import start_fleet
from pipeshard.services.stage.kv import StageKv
from pipeshard.services.stage.paged_engine import PagedEngine
from pipeshard.services.stage.prefix_store import PrefixStore
from pipeshard.services.stage.sessions import SessionTable
from pipeshard.shard.paged import PagedRow, PagedShard
from pipeshard.shard.prompting import Prompter
from pipeshard.shard.runtime import ShardRunner, export_kv, import_kv

RUNS = int(os.environ.get("BENCH_RUNS", "10"))
WARMUP = int(os.environ.get("BENCH_WARMUP", "1"))
LENGTHS = [int(n) for n in os.environ.get("BENCH_LENGTHS", "256,1024,2048").split(",")]
PRECISION = os.environ.get("BENCH_PRECISION", "exact")
KV_REPS = int(os.environ.get("BENCH_KV_REPS", "5"))
BACKENDS = os.environ.get("BENCH_KV", "stateful,paged").split(",")
USERS = int(os.environ.get("BENCH_USERS", "8"))
SYSTEM_TOKENS = 512
# Paged stages at one thread by default: two stage processes share this machine's two cores.
PAGED_THREADS = os.environ.get("BENCH_PAGED_THREADS", "1")
STAGE_ARGS = {"stateful": ["--kv", "stateful"], "paged": ["--kv", "paged", "--num-threads", PAGED_THREADS]}
NEW_MESSAGE = "Thanks. Now summarise all of that in one short sentence, and tell me which part matters most."
REPLY_TOKENS = 16


def ensure_export(stages: int) -> Path:
    from pipeshard.exporter.export import export_model

    out = paths.shards_dir() / paths.export_name(paths.DEFAULT_MODEL, stages, "int4")
    if not (out / "manifest.json").exists():
        export_model(paths.default_model_dir(), out, stages=stages, weights="int4")
    return out


def history(prompter: Prompter, length: int, nonce: str) -> str:
    """A first user message whose chat-templated prompt is about ``length`` tokens."""
    words = [
        "the",
        "river",
        "carries",
        "stones",
        "and",
        "sand",
        "down",
        "to",
        "the",
        "sea",
        "while",
        "the",
        "town",
        "sleeps",
    ]
    text = f"Conversation {nonce}. Remember these notes:"
    rng = random.Random(nonce)
    while len(prompter.encode("", [("user", text)])) < length:
        text += " " + " ".join(rng.choice(words) for _ in range(16))
    return text


def turn(address: str, messages: list[dict], max_tokens: int) -> tuple[float, list[int], str]:
    """(TTFT ms, token ids, text) of one request."""
    tokens: list[int] = []
    text: list[str] = []
    ttft = 0.0
    with PipeshardClient(address, timeout_s=600) as client:
        t0 = time.perf_counter()
        for response in client.responses(messages=messages, max_tokens=max_tokens, ignore_eos=True):
            if response.HasField("chunk"):
                if not ttft:
                    ttft = (time.perf_counter() - t0) * 1000.0
                tokens.extend(response.chunk.token_ids)
                text.append(response.chunk.text)
    return ttft, tokens, "".join(text)


def chat_rounds(warm: str, cold: str, prompter: Prompter) -> tuple[dict[str, list[float]], list[bool], dict]:
    """TTFT samples per config and length, whether each turn (warm-up rounds too) answered alike
    on both fleets, and the prompt length per history length."""
    rng = random.Random(0)
    samples: dict[str, list[float]] = {f"{c}@{n}": [] for n in LENGTHS for c in ("warm", "cold")}
    identical: list[bool] = []
    prompt_tokens: dict[int, int] = {}
    for r in range(WARMUP + RUNS):
        lengths = list(LENGTHS)
        rng.shuffle(lengths)
        for n in lengths:
            messages = [{"role": "user", "content": history(prompter, n, f"{r}-{n}")}]
            _, _, reply = turn(warm, messages, REPLY_TOKENS)  # the first turn: fills the warm caches
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": NEW_MESSAGE}]
            prompt_tokens[n] = len(prompter.encode("", [(m["role"], m["content"]) for m in messages]))
            got = {}
            for config in rng.sample(["warm", "cold"], 2):
                ttft, tokens, _ = turn(warm if config == "warm" else cold, messages, REPLY_TOKENS)
                got[config] = tokens
                if r >= WARMUP:
                    samples[f"{config}@{n}"].append(ttft)
            identical.append(got["warm"] == got["cold"])
        print(
            f"round {r + 1}/{WARMUP + RUNS}: "
            + ", ".join(f"{k}={v[-1]:.1f}" for k, v in sorted(samples.items()) if v),
            file=sys.stderr,
        )
    return samples, identical, prompt_tokens


def shared_prompt_rounds(warm: str, cold: str, prompter: Prompter) -> tuple[dict[str, list[float]], bool]:
    """Aggregate tok/s of USERS simultaneous users whose prompts start with one system prompt."""
    system = history(prompter, SYSTEM_TOKENS, "system")
    rng = random.Random(1)
    samples: dict[str, list[float]] = {"shared": [], "unshared": []}
    identical = True
    tokens_each = 2 * REPLY_TOKENS

    def users(address: str, r: int) -> tuple[float, list[list[int]]]:
        out: list[list[int]] = [[] for _ in range(USERS)]

        def one(i: int) -> None:
            messages = [
                {"role": "system", "content": system},
                {"role": "user", "content": f"I am user {i} of round {r}. {NEW_MESSAGE}"},
            ]
            out[i] = turn(address, messages, tokens_each)[1]

        threads = [threading.Thread(target=one, args=(i,)) for i in range(USERS)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return sum(map(len, out)) / (time.perf_counter() - t0), out

    for r in range(WARMUP + RUNS):
        got = {}
        for config in rng.sample(["shared", "unshared"], 2):
            tok_s, got[config] = users(warm if config == "shared" else cold, r)
            if r >= WARMUP:
                samples[config].append(tok_s)
        identical = identical and got["shared"] == got["unshared"]
        print(
            f"users round {r + 1}/{WARMUP + RUNS}: "
            + ", ".join(f"{k}={v[-1]:.1f}" for k, v in samples.items() if v),
            file=sys.stderr,
        )
    return samples, identical


KV_STEPS = ("capture", "restore", "keep", "restore_cached")


def record(times: dict[str, list[float]], *stamps: float) -> None:
    """Each step's ms from the perf_counter stamps taken before, between and after KV_STEPS."""
    for key, a, b in zip(KV_STEPS, stamps[:-1], stamps[1:], strict=True):
        times[key].append((b - a) * 1000.0)


def kv_costs(export: Path) -> dict:
    """Per stage and length: capture/restore ms (blob with checksum; prefix-cache keep/restore) and bytes."""
    out: dict = {}
    for stage in range(2):
        runner = ShardRunner(export, stage, PRECISION)
        runner.warmup()
        sessions = SessionTable(runner.new_session, 4, float("inf"))
        kv = StageKv(sessions, runner.kv_source, PrefixStore(4 << 30))
        for n in LENGTHS:
            times: dict[str, list[float]] = {k: [] for k in KV_STEPS}
            for rep in range(KV_REPS):
                src = sessions.open("bench", f"src{rep}")
                x = (
                    np.arange(n, dtype=np.int64).reshape(1, n) % 1000 + rep
                    if runner.is_first
                    else np.random.default_rng(rep)
                    .standard_normal((1, n, runner.hidden_size))
                    .astype(np.float32)
                )
                src.run(x)
                ids = [rep] * n  # the key only; the KV is whatever the run left
                t0 = time.perf_counter()
                blob = export_kv(src)
                t1 = time.perf_counter()
                dst = runner.new_session()
                import_kv(dst, blob)
                t2 = time.perf_counter()
                kv.keep("bench", f"src{rep}", f"s{n}", ids)
                t3 = time.perf_counter()
                kv.restore_cached("bench", f"dst{rep}", f"s{n}", ids, n)
                t4 = time.perf_counter()
                record(times, t0, t1, t2, t3, t4)
                sessions.release("bench", f"src{rep}")
                sessions.release("bench", f"dst{rep}")
            out[f"stage{stage}@{n}"] = {
                "bytes": blob.nbytes,
                **{f"{k}_ms": statistics.median(v) for k, v in times.items()},
            }
    return out


def paged_kv_costs(export: Path) -> dict:
    """The same per stage on a paged stage, through StageKv (what CaptureKv/RestoreKv run):
    capture/restore of a checked blob, keep/restore_cached of the prefix cache's blocks."""
    out: dict = {}
    for stage in range(2):
        shard = PagedShard(export, stage, PRECISION, 1)
        engine = PagedEngine(shard, 2 * KV_REPS + 2, float("inf"))
        kv = StageKv.paged(engine, PrefixStore(4 << 30, layout=engine.shard.kv_source.blocks))
        for n in LENGTHS:
            times: dict[str, list[float]] = {k: [] for k in KV_STEPS}
            for rep in range(KV_REPS):
                engine.open("bench", f"src{rep}", n)
                x = (
                    np.arange(n, dtype=np.int64) % 1000 + rep
                    if shard.is_first
                    else np.random.default_rng(rep).standard_normal((n, shard.hidden_size)).astype(np.float32)
                )
                shard.step([PagedRow(engine.sessions.get("bench", f"src{rep}").key, x)])
                ids = [rep] * n
                t0 = time.perf_counter()
                blob = kv.capture("bench", f"src{rep}", ids)
                t1 = time.perf_counter()
                kv.restore("bench", f"dst{rep}", blob)
                t2 = time.perf_counter()
                kv.keep("bench", f"src{rep}", f"s{n}", ids)
                t3 = time.perf_counter()
                kv.restore_cached("bench", f"dst{rep}", f"s{n}", ids, n)
                t4 = time.perf_counter()
                record(times, t0, t1, t2, t3, t4)
                engine.sessions.release("bench", f"src{rep}")
                engine.sessions.release("bench", f"dst{rep}")
            out[f"stage{stage}@{n}"] = {
                "bytes": blob.nbytes,
                **{f"{k}_ms": statistics.median(v) for k, v in times.items()},
            }
    return out


def main() -> int:
    set_offline_defaults()
    started = time.perf_counter()
    export = Path(os.environ["BENCH_SHARDS"]) if "BENCH_SHARDS" in os.environ else ensure_export(2)
    prompter = Prompter.from_dir(export)
    runs_dir = Path(tempfile.mkdtemp(prefix="bench-prefix-"))
    result: dict = {
        "runs": RUNS,
        "precision": PRECISION,
        "lengths": LENGTHS,
        "baseline": "cold: the same turn on a 2-stage fleet with --prefix-cache off",
        "tok_s": {},
    }
    for backend in BACKENDS:
        warm = start_fleet(
            export,
            2,
            runs_dir / f"warm-{backend}",
            precision=PRECISION,
            extra_stage_args=STAGE_ARGS[backend],
            extra_coordinator_args=["--kv", backend, "--prefix-cache", "on"],
        )
        try:
            cold = start_fleet(
                export,
                2,
                runs_dir / f"cold-{backend}",
                precision=PRECISION,
                extra_stage_args=STAGE_ARGS[backend],
                extra_coordinator_args=["--kv", backend, "--prefix-cache", "off"],
            )
            try:
                samples, identical, prompt_tokens = chat_rounds(warm.coordinator, cold.coordinator, prompter)
                users = None
                if USERS and backend == BACKENDS[-1]:
                    users = shared_prompt_rounds(warm.coordinator, cold.coordinator, prompter)
            finally:
                cold.stop()
        finally:
            warm.stop()
        series: dict = {
            "prompt_tokens": {str(n): prompt_tokens[n] for n in LENGTHS},
            "ttft_ms": {k: median(v) for k, v in samples.items()},
            "ttft_ms_range": {k: summary(v) for k, v in samples.items()},
            "identical": all(identical),
            "identical_turns": f"{sum(identical)}/{len(identical)}",
        }
        for n in LENGTHS:
            ratio, ci = ratio_ci(samples[f"cold@{n}"], samples[f"warm@{n}"])
            series[f"warm_speedup_{n}"] = ratio
            series[f"warm_speedup_{n}_ci"] = ci
        if users is not None:
            user_samples, user_identical = users
            ratio, ci = ratio_ci(user_samples["shared"], user_samples["unshared"])
            result["tok_s"] = {f"{k}_{backend}": median(v) for k, v in user_samples.items()}
            result["shared_system_prompt"] = {
                "backend": backend,
                "users": USERS,
                "system_prompt_tokens": SYSTEM_TOKENS,
                "tokens_per_user": 2 * REPLY_TOKENS,
                "tok_s": {k: median(v) for k, v in user_samples.items()},
                "tok_s_range": {k: summary(v) for k, v in user_samples.items()},
                "speedup": ratio,
                "speedup_ci": ci,
                "identical": user_identical,
            }
        result[backend] = series
    # The headline keys: the first backend's (the shared JSON shape), each backend's in its series.
    head = result[BACKENDS[0]]
    result.update({k: v for k, v in head.items() if k.startswith("warm_speedup_") or k == "identical"})
    result["identical"] = all(result[b]["identical"] for b in BACKENDS) and result.get(
        "shared_system_prompt", {}
    ).get("identical", True)
    if KV_REPS:
        result["kv_per_stage"] = kv_costs(export)
        if "paged" in BACKENDS:
            result["kv_per_stage_paged"] = paged_kv_costs(export)
    result["goals"] = {"warm_speedup_1024": 15.0}
    result["seconds"] = round(time.perf_counter() - started, 1)
    knobs = (
        "BENCH_RUNS",
        "BENCH_WARMUP",
        "BENCH_LENGTHS",
        "BENCH_PRECISION",
        "BENCH_PAGED_THREADS",
        "BENCH_KV_REPS",
        "BENCH_SHARDS",
        "BENCH_KV",
        "BENCH_USERS",
    )
    write_result("prefix", result, command=command_with_knobs("bench-prefix", knobs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
