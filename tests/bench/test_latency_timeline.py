"""bench/latency.py's join of a fleet trace into one step's timeline."""

from __future__ import annotations

import pytest

from bench.latency import TIMELINE, timeline


def _write(tmp_path, steps: int, gap_ns: int, period_ns: int) -> None:
    """Every event of TIMELINE ``gap_ns`` after the previous, a step every ``period_ns``."""
    lines: dict[str, list[str]] = {}
    for step in range(steps):
        for i, (process, event) in enumerate(TIMELINE):
            t = step * period_ns + i * gap_ns
            lines.setdefault(process, []).append(f"{t}\t{process}\t{event}\tsess\t{step}\n")
            if event == "plan_send":  # a plan of two rows
                lines[process] += [f"{t}\t{process}\tplan_row\tsess\t{step}\n"] * 2
    for process, rows in lines.items():
        (tmp_path / f"{process}-1.tsv").write_text("".join(rows))


def test_segments_hops_and_overhead_come_from_the_joined_events(tmp_path):
    gap, period = 100_000, 20_000_000  # 0.1 ms between events, a 20 ms step
    _write(tmp_path, steps=5, gap_ns=gap, period_ns=period)
    out = timeline(tmp_path)
    assert out["steps"] == 3  # step 0 (prefill) and the last (no next step) are left out
    assert out["rows_per_step"]["p50"] == 2
    assert out["step_ms"]["p50"] == 20.0
    assert out["compute_ms"]["p50"] == pytest.approx(0.2)  # decoded -> inferred on each of the two stages
    assert out["overhead_ms_p50"] == pytest.approx(19.8)
    assert out["segments_ms"]["stage0.decoded -> stage0.inferred"]["p50"] == pytest.approx(0.1)
    last = f"{'.'.join(TIMELINE[-1])} -> next step"
    assert round(out["segments_ms"][last]["p50"], 6) == round(20.0 - 0.1 * (len(TIMELINE) - 1), 6)
    assert out["hops_ms_p50"]["coordinator->stage0"] == pytest.approx(0.1)  # hop_send -> recv
    assert out["offsets_ms_p50"]["stage0.recv"] == pytest.approx(0.1 * TIMELINE.index(("stage0", "recv")))


def test_a_trace_without_complete_steps_has_no_timeline(tmp_path):
    (tmp_path / "stage0-1.tsv").write_text("1\tstage0\trecv\tsess\t1\n")
    assert timeline(tmp_path) == {"steps": 0}
