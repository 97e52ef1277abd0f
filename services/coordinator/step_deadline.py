"""How long the ring waits for a step's result before it asks whether a stage froze.

A step's time grows with its rows (a prompt prefilled in one pass is one long step) and with what
a row costs on this fleet: the model, the precision (an f32 stage computes a row several times
slower than a bf16 one), the machine and its load. A fixed budget per row either calls a long
prompt on a slow or loaded machine a dead stage, or waits minutes for a frozen stage on a fast
one. So the deadline is the larger of

- ``step_timeout_s`` per started block of TIMEOUT_ROWS rows (the operator's floor), and
- SLACK times the step's rows at the slowest time per row of the ring's recent large steps (the
  coordinator's warm-up prefill is the first), which follows the precision, model and load the
  fleet really runs at,

never more than MAX_STRETCH times the floor, so one stalled step cannot stretch every later
deadline without end.
"""

from __future__ import annotations

from collections import deque

__all__ = ["MAX_STRETCH", "MIN_SAMPLE_ROWS", "SLACK", "TIMEOUT_ROWS", "StepDeadline"]

# Rows of a step that ``step_timeout_s`` covers; a longer step gets that much per started block.
TIMEOUT_ROWS = 256
# Steps with fewer rows are mostly fixed cost (a decode step): their time per row would overstate
# a prefill's many times over.
MIN_SAMPLE_ROWS = 64
# How much slower than the slowest recent large step a row may run before its stages are probed:
# room for the load to rise between the step that was measured and this one.
SLACK = 8.0
# The learned part never exceeds this many times the floor.
MAX_STRETCH = 10.0
# Large steps remembered (the slowest of them counts).
SAMPLES = 16


class StepDeadline:
    """The deadline of a step by its rows, learned from the steps the ring completed."""

    def __init__(self, step_timeout_s: float):
        self.step_timeout_s = step_timeout_s
        self._per_row: deque[float] = deque(maxlen=SAMPLES)

    def observe(self, rows: int, seconds: float) -> None:
        """A step of ``rows`` rows answered after ``seconds`` (send to last result)."""
        if rows >= MIN_SAMPLE_ROWS:
            self._per_row.append(seconds / rows)

    @property
    def seconds_per_row(self) -> float:
        """The slowest time per row among the recent large steps (0 before the first)."""
        return max(self._per_row, default=0.0)

    def floor(self, rows: int) -> float:
        """``step_timeout_s`` per started block of TIMEOUT_ROWS rows."""
        return self.step_timeout_s * max(1, -(-rows // TIMEOUT_ROWS))

    def for_rows(self, rows: int) -> float:
        floor = self.floor(rows)
        return min(max(floor, SLACK * rows * self.seconds_per_row), MAX_STRETCH * floor)
