"""`make report --render-only` on sample JSON: tables and plots land between the markers, the
prose around them is untouched, results without markers get a block of their own, and
re-rendering is stable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.report import main, read_result, render

GATEWAY = {
    "name": "gateway",
    "runs": 10,
    "tokens": 32,
    "tok_s": {
        "grpc_1": {"median": 40.0, "min": 30.0, "max": 45.0},
        "gateway_1": {"median": 38.0, "min": 29.0, "max": 44.0},
    },
    "ttft_ms": {"grpc_1": {"median": 120.0, "min": 100.0, "max": 150.0}},
    "gateway_over_grpc_1user": 0.95,
    "gateway_over_grpc_1user_ci95": [0.9, 1.02],
    "gateway_ttft_overhead_ms": 4.5,
    "gateway_ttft_overhead_ms_ci95": [-3.0, 9.0],
    "date": "2026-11-30T17:00:00+00:00",
    "machine": {"python": "3.11"},
    "command": "make bench-gateway  # BENCH_RUNS=10 BENCH_TOKENS=32",
}
TLS = {
    "name": "tls",
    "rounds": 10,
    "tok_s": {"plain": {"median": 20.0, "min": 15.0, "max": 25.0}, "secure": 19.5},
    "secure_over_plain": {"ratio": 0.975, "ci95": [0.9, 1.1]},
    "date": "2026-11-30T17:10:00+00:00",
    "command": "BENCH_RUNS=10 python -m bench.tls shards/x",
}
NESTED = {"name": "prefill", "ttft_ms": {"128": {"genai": 579.0, "fleet": 444.0}}, "notes": ["a"]}

PROSE = """# Benchmarks

Hand-written prose that must survive.

## bench-gateway

Words before.
<!-- report:gateway -->
old generated text
<!-- /report:gateway -->
Words after.
"""


@pytest.fixture
def workspace(tmp_path: Path) -> tuple[Path, Path, Path]:
    results = tmp_path / "results"
    results.mkdir()
    for payload in (GATEWAY, TLS, NESTED):
        (results / f"{payload['name']}.json").write_text(json.dumps(payload))
    doc = tmp_path / "docs" / "BENCHMARKS.md"
    doc.parent.mkdir()
    doc.write_text(PROSE)
    return results, doc, tmp_path / "docs" / "img"


def test_series_and_estimates_are_found_in_any_shape(workspace):
    results, _, _ = workspace
    gateway = read_result(results / "gateway.json")
    assert set(gateway.series) == {"tok_s", "ttft_ms"}
    assert set(gateway.estimates) == {"gateway_over_grpc_1user", "gateway_ttft_overhead_ms"}
    assert set(gateway.ratios) == {"gateway_over_grpc_1user"}  # the ms difference is not a ratio
    tls = read_result(results / "tls.json")
    assert tls.estimates["secure_over_plain"].low == 0.9 and tls.series["tok_s"]["secure"].median == 19.5
    assert set(read_result(results / "prefill.json").series) == {"ttft_ms.128"}


def test_render_only_fills_the_marked_block_and_keeps_the_prose(workspace):
    results, doc, img = workspace
    assert main(["--render-only", "--results", str(results), "--doc", str(doc), "--img-dir", str(img)]) == 0
    text = doc.read_text()
    assert text.startswith(PROSE.split("<!-- report:gateway -->")[0])  # prose before untouched
    assert text.count("Words after.") == 1 and "old generated text" not in text
    block = text.split("<!-- report:gateway -->")[1].split("<!-- /report:gateway -->")[0]
    assert "`make bench-gateway  # BENCH_RUNS=10 BENCH_TOKENS=32`" in block and "2026-11-30T17:00" in block
    assert "| tok_s | gateway_1 | 38 | 29 | 44 |" in block
    assert "| `gateway_over_grpc_1user` | 0.95 | [0.9, 1.02] |" in block
    assert "| `gateway_ttft_overhead_ms` | 4.5 | [-3, 9] |" in block
    assert "![gateway](img/report-gateway.png)" in block
    # results without markers get their own block under the generated heading, after the prose
    tail = text.split("## Generated from the JSON results (`make report`)")[1]
    assert "<!-- report:tls -->" in tail and "| `secure_over_plain` | 0.975 | [0.9, 1.1] |" in tail
    assert "| tok_s | secure | 19.5 | - | - |" in tail
    assert "| ttft_ms.128 | fleet | 444 | - | - |" in tail
    for name in ("gateway", "tls", "prefill"):
        png = img / f"report-{name}.png"
        assert png.read_bytes().startswith(b"\x89PNG"), name


def test_rerendering_is_stable(workspace):
    results, doc, img = workspace
    render(results, doc, img)
    once = doc.read_text()
    render(results, doc, img)
    assert doc.read_text() == once


def test_a_result_without_series_says_so(tmp_path):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "soak.json").write_text(json.dumps({"name": "soak", "requests": 200}))
    doc = tmp_path / "B.md"
    doc.write_text("# B\n")
    assert render(tmp_path / "r", doc, tmp_path / "img") == ["soak"]
    assert "(no series or ratios in this result; see the JSON)" in doc.read_text()
    assert not (tmp_path / "img" / "report-soak.png").exists()


def test_an_unknown_quick_benchmark_is_refused_by_name():
    from bench.report import run_quick

    with pytest.raises(SystemExit, match="REPORT_BENCHES: unknown bogus"):
        run_quick(["gateway", "bogus"])
