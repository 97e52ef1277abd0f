"""Paired benchmark statistics: interleaved runs, medians, and bootstrap intervals of ratios.

Every configuration is run once per round, in a shuffled order, after warm-up rounds, so slow
phases of this shared, noisy machine hit every configuration alike. A speed claim is the ratio
of two medians with a 95% percentile-bootstrap interval (resampling rounds, which keeps pairs).
"""

from __future__ import annotations

import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path

RESULTS_DIR = Path("bench/results")


def interleaved(
    configs: dict[str, Callable[[], float]], runs: int, warmup: int = 2, seed: int = 0
) -> dict[str, list[float]]:
    """Call each config ``warmup + runs`` times in shuffled rounds; keep the last ``runs`` values."""
    rng = random.Random(seed)
    samples: dict[str, list[float]] = {name: [] for name in configs}
    names = list(configs)
    for round_index in range(warmup + runs):
        rng.shuffle(names)
        for name in names:
            value = configs[name]()
            if round_index >= warmup:
                samples[name].append(value)
        print(
            f"round {round_index + 1}/{warmup + runs}: "
            + ", ".join(f"{n}={samples[n][-1]:.2f}" for n in sorted(names) if samples[n]),
            file=sys.stderr,
        )
    return samples


def interleaved_generations(
    runners: dict[str, Callable[[], dict]], runs: int, warmup: int = 2
) -> tuple[dict[str, list[float]], dict[str, dict]]:
    """:func:`interleaved` over runners that return a generation's ``{"tok_s", "tokens", ...}``;
    gives the tok/s samples and each runner's last result (to compare tokens)."""
    last: dict[str, dict] = {}

    def timed(name: str) -> Callable[[], float]:
        def run() -> float:
            last[name] = runners[name]()
            return last[name]["tok_s"]

        return run

    return interleaved({n: timed(n) for n in runners}, runs, warmup), last


def median(values: list[float]) -> float:
    return float(statistics.median(values))


def summary(values: list[float]) -> dict[str, float]:
    return {"median": median(values), "min": float(min(values)), "max": float(max(values))}


def ratio_ci(
    num: list[float], den: list[float], n_boot: int = 4000, seed: int = 1
) -> tuple[float, list[float]]:
    """Ratio of medians and its 95% bootstrap interval, resampling paired rounds."""
    rng = random.Random(seed)
    pairs = list(zip(num, den, strict=True))
    boots = []
    for _ in range(n_boot):
        sample = [pairs[rng.randrange(len(pairs))] for _ in pairs]
        boots.append(median([a for a, _ in sample]) / median([b for _, b in sample]))
    boots.sort()
    return median(num) / median(den), [boots[int(0.025 * n_boot)], boots[int(0.975 * n_boot) - 1]]


def mean_ratio_ci(
    num: list[list[float]], den: list[list[float]], n_boot: int = 4000, seed: int = 1
) -> tuple[float, list[float]]:
    """Mean over items (for example prompt kinds) of each item's ratio of medians, ``num[round][item]``
    against ``den[round][item]``, and its 95% bootstrap interval resampling paired rounds."""
    rng = random.Random(seed)
    rounds = len(num)

    def mean_ratio(picked: list[int]) -> float:
        items = range(len(num[0]))
        return statistics.fmean(
            median([num[r][i] for r in picked]) / median([den[r][i] for r in picked]) for i in items
        )

    boots = sorted(mean_ratio([rng.randrange(rounds) for _ in range(rounds)]) for _ in range(n_boot))
    return mean_ratio(list(range(rounds))), [boots[int(0.025 * n_boot)], boots[int(0.975 * n_boot) - 1]]


def command_with_knobs(target: str, knobs: Sequence[str]) -> str:
    """``make TARGET`` preceded by the BENCH_* settings this run was given (so it can be repeated)."""
    given = " ".join(f"{k}={os.environ[k]}" for k in knobs if k in os.environ)
    return f"{given} make {target}".strip()


def write_result(name: str, result: dict, command: str | None = None) -> Path:
    """Write bench/results/NAME.json and print it as the last line of output."""
    result = {
        "name": name,
        **result,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {
            "python": platform.python_version(),
            "processor": platform.processor() or platform.machine(),
        },
        "command": command or f"make bench-{name}",
    }
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(result, indent=2))
    print(json.dumps(result), flush=True)
    return path


class Stopwatch:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def ms(self) -> float:
        return (time.perf_counter() - self.t0) * 1000.0


def difference_ci(
    a: list[float], b: list[float], n_boot: int = 4000, seed: int = 1
) -> tuple[float, list[float]]:
    """Difference of medians (a - b) and its 95% bootstrap interval, resampling paired rounds."""
    rng = random.Random(seed)
    pairs = list(zip(a, b, strict=True))
    boots = []
    for _ in range(n_boot):
        sample = [pairs[rng.randrange(len(pairs))] for _ in pairs]
        boots.append(median([x for x, _ in sample]) - median([y for _, y in sample]))
    boots.sort()
    return median(a) - median(b), [boots[int(0.025 * n_boot)], boots[int(0.975 * n_boot) - 1]]
