"""Progress display: tqdm bars per stage on a terminal, plain lines otherwise."""

from __future__ import annotations

import io

from pipeshard.exporter.export import PHASES, ProgressEvent
from pipeshard.exporter.progress import ProgressPrinter


def _events():
    for stage in (0, 1):
        for phase in PHASES:
            yield ProgressEvent(stage, phase, 0.0, "")
            yield ProgressEvent(stage, phase, 1.0, "ok")
    yield ProgressEvent(None, "done", 1.0, "/tmp/x in 1.0 s")


def test_plain_lines_when_not_a_tty():
    out = io.StringIO()
    printer = ProgressPrinter(out, tty=False)
    for event in _events():
        printer(event)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 * len(PHASES) * 2 + 1
    assert "stage 1: save 100% - ok" in lines[-2]
    assert lines[-1].endswith("export: done 100% - /tmp/x in 1.0 s")


def test_bars_on_a_tty():
    out = io.StringIO()
    printer = ProgressPrinter(out, tty=True)
    for event in _events():
        printer(event)
    printer.close()
    text = out.getvalue()
    assert "stage 0" in text and "stage 1" in text and f"{len(PHASES)}/{len(PHASES)}" in text
    assert "export: done" in text
