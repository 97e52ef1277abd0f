"""`make bench-commits BEFORE=REV [AFTER=REV] [USERS=1,8]`: two commits' fleets served side by side, paired.

Each commit is checked out into a temporary worktree and imported from an overlay folder of
symlinks (so no second venv is needed: the commits share this one's dependencies), its protobuf
stubs generated there. Each serves a 2-stage INT4 fleet on loopback (client -> coordinator ->
2 stages) from the same shards; greedy generations of 128 tokens alternate between the two,
round by round, after warm-up, at each concurrency of ``--users`` (N clients at once: tok/s is
their tokens over the round's wall time, TTFT the median of theirs). Reports tok/s and TTFT
medians with the ratio's 95% interval and whether both produced the same tokens. A refactor's
"no slowdown beyond noise" is shown this way.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from bench.stats import median, ratio_ci, write_result
from pipeshard import paths
from pipeshard.v1 import coordinator_pb2, coordinator_pb2_grpc

REPO = Path(__file__).resolve().parents[1]
PROMPT = "Explain in a few paragraphs how a bicycle works."
NEW_TOKENS = 128
WARMUP = 2

# Run inside each commit's interpreter: start its fleet, print the coordinator, hold until stdin closes.
_HOLDER = """
import importlib, sys
from pathlib import Path
shards, run_dir = Path(sys.argv[1]), Path(sys.argv[2])
try:
    launcher = importlib.import_module("pipeshard.services.launcher")
except ModuleNotFoundError:  # commits before the package-dir mapping
    launcher = importlib.import_module("services.launcher")
fleet = launcher.start_fleet(shards, 2, run_dir)
print("READY", fleet.coordinator, flush=True)
sys.stdin.read()
fleet.stop()
"""


@dataclass
class Side:
    """One commit's checkout, import overlay and running fleet."""

    rev: str
    tree: Path
    overlay: Path
    process: subprocess.Popen | None = None
    address: str = ""
    tps: dict[int, list[float]] = field(default_factory=dict)  # per concurrency
    ttft: dict[int, list[float]] = field(default_factory=dict)
    tokens: list[int] = field(default_factory=list)


def checkout(rev: str, work: Path) -> Side:
    tree = work / f"tree-{rev}"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "-q", "--detach", str(tree), rev], check=True)
    protos = sorted(str(p.relative_to(tree)) for p in (tree / "proto").rglob("*.proto"))
    protoc = [sys.executable, "-m", "grpc_tools.protoc", "-Iproto", "--python_out=.", "--grpc_python_out=."]
    subprocess.run(
        [*protoc, *protos],
        cwd=tree,
        check=True,
    )
    overlay = work / f"overlay-{rev}"
    package = overlay / "pipeshard"
    package.mkdir(parents=True)
    for entry in (tree / "pipeshard").iterdir():
        (package / entry.name).symlink_to(entry)
    mapped = "pipeshard.services" in (tree / "pyproject.toml").read_text()
    for name in ("services", "exporter", "clients", "bench"):
        if (tree / name).is_dir():
            target = package / name if mapped and name != "bench" else overlay / name
            target.symlink_to(tree / name)
    return Side(rev, tree, overlay)


def start(side: Side, shards: Path, work: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(side.overlay)}
    side.process = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(shards), str(work / f"run-{side.rev}")],
        # The overlay, not the tree: the working directory comes first on sys.path, and the tree's
        # own pipeshard/ (without services/) would hand pipeshard.services to this venv's editable
        # install, which is the checkout running the benchmark.
        cwd=side.overlay,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    line = side.process.stdout.readline()
    if not line.startswith("READY"):
        raise RuntimeError(f"the fleet of {side.rev} did not start (see {work / f'run-{side.rev}'})")
    side.address = line.split()[1]


