"""`make bench-gateway`: the OpenAI gateway against the gRPC client, 1 and 8 concurrent users.

One 2-stage INT4 fleet with its gateway; each round runs four configurations in shuffled order:
N users (1 or 8) streaming the same greedy request (64 tokens, eos ignored) at once, either with
the async gRPC client straight to the coordinator or with the official `openai` async client
through the gateway. Per configuration and round: aggregate tok/s (all users' tokens over the
round's wall time) and the median client-side time to first token. Goal: the gateway costs at
most 5% throughput and 5 ms TTFT at 8 users.

Structured outputs: a third path sends the same request through the gateway with a JSON schema
(one long string field, so every user writes the whole 64 tokens inside the JSON):
``schema_over_plain_{1user,8users}`` is its tok/s over the plain gateway's (goal >= 0.9), its
TTFT the first-token time of a schema request (compiled once, then cached). ``grammar`` times the
engine alone on the tokenizer: a schema's compile, and the mask plus advance per token.

Top logprobs: a fourth path asks for ``logprobs`` with ``top_logprobs: 20`` (the final stage then
returns its logits for the coordinator to rank): ``top_logprobs_over_plain_{1user,8users}`` is
its cost as tok/s over the plain gateway's.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import openai

from bench.stats import difference_ci, interleaved, ratio_ci, summary, write_result
from pipeshard import paths
from pipeshard.clients.client import AsyncPipeshardClient
from pipeshard.offline import set_offline_defaults
from pipeshard.services.launcher import start_fleet

PROMPT = "Explain in a few paragraphs how a bicycle works."
TOKENS = int(os.environ.get("BENCH_TOKENS", "64"))
RUNS = int(os.environ.get("BENCH_RUNS", "10"))
WARMUP = 2
USERS = (1, 8)
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "minLength": 2000}},
    "required": ["answer"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}


async def _grpc_user(address: str) -> tuple[float, int]:
    async with AsyncPipeshardClient(address) as client:
        t0 = time.perf_counter()
        ttft, tokens = None, 0
        async for response in client.responses(PROMPT, max_tokens=TOKENS, ignore_eos=True):
            if response.HasField("chunk"):
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                tokens += len(response.chunk.token_ids)
        return ttft * 1000, tokens


# What each gateway path adds to the plain request.
EXTRA: dict[str, dict] = {
    "gateway": {},
    "schema": {"response_format": FORMAT},
    "logprobs": {"logprobs": True, "top_logprobs": 20},
}


async def _gateway_user(api: openai.AsyncOpenAI, path: str) -> tuple[float, int]:
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    stream = await api.chat.completions.create(
        model="any",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=TOKENS,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, **EXTRA[path]},
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content and ttft is None:
            ttft = time.perf_counter() - t0
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return ttft * 1000, tokens


def _grammar_cost(shards: Path) -> dict:
    """The engine alone: a schema's compile (cold, then cached) and mask + advance per token over
    a valid answer's tokens."""
    from pipeshard.services.coordinator.grammar import Grammars, GrammarSpec
    from pipeshard.shard.prompting import Prompter

    prompter = Prompter.from_dir(shards)
    vocab = len(prompter.tokenizer)
    engine = Grammars(prompter.tokenizer, vocab, prompter.eos_ids)
    engine.prepare()
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}},
            "address": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
        "required": ["name", "age", "tags", "address"],
        "additionalProperties": False,
    }
    spec = GrammarSpec("json_schema", json.dumps(schema))
    t0 = time.perf_counter()
    engine.compile(spec)
    compile_ms = (time.perf_counter() - t0) * 1000
    t0 = time.perf_counter()
    engine.compile(spec)
    cached_ms = (time.perf_counter() - t0) * 1000
    answer = '{"name": "Ann Lee", "age": 42, "tags": ["a", "c"], "address": {"city": "Paris"}}'
    ids = prompter.tokenizer.encode(answer, add_special_tokens=False) + sorted(prompter.eos_ids)[:1]
    logits = np.random.default_rng(0).standard_normal(vocab).astype(np.float32)
    per_token = []
    for _ in range(5):
        constraint = engine.constraint(spec)
        t0 = time.perf_counter()
        for token in ids:
            constraint.masked(logits)
            constraint.consume(token)
        per_token.append((time.perf_counter() - t0) * 1000 / len(ids))
    return {
        "engine": "llguidance",
        "compile_ms": compile_ms,
        "compile_cached_ms": cached_ms,
        "mask_ms_per_token": summary(per_token),
    }


