"""Two commits' traced 2-stage fleets side by side: what a change does to one step's timeline.

``python -m bench.trace_pair BEFORE AFTER USERS ROUNDS``: each commit is checked out and served as
``make bench-commits`` does (bench/commits.py), with ``PIPESHARD_TRACE_DIR`` set (pipeshard/trace.py);
after a short warm-up, rounds of ``USERS`` concurrent 128-token greedy generations alternate
between the two fleets. Each fleet's trace is then joined into bench-latency's timeline
(bench/latency.py ``timeline``). Prints and writes ``bench/results/trace_pair.json``: both
timelines, both fleets' tok/s per round and the ratio of medians with its 95% interval. At one
user a round is one generation (its decode rate), at several their tokens over the round.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.commits import checkout, start
from bench.latency import PROMPTS, FleetClient, timeline
from bench.stats import median, ratio_ci, write_result
from pipeshard import paths


def main(argv: list[str]) -> int:
    before, after, users, rounds = argv[0], argv[1], int(argv[2]), int(argv[3])
    shards = paths.shards_dir() / paths.export_name(paths.DEFAULT_MODEL, 2, "int4")
    work = Path(tempfile.mkdtemp(prefix="pipeshard-trace-pair-"))
    sides = [checkout(before, work), checkout(after, work)]
    traces = {side.rev: work / f"trace-{side.rev}" for side in sides}
    rates: dict[str, list[float]] = {side.rev: [] for side in sides}
    try:
        for side in sides:
            os.environ["PIPESHARD_TRACE_DIR"] = str(traces[side.rev])
            start(side, shards, work)
        os.environ.pop("PIPESHARD_TRACE_DIR")
        pairs = [(side.rev, FleetClient(side.address)) for side in sides]
        for _, client in pairs:
            client.run(PROMPTS[0], 16)
        for i in range(rounds):
            for rev, client in pairs if i % 2 == 0 else pairs[::-1]:
                one = users == 1
                rates[rev].append(
                    client.run(PROMPTS[i % len(PROMPTS)])["tok_s"] if one else client.aggregate(users)
                )
    finally:
        for side in sides:  # stopping a fleet flushes its processes' traces
            if side.process is not None:
                side.process.stdin.close()
                side.process.wait(timeout=60)
            subprocess.run(["git", "worktree", "remove", "--force", str(side.tree)], check=False)
    ratio, interval = ratio_ci(rates[after], rates[before])
    result = {
        "before": before,
        "after": after,
        "users": users,
        "rounds": rounds,
        "tok_s": rates,
        "tok_s_median": {rev: median(v) for rev, v in rates.items()},
        "after_over_before_tok_s": ratio,
        "after_over_before_tok_s_ci": interval,
        "timelines": {rev: timeline(path) for rev, path in traces.items()},
    }
    write_result("trace_pair", result, command=f"python -m bench.trace_pair {' '.join(argv)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