def generate(address: str) -> tuple[float, float, list[int]]:
    """One greedy generation: tok/s, seconds to the first chunk, the tokens."""
    request = coordinator_pb2.GenerateRequest(
        messages=[coordinator_pb2.ChatMessage(role="user", content=PROMPT)],
        params=coordinator_pb2.SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True),
    )
    with grpc.insecure_channel(address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        t0 = time.perf_counter()
        first, tokens = None, []
        for response in stub.Generate(request, timeout=600):
            if response.HasField("chunk"):
                first = first if first is not None else time.perf_counter() - t0
                tokens.extend(response.chunk.token_ids)
        return len(tokens) / (time.perf_counter() - t0), first or 0.0, tokens


def round_of(address: str, users: int) -> tuple[float, float, list[int]]:
    """``users`` generations at once: their tokens over the wall time, the median TTFT, the first's tokens."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(users) as pool:
        runs = list(pool.map(lambda _: generate(address), range(users)))
    wall = time.perf_counter() - t0
    return sum(len(r[2]) for r in runs) / wall, median([r[1] for r in runs]), runs[0][2]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, help="git revision of the baseline")
    p.add_argument("--after", default="HEAD", help="git revision compared with it (default HEAD)")
    p.add_argument("--runs", type=int, default=int(os.environ.get("BENCH_RUNS", "10")))
    p.add_argument("--users", default=os.environ.get("BENCH_USERS", "1"), help="concurrencies, e.g. 1,8")
    args = p.parse_args(argv)
    concurrencies = [int(u) for u in args.users.split(",")]
    shards = paths.shards_dir() / paths.export_name(paths.DEFAULT_MODEL, 2, "int4")
    if not (shards / "manifest.json").exists():
        from pipeshard.exporter.export import export_model

        export_model(paths.default_model_dir(), shards, stages=2, weights="int4")
    with tempfile.TemporaryDirectory(prefix="pipeshard-commits-") as tmp:
        work = Path(tmp)
        sides = [checkout(args.before, work), checkout(args.after, work)]
        try:
            for side in sides:
                start(side, shards, work)
            for users in concurrencies:
                for i in range(WARMUP + args.runs):
                    for side in sides if i % 2 == 0 else sides[::-1]:
                        tps, ttft, tokens = round_of(side.address, users)
                        side.tokens = side.tokens or tokens
                        if i >= WARMUP:
                            side.tps.setdefault(users, []).append(tps)
                            side.ttft.setdefault(users, []).append(ttft)
                    print(
                        f"{users} users, round {i}: "
                        + ", ".join(
                            f"{s.rev} {s.tps[users][-1]:.1f} tok/s" for s in sides if s.tps.get(users)
                        )
                    )
        finally:
            for side in sides:
                if side.process is not None:
                    side.process.stdin.close()
                    side.process.wait(timeout=60)
                remove = ["git", "-C", str(REPO), "worktree", "remove", "--force", str(side.tree)]
                subprocess.run(remove, check=False)
    before, after = sides
    result = {
        "before": before.rev,
        "after": after.rev,
        "runs": args.runs,
        "same_tokens": before.tokens == after.tokens,
    }
    for users in concurrencies:
        key = "" if users == 1 else f"_{users}users"  # 1 user keeps the keys earlier results have
        ratio, interval = ratio_ci(after.tps[users], before.tps[users])
        ttft_ratio, ttft_interval = ratio_ci(after.ttft[users], before.ttft[users])
        result |= {
            f"before_tok_s_median{key}": median(before.tps[users]),
            f"after_tok_s_median{key}": median(after.tps[users]),
            f"after_over_before_tok_s{key}": ratio,
            f"after_over_before_tok_s_ci95{key}": interval,
            f"before_ttft_s_median{key}": median(before.ttft[users]),
            f"after_ttft_s_median{key}": median(after.ttft[users]),
            f"after_over_before_ttft{key}": ttft_ratio,
            f"after_over_before_ttft_ci95{key}": ttft_interval,
        }
    write_result(
        "commits",
        result,
        command=f"make bench-commits BEFORE={args.before} AFTER={args.after} USERS={args.users}",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
