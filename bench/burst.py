"""`python -m bench.burst`: a burst of long prompts from one client, all at once (issue #28's check).

BURST_CLIENTS (24) concurrent clients each send a distinct prompt of about BURST_PROMPT_TOKENS
(2600) tokens with the default max_tokens to a default 2-stage fleet (paged stages, 256 MiB KV
pools, default coordinator flags) on ephemeral loopback ports. Every request should complete:
the ones the stages' KV share cannot hold yet wait in the coordinator's queue. Prints how many
completed, how many failed and with which status, the wall time and the time to first token
(queue wait included) at p50 and max.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from bench.stats import median
from pipeshard.clients.client import PipeshardClient
from pipeshard.offline import set_offline_defaults
from pipeshard.services.launcher import start_fleet

CLIENTS = int(os.environ.get("BURST_CLIENTS", "24"))
PROMPT_TOKENS = int(os.environ.get("BURST_PROMPT_TOKENS", "2600"))


def _prompt(i: int) -> str:
    # Each "wN" is about 3.9 tokens; the client's index keeps the prompts distinct.
    return f"Client {i}. Summarise: " + " ".join(f"w{n}" for n in range(PROMPT_TOKENS * 10 // 39))


def _one(address: str, i: int) -> tuple[str, int, float]:
    """(outcome, prompt tokens, seconds to the first token)."""
    started = time.perf_counter()
    first = None
    try:
        with PipeshardClient(address, timeout_s=1800) as client:
            for response in client.responses(_prompt(i)):
                if first is None and response.HasField("chunk"):
                    first = time.perf_counter() - started
                if response.HasField("summary"):
                    return "ok", response.summary.prompt_tokens, first or 0.0
    except grpc.RpcError as exc:
        return f"{exc.code().name}: {exc.details()[:160]}", 0, 0.0
    return "no summary", 0, 0.0


def main() -> int:
    set_offline_defaults()
    shards = Path(os.environ["BURST_SHARDS"])
    fleet = start_fleet(shards, 2, Path(tempfile.mkdtemp(prefix="pipeshard-burst-")))
    try:
        started = time.perf_counter()
        with ThreadPoolExecutor(CLIENTS) as pool:
            results = list(pool.map(lambda i: _one(fleet.coordinator, i), range(CLIENTS)))
        wall = time.perf_counter() - started
    finally:
        fleet.stop()
    outcomes = Counter(outcome for outcome, _, _ in results)
    ttfts = sorted(t for outcome, _, t in results if outcome == "ok")
    tokens = [n for outcome, n, _ in results if outcome == "ok"]
    print(f"clients {CLIENTS}, prompt tokens {min(tokens, default=0)}..{max(tokens, default=0)}")
    for outcome, count in outcomes.most_common():
        print(f"{count:3d}  {outcome}")
    if ttfts:
        print(f"wall {wall:.1f} s, ttft p50 {median(ttfts):.1f} s, max {ttfts[-1]:.1f} s")
    return 0 if outcomes == Counter({"ok": CLIENTS}) else 1


if __name__ == "__main__":
    raise SystemExit(main())
