"""Progress display for exports: a tqdm bar per stage on a terminal, plain log lines otherwise."""

from __future__ import annotations

import sys
import time
from typing import IO

from pipeshard.exporter.export import PHASES, ProgressEvent


class ProgressPrinter:
    """Callable progress sink for :func:`pipeshard.exporter.export.export_model`."""

    def __init__(self, stream: IO[str] | None = None, tty: bool | None = None):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self._bars: dict[int, object] = {}
        self._t0 = time.monotonic()

    def __call__(self, event: ProgressEvent) -> None:
        if self.tty and event.stage is not None and event.phase in PHASES:
            self._bar(event)
            return
        if self.tty and event.stage is None:
            self.close()
        where = "export" if event.stage is None else f"stage {event.stage}"
        elapsed = time.monotonic() - self._t0
        line = f"[{elapsed:7.1f}s] {where}: {event.phase} {event.fraction:.0%}"
        if event.message:
            line += f" - {event.message}"
        print(line, file=self.stream, flush=True)

    def _bar(self, event: ProgressEvent) -> None:
        from tqdm import tqdm

        bar = self._bars.get(event.stage)
        if bar is None:
            bar = tqdm(
                total=len(PHASES), desc=f"stage {event.stage}", file=self.stream, unit="phase", leave=True
            )
            self._bars[event.stage] = bar
        done = PHASES.index(event.phase) + (1 if event.fraction >= 1.0 else 0)
        bar.n = done
        bar.set_postfix_str(f"{event.phase} {event.message}".strip()[:60], refresh=False)
        bar.refresh()
        if done == len(PHASES):
            bar.close()

    def close(self) -> None:
        for bar in self._bars.values():
            bar.close()
        self._bars.clear()