def main() -> int:
    set_offline_defaults()
    shards = paths.shards_dir() / paths.export_name(paths.DEFAULT_MODEL, 2, "int4")
    if not (shards / "manifest.json").exists():
        from pipeshard.exporter.export import export_model

        export_model(paths.default_model_dir(), shards, stages=2, weights="int4")
    fleet = start_fleet(shards, 2, Path(tempfile.mkdtemp(prefix="bench-gateway-")), gateway_port=0)
    loop = asyncio.new_event_loop()
    api = openai.AsyncOpenAI(base_url=f"http://{fleet.gateway}/v1", api_key="unused", max_retries=0)
    ttfts: dict[str, list[float]] = {}

    def config(name: str, users: int):
        def run() -> float:
            async def one_round():
                if name.startswith("grpc"):
                    return await asyncio.gather(*(_grpc_user(fleet.coordinator) for _ in range(users)))
                path = name.rsplit("_", 1)[0]
                return await asyncio.gather(*(_gateway_user(api, path) for _ in range(users)))

            start = time.perf_counter()
            results = loop.run_until_complete(one_round())
            wall = time.perf_counter() - start
            if {tokens for _, tokens in results} != {TOKENS}:
                raise RuntimeError(f"{name}: expected {TOKENS} tokens per user, got {results}")
            ttfts.setdefault(name, []).append(statistics.median(t for t, _ in results))
            return users * TOKENS / wall

        return run

    try:
        paths_ = ("grpc", "gateway", "schema", "logprobs")
        configs = {f"{path}_{u}": config(f"{path}_{u}", u) for path in paths_ for u in USERS}
        samples = interleaved(configs, RUNS, WARMUP)
    finally:
        loop.run_until_complete(api.close())
        loop.close()
        fleet.stop()
    ttft = {name: values[WARMUP:] for name, values in ttfts.items()}
    result: dict = {"tokens": TOKENS, "runs": RUNS, "warmup": WARMUP, "stages": 2, "weights": "int4"}
    result["tok_s"] = {name: summary(values) for name, values in samples.items()}
    result["ttft_ms"] = {name: summary(values) for name, values in ttft.items()}
    for u in USERS:
        suffix = "user" if u == 1 else "users"
        ratio, ci = ratio_ci(samples[f"gateway_{u}"], samples[f"grpc_{u}"])
        result[f"gateway_over_grpc_{u}{suffix}"] = ratio
        result[f"gateway_over_grpc_{u}{suffix}_ci95"] = ci
        overhead, ci = difference_ci(ttft[f"gateway_{u}"], ttft[f"grpc_{u}"])
        key = "gateway_ttft_overhead_ms" if u == 8 else "gateway_ttft_overhead_ms_1user"
        result[key] = overhead
        result[f"{key}_ci95"] = ci
        ratio, ci = ratio_ci(samples[f"schema_{u}"], samples[f"gateway_{u}"])
        result[f"schema_over_plain_{u}{suffix}"] = ratio
        result[f"schema_over_plain_{u}{suffix}_ci95"] = ci
        ratio, ci = ratio_ci(samples[f"logprobs_{u}"], samples[f"gateway_{u}"])
        result[f"top_logprobs_over_plain_{u}{suffix}"] = ratio
        result[f"top_logprobs_over_plain_{u}{suffix}_ci95"] = ci
    result["grammar"] = _grammar_cost(shards)
    write_result("gateway", result, command=f"make bench-gateway  # BENCH_RUNS={RUNS} BENCH_TOKENS={TOKENS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
