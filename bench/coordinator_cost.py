"""The coordinator's own CPU per row (issue 29): what one running session costs it per step.

``python -m bench.coordinator_cost [--before REV] [--users 16] [--runs 6]``: USERS greedy 128-token
generations of the bundled model's tokenizer through the coordinator's real ``Generation``,
``Ring`` and engine loop over a transport that answers every step at once (a fixed token per
step, no stages, no gRPC), so the process CPU time per generated token is the coordinator's own
per-row work: token frames, the plan frame, acceptance, detokenizing, the event loop. With
``--before``, that commit runs the same loop in its own process (checked out as bench-commits
does), alternating with this tree round by round; the result is the ratio of the medians with a
95% bootstrap interval (bench/stats.py). Writes bench/results/coordinator_cost.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

NEW_TOKENS = 128
PROMPT = "Explain in a few paragraphs how a bicycle works."
ANSWER = " the bicycle is a machine with two wheels and pedals"  # the tokens the fake steps return


def child(users: int) -> float:
    """One round in this process: CPU microseconds per generated token (row) of ``users`` generations."""
    from pipeshard import paths
    from pipeshard.services.coordinator.fleet_kv import FleetKv
    from pipeshard.services.coordinator.generation import Chunk, Generation
    from pipeshard.services.coordinator.ring import Ring
    from pipeshard.services.coordinator.sampling import SamplingParams
    from pipeshard.services.stage.wire import plan_from_frames
    from pipeshard.shard.prompting import Prompter
    from pipeshard.v1 import activation_pb2, stage_pb2

    export = paths.shards_dir() / paths.export_name(paths.DEFAULT_MODEL, 2, "int4")
    prompter = Prompter.from_dir(export)
    ids = prompter.encode("", [("user", PROMPT)])
    answer = prompter.tokenizer.encode(ANSWER, add_special_tokens=False)

    class Instant:
        """A StageLink whose every step is answered at once (one event-loop turn)."""

        num_stages = 2

        async def start(self) -> None: ...

        async def run(self, frames: list) -> list:
            plan = frames[0] if len(frames) == 1 else plan_from_frames(frames)
            await asyncio.sleep(0)
            out = []
            for row in plan.plan.rows:
                result = activation_pb2.StepResult(session_id=row.session_id, step_id=row.step_id)
                if row.return_mode != activation_pb2.RETURN_MODE_NONE:
                    result.top1.token_ids.append(answer[row.step_id % len(answer)])
                out.append(result)
            return out

        async def open_session(self, session_id: str, terms: object = None) -> int:
            return 8192

        async def release_session(self, session_id: str) -> None: ...

        async def abort_session(self, session_id: str, reason: str) -> None: ...

        async def close(self) -> None: ...

    # What paged stages report (GetStageInfo): every step batched, a rewind truncates.
    paged = FleetKv("paged", True, True, True, stage_pb2.DRAFT_TREE_FORM_PARENTS, 0)
    ring = Ring(Instant(), paged)
    generation = Generation(ring, prompter.tokenizer, prompter.eos_ids, prefill_chunk=256)

    async def one() -> int:
        n = 0
        params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
        async for event in generation.run(ids, params, cache=False):
            if isinstance(event, Chunk):
                n += len(event.token_ids)
        return n

    async def rounds() -> float:
        await asyncio.gather(*(one() for _ in range(users)))  # warm-up
        cpu = time.process_time()
        tokens = sum(await asyncio.gather(*(one() for _ in range(users))))
        return (time.process_time() - cpu) / tokens * 1e6

    try:
        import uvloop  # the coordinator's own loop (run_server)

        return uvloop.run(rounds())
    except ImportError:
        return asyncio.run(rounds())


def _round(users: int, cwd: Path | None = None, env: dict | None = None) -> float:
    out = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--child", str(users)],
        cwd=cwd,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", help="git revision to compare with, alternating round by round")
    p.add_argument("--users", type=int, default=16)
    p.add_argument("--runs", type=int, default=6)
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(args.child)))
        return 0
    from bench.commits import checkout
    from bench.stats import ratio_ci, summary, write_result

    sides = {"after": {}}
    tree = None
    if args.before:
        tree = checkout(args.before, Path(tempfile.mkdtemp(prefix="pipeshard-coordcost-")))
        sides["before"] = {"cwd": tree.overlay, "env": {**os.environ, "PYTHONPATH": str(tree.overlay)}}
    samples: dict[str, list[float]] = {name: [] for name in sides}
    try:
        for i in range(args.runs):
            for name in list(sides) if i % 2 == 0 else list(sides)[::-1]:
                samples[name].append(_round(args.users, **sides[name]))
            print(
                f"round {i + 1}/{args.runs}: { ({n: round(v[-1], 1) for n, v in samples.items()}) }",
                file=sys.stderr,
            )
    finally:
        if tree is not None:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree.tree)], check=False)
    result = {
        "users": args.users,
        "runs": args.runs,
        "cpu_us_per_row": {name: summary(v) for name, v in samples.items()},
        "samples": samples,
    }
    if args.before:
        result["before"] = args.before
        result["after_over_before"], result["after_over_before_ci"] = ratio_ci(
            samples["after"], samples["before"]
        )
    write_result(
        "coordinator_cost",
        result,
        command="python -m bench.coordinator_cost " + " ".join(argv or sys.argv[1:]),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
