"""pipeshard.trace: off by default, and with a folder each process's events land in its own file."""

from __future__ import annotations

from pipeshard import trace


def test_marks_are_dropped_when_tracing_is_off(monkeypatch):
    monkeypatch.setattr(trace, "_DIR", "")
    monkeypatch.setattr(trace, "_events", [])
    trace.mark("recv", "s", 1)
    assert trace._events == []


def test_flush_writes_one_line_per_mark_in_order(monkeypatch, tmp_path):
    monkeypatch.setattr(trace, "_DIR", str(tmp_path))
    monkeypatch.setattr(trace, "_events", [])
    monkeypatch.setattr(trace, "_process", "pid0")
    trace.name_process("stage 1")
    trace.mark("recv", "abc", 3)
    trace.mark("inferred", "abc", 3)
    trace.flush()
    (path,) = tmp_path.glob("stage1-*.tsv")
    rows = [line.split("\t") for line in path.read_text().splitlines()]
    assert [(r[1], r[2], r[3], r[4]) for r in rows] == [
        ("stage1", "recv", "abc", "3"),
        ("stage1", "inferred", "abc", "3"),
    ]
    assert int(rows[0][0]) <= int(rows[1][0])
    assert trace._events == []


def test_a_full_buffer_is_written_out_before_it_grows_further(monkeypatch, tmp_path):
    monkeypatch.setattr(trace, "_DIR", str(tmp_path))
    monkeypatch.setattr(trace, "_events", [])
    monkeypatch.setattr(trace, "FLUSH_EVERY", 3)
    for step in range(7):
        trace.mark("recv", "s", step)
    written = [line for path in tmp_path.glob("*.tsv") for line in path.read_text().splitlines()]
    assert [line.split("\t")[4] for line in written] == ["0", "1", "2", "3", "4", "5"]
    assert len(trace._events) == 1
