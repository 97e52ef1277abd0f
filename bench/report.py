"""`make report`: run the quick benchmarks, then render docs/benchmarks-report.md's generated tables
and the PNG plots from bench/results/*.json, so every generated figure has a command behind it.

    python -m bench.report                 # the quick benchmarks (listed as it starts), then render
    python -m bench.report --render-only   # re-render from the JSON already in bench/results
    REPORT_BENCHES=gateway python -m bench.report   # a subset of the quick benchmarks

Rendering never touches the hand-written prose: each result NAME goes between the markers
``<!-- report:NAME -->`` and ``<!-- /report:NAME -->`` (placed wherever the page wants it);
a result without markers gets a new marked block under "Generated from the JSON results" at the
end. Every block names its JSON, the command that wrote it and its date. What is rendered, for
any result shape: every series (a dict of configurations to numbers or to {median, min, max}),
every estimate with an interval (``KEY`` with ``KEY_ci``/``KEY_ci95``, or ``{"ratio", "ci95"}``),
and a PNG (docs/img/report-NAME.png) of the tok/s series (or the first series) and of the ratios
(estimates named ``*_over_*`` or ``*ratio*``; differences such as a TTFT overhead in ms are tabled,
not plotted on the ratio axis) with their intervals.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.stats import RESULTS_DIR

DOC = Path("docs/benchmarks-report.md")  # generated; docs/BENCHMARKS.md is written by hand
IMG_DIR = Path("docs/img")
GENERATED_HEADING = "## Generated from the JSON results (`make report`)"


@dataclass(frozen=True)
class QuickBench:
    """One benchmark of the quick set: its module, arguments and reduced settings."""

    name: str  # the bench/results/NAME.json it writes
    module: str
    env: dict[str, str] = field(default_factory=dict)
    args: tuple[str, ...] = ()

    def argv(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            self.module,
            *(a.replace(EXPORT_2S_INT4, _export_2s_int4()) for a in self.args),
        ]

    def command(self) -> str:
        knobs = " ".join(f"{k}={v}" for k, v in self.env.items())
        return f"{knobs} {' '.join(self.argv())}".strip()


EXPORT_2S_INT4 = "{export_2s_int4}"  # stands for the default 2-stage INT4 export in arguments


def _export_2s_int4() -> str:
    from pipeshard import paths

    export = paths.shards_dir() / paths.export_name(paths.DEFAULT_MODEL, 2, "int4")
    return os.path.relpath(export) if export.is_absolute() and Path.cwd() in export.parents else str(export)


# Reduced so the default run stays under 20 minutes on this 2-core machine: fewer tokens per
# generation, never fewer than 10 measured rounds (ratios need them). About 8 minutes for the
# gateway and 5 for TLS on a quiet machine; several times that while others load it.
QUICK = (
    QuickBench("gateway", "bench.gateway", {"BENCH_RUNS": "10", "BENCH_TOKENS": "32"}),
    QuickBench("tls", "bench.tls", {"BENCH_RUNS": "10"}, (EXPORT_2S_INT4,)),
)


def run_quick(names: list[str]) -> None:
    """Run the chosen quick benchmarks one after another (each writes its JSON)."""
    chosen = [b for b in QUICK if b.name in names]
    unknown = sorted(set(names) - {b.name for b in QUICK})
    if unknown:
        raise SystemExit(
            f"REPORT_BENCHES: unknown {', '.join(unknown)} (quick set: {', '.join(b.name for b in QUICK)})"
        )
    print("make report runs the quick benchmarks (reduced settings):", flush=True)
    for bench in chosen:
        print(f"  {bench.name}: {bench.command()}", flush=True)
    if any(EXPORT_2S_INT4 in a for b in chosen for a in b.args):
        _ensure_export()
    for bench in chosen:
        started = time.monotonic()
        print(f"running {bench.name} ...", flush=True)
        subprocess.run(bench.argv(), env={**os.environ, **bench.env}, check=True)
        print(f"{bench.name} done in {time.monotonic() - started:.0f} s", flush=True)


def _ensure_export() -> None:
    from pipeshard import paths
    from pipeshard.services.fleet_cli import ensure_shards

    ensure_shards(paths.DEFAULT_MODEL, 2, "int4")


# --- reading results ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Point:
    median: float
    low: float | None = None
    high: float | None = None


@dataclass
class Result:
    """What a result JSON holds that can be tabled: series and ratios, by their path in the JSON."""

    name: str
    path: Path
    raw: dict
    series: dict[str, dict[str, Point]] = field(default_factory=dict)
    estimates: dict[str, Point] = field(default_factory=dict)  # a value with its 95% interval

    @property
    def ratios(self) -> dict[str, Point]:
        return {k: p for k, p in self.estimates.items() if "_over_" in k or "ratio" in k}

    @property
    def date(self) -> str:
        return str(self.raw.get("date", "undated"))

    @property
    def command(self) -> str:
        return str(self.raw.get("command", f"make bench-{self.name}"))


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _point(value) -> Point | None:
    if _number(value):
        return Point(float(value))
    if isinstance(value, dict) and _number(value.get("median")):
        low, high = value.get("min"), value.get("max")
        return Point(float(value["median"]), low if _number(low) else None, high if _number(high) else None)
    return None


def _interval(value) -> tuple[float, float] | None:
    if isinstance(value, list | tuple) and len(value) == 2 and all(_number(v) for v in value):
        return float(value[0]), float(value[1])
    return None


def _walk(obj: dict, prefix: str, result: Result) -> None:
    for key, value in obj.items():
        path = f"{prefix}{key}"
        if key.endswith(("_ci", "_ci95")) or key in ("machine", "date", "command", "name"):
            continue
        ci = _interval(obj.get(f"{key}_ci95", obj.get(f"{key}_ci")))
        if _number(value) and ci is not None:
            result.estimates[path] = Point(float(value), *ci)
        elif isinstance(value, dict) and _number(value.get("ratio")):
            ci = _interval(value.get("ci95", value.get("ci"))) or (None, None)
            result.estimates[path] = Point(float(value["ratio"]), *ci)
        elif isinstance(value, dict) and value:
            points = {k: _point(v) for k, v in value.items()}
            if all(p is not None for p in points.values()) and not _point(value):
                result.series[path] = points
            elif not _point(value):
                _walk(value, f"{path}.", result)


def read_result(path: Path) -> Result:
    raw = json.loads(path.read_text())
    result = Result(str(raw.get("name", path.stem)), path, raw)
    _walk(raw, "", result)
    return result


def read_results(results_dir: Path) -> list[Result]:
    return [read_result(p) for p in sorted(results_dir.glob("*.json"))]


# --- rendering ---------------------------------------------------------------------------------


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.3g}" if abs(x) < 100 else f"{x:.0f}"


def render_block(result: Result, image: Path | None, doc: Path) -> str:
    """The Markdown of one result: source line, series table, ratio table, plot."""
    lines = [
        f"_Generated by `make report` from `{result.path.as_posix()}` ({result.date}); "
        f"command: `{result.command}`._",
        "",
    ]
    if result.series:
        lines += ["| series | configuration | median | min | max |", "|---|---|---|---|---|"]
        for name, points in result.series.items():
            for config, p in points.items():
                lines.append(f"| {name} | {config} | {_fmt(p.median)} | {_fmt(p.low)} | {_fmt(p.high)} |")
        lines.append("")
    if result.estimates:
        lines += ["| estimate | value | 95% interval |", "|---|---|---|"]
        for name, p in result.estimates.items():
            interval = f"[{_fmt(p.low)}, {_fmt(p.high)}]" if p.low is not None else "-"
            lines.append(f"| `{name}` | {_fmt(p.median)} | {interval} |")
        lines.append("")
    if image is not None:
        lines += [f"![{result.name}]({os.path.relpath(image, doc.parent)})", ""]
    if not result.series and not result.estimates:
        lines += ["(no series or ratios in this result; see the JSON)", ""]
    return "\n".join(lines).rstrip("\n")


def plot(result: Result, out: Path) -> Path | None:
    """A PNG of the tok/s series (or the first series) and of the ratios; None if neither exists."""
    series_name = "tok_s" if "tok_s" in result.series else next(iter(result.series), None)
    panels = [p for p in (series_name, "ratios" if result.ratios else None) if p]
    if not panels:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [len(result.series[series_name]) if series_name else 0, len(result.ratios)]
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(7, 1.2 + 0.35 * sum(rows)), squeeze=False, constrained_layout=True
    )
    for ax, panel in zip(axes[:, 0], panels, strict=True):
        points = result.ratios if panel == "ratios" else result.series[panel]
        labels = list(points)
        medians = [points[k].median for k in labels]
        low = [
            points[k].median - (points[k].low if points[k].low is not None else points[k].median)
            for k in labels
        ]
        high = [
            (points[k].high if points[k].high is not None else points[k].median) - points[k].median
            for k in labels
        ]
        y = list(range(len(labels)))
        if panel == "ratios":
            ax.errorbar(medians, y, xerr=[low, high], fmt="o", capsize=3)
            ax.axvline(1.0, color="grey", linewidth=0.8, linestyle="--")
            ax.set_xlabel("ratio of medians (95% interval)")
        else:
            ax.barh(y, medians, xerr=[low, high], capsize=3, color="#4c72b0")
            ax.set_xlabel(f"{panel}: median (min-max)")
        ax.set_yticks(y, labels)
        ax.invert_yaxis()
    fig.suptitle(f"{result.name} ({result.date})", fontsize=9)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100, metadata={"Software": None})
    plt.close(fig)
    return out


def _markers(name: str) -> tuple[str, str]:
    return f"<!-- report:{name} -->", f"<!-- /report:{name} -->"


def insert_block(text: str, name: str, body: str) -> str:
    """``text`` with the block of ``name`` replaced by ``body`` (appended at the end if missing)."""
    start, end = _markers(name)
    block = f"{start}\n{body}\n{end}"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.DOTALL)
    if pattern.search(text):
        return pattern.sub(lambda _m: block, text, count=1)
    if GENERATED_HEADING not in text:
        text = text.rstrip("\n") + f"\n\n{GENERATED_HEADING}\n"
    return text.rstrip("\n") + f"\n\n### {name}\n\n{block}\n"


def render(results_dir: Path = RESULTS_DIR, doc: Path = DOC, img_dir: Path = IMG_DIR) -> list[str]:
    """Re-render every result in ``results_dir`` into ``doc`` and ``img_dir``; returns their names."""
    results = read_results(results_dir)
    text = doc.read_text()
    for result in results:
        image = plot(result, img_dir / f"report-{result.name}.png")
        text = insert_block(text, result.name, render_block(result, image, doc))
    doc.write_text(text)
    return [r.name for r in results]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("--render-only", action="store_true", help="only re-render from existing JSON")
    parser.add_argument("--results", type=Path, default=RESULTS_DIR)
    parser.add_argument("--doc", type=Path, default=DOC)
    parser.add_argument("--img-dir", type=Path, default=IMG_DIR)
    args = parser.parse_args(argv)
    if not args.render_only:
        run_quick(os.environ.get("REPORT_BENCHES", ",".join(b.name for b in QUICK)).split(","))
    names = render(args.results, args.doc, args.img_dir)
    print(f"rendered {', '.join(names) or 'nothing (no JSON results)'} into {args.doc} and {args.img_dir}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
