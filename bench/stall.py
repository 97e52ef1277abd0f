"""`python -m bench.stall`: does a large prompt stall other streams? (issue #15, item 2)

One greedy stream of 200 tokens (eos ignored) on a 2-stage INT4 loopback fleet; its largest gap
between chunks is measured alone and while another client sends large prompts back to back:
2 MiB (refused by the byte limit before tokenizing) and 250 KB (just under the limit: tokenized
on a worker thread, then refused for exceeding the context). ROUNDS rounds of each, interleaved.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from pathlib import Path

import grpc

from bench.stats import median, write_result
from pipeshard.clients.client import PipeshardClient
from pipeshard.offline import set_offline_defaults
from pipeshard.services.launcher import start_fleet

ROUNDS = int(os.environ.get("STALL_ROUNDS", "5"))
TOKENS = 200
LOADS = {"none": None, "2MiB_refused": 2 * 1024 * 1024, "250KB_tokenized": 250_000}


def _max_gap_ms(address: str) -> float:
    with PipeshardClient(address, timeout_s=300) as client:
        last, gaps = None, []
        for _ in client.stream("Tell me a long story.", max_tokens=TOKENS, ignore_eos=True):
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
    return max(gaps) * 1000


def _hammer(address: str, size: int, stop: threading.Event, sent: list[int]) -> None:
    text = "word " * (size // 5)
    with PipeshardClient(address, timeout_s=300) as client:
        while not stop.is_set():
            try:
                client.generate(text, max_tokens=4)
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, exc
            sent[0] += 1


def main() -> int:
    set_offline_defaults()
    shards = Path(os.environ["STALL_SHARDS"])
    # The large prompts repeat: without --prefix-cache off they would be restored, not prefilled.
    fleet = start_fleet(
        shards,
        2,
        Path(tempfile.mkdtemp(prefix="pipeshard-stall-")),
        extra_coordinator_args=["--prefix-cache", "off"],
    )
    gaps: dict[str, list[float]] = {name: [] for name in LOADS}
    refused: dict[str, int] = dict.fromkeys(LOADS, 0)
    try:
        _max_gap_ms(fleet.coordinator)  # warm-up
        for _ in range(ROUNDS):
            for name, size in LOADS.items():
                stop, sent = threading.Event(), [0]
                worker = None
                if size is not None:
                    worker = threading.Thread(target=_hammer, args=(fleet.coordinator, size, stop, sent))
                    worker.start()
                    time.sleep(0.2)
                gaps[name].append(_max_gap_ms(fleet.coordinator))
                stop.set()
                if worker is not None:
                    worker.join()
                refused[name] += sent[0]
    finally:
        fleet.stop()
    result = {
        "rounds": ROUNDS,
        "tokens": TOKENS,
        "max_gap_ms": {n: {"median": round(median(g), 1), "max": round(max(g), 1)} for n, g in gaps.items()},
        "large_requests_refused": refused,
    }
    write_result("stall", result, command=f"STALL_SHARDS={shards} python -m bench.stall")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
