"""`make bench-deploy`: what containers cost, from nothing to the first token and while decoding.

From nothing to the first token through the compose fleet's gateway (2 stages, mutual TLS):
``images_s``: both images built from the wheelhouse with the base image cached (skipped with
BENCH_QUICK=1, which reuses the images); ``cold_first_token_s``: `up` with no export volume (the
exporter container fetches the model and exports, every stage pulls its shard over FetchShard);
``cached_first_token_s``: `up` again with the images and the exporter's volume kept (the stage and
coordinator containers are new and empty: they pull again). Then decode rate, both fleets up at
once on the same export: the compose fleet and `pipeshard up --secure` (plain processes on the
default ports, so under the default-ports lock, taken once the compose fleet is up), 1 and 8
users each streaming a greedy request of BENCH_TOKENS (64) tokens, BENCH_RUNS (10) rounds
interleaved fleet by fleet; generated
tokens per second of wall time per round, the ratio of medians compose over processes with a 95%
interval. A noisy shared machine moves these figures; read the ratio, measured side by side.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

from bench.stats import command_with_knobs, median, ratio_ci, write_result

DOCKER = Path(__file__).resolve().parents[1] / "docker"
sys.path.append(str(DOCKER))
from fleet import ComposeFleet  # noqa: E402  (docker/ holds host tooling, imported by plain name)

KNOBS = ("BENCH_QUICK", "BENCH_RUNS", "BENCH_TOKENS")
PROMPT = "Write a short story about a lighthouse keeper."
USERS = (1, 8)
IMAGES = ("pipeshard:latest", "pipeshard-exporter:latest")
PORT_LOCK = Path("/tmp/pipeshard-default-ports.lock")


def first_token_s(base_url: str, key: str, started: float, timeout_s: float = 600) -> float:
    """Seconds from ``started`` to the first streamed token (retrying while the gateway is not up)."""
    deadline = time.monotonic() + timeout_s
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0, timeout=120) as client:
        while True:
            try:
                stream = client.chat.completions.create(
                    model="any", messages=[{"role": "user", "content": PROMPT}], max_tokens=4, stream=True
                )
                for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        stream.close()
                        return time.monotonic() - started
            except openai.APIConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)


def round_rate(base_url: str, key: str, users: int, tokens: int) -> float:
    """Generated tokens per second of wall time, ``users`` streams at once."""

    def one(_: int) -> int:
        with openai.OpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0, timeout=600) as client:
            reply = client.chat.completions.create(
                model="any",
                messages=[{"role": "user", "content": PROMPT}],
                max_tokens=tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            return next(c.usage.completion_tokens for c in reply if c.usage is not None)

    start = time.monotonic()
    with ThreadPoolExecutor(users) as pool:
        total = sum(pool.map(one, range(users)))
    return total / (time.monotonic() - start)


def build_images() -> float:
    subprocess.run(["docker", "rmi", "-f", *IMAGES], capture_output=True, check=False)
    start = time.monotonic()
    subprocess.run(["bash", str(DOCKER / "build-images.sh")], check=True)
    return time.monotonic() - start


def main() -> None:
    quick = bool(os.environ.get("BENCH_QUICK"))
    runs = int(os.environ.get("BENCH_RUNS", "10"))
    tokens = int(os.environ.get("BENCH_TOKENS", "64"))
    result: dict = {"stages": 2, "secure": True, "tokens": tokens, "runs": runs}
    if not quick:
        result["images_s"] = round(build_images(), 1)
    folder = Path(tempfile.mkdtemp(prefix="bench-deploy-"))
    fleet = ComposeFleet(folder, 2)
    up = [sys.executable, "-m", "pipeshard.cli"]
    lock = PORT_LOCK.open("a")
    try:
        start = time.monotonic()
        fleet.up()
        result["cold_first_token_s"] = round(first_token_s(fleet.gateway, fleet.token, start), 1)
        fleet.down(volumes=False)
        start = time.monotonic()
        fleet.up()
        result["cached_first_token_s"] = round(first_token_s(fleet.gateway, fleet.token, start), 1)
        export = Path("shards") / fleet.spec.export
        if not (export / "manifest.json").exists():
            source = f"{fleet.container('exporter')}:/app/data/shards/{fleet.spec.export}"
            export.parent.mkdir(exist_ok=True)
            subprocess.run(["docker", "cp", source, str(export)], check=True)
        fcntl.flock(lock, fcntl.LOCK_EX)  # held until `pipeshard down` below
        subprocess.run([*up, "up", "--stages", "2", "--secure"], check=True, stdout=subprocess.DEVNULL)
        plain_key = Path("certs/token").read_text().strip()
        fleets = {"compose": (fleet.gateway, fleet.token), "processes": ("http://127.0.0.1:8080", plain_key)}
        for base, key in fleets.values():
            round_rate(base, key, 1, 8)  # warm-up: compiled kernels, first sessions
        for users in USERS:
            rates: dict[str, list[float]] = {name: [] for name in fleets}
            for _ in range(runs):
                for name, (base, key) in fleets.items():
                    rates[name].append(round_rate(base, key, users, tokens))
            ratio, (low, high) = ratio_ci(rates["compose"], rates["processes"])
            result[f"users_{users}"] = {
                "compose_tok_s": round(median(rates["compose"]), 2),
                "processes_tok_s": round(median(rates["processes"]), 2),
                "compose_over_processes": round(ratio, 3),
                "ci95": [round(low, 3), round(high, 3)],
            }
    finally:
        subprocess.run([*up, "down"], check=False, stdout=subprocess.DEVNULL)
        lock.close()
        fleet.down()
        shutil.rmtree(folder, ignore_errors=True)
    write_result("deploy", result, command_with_knobs("bench-deploy", KNOBS))


if __name__ == "__main__":
    main()
