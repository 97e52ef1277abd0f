"""What a batching ring's steps may carry, and what they carried: the settings and counters of
continuous batching on paged stages.

The engine loop (engine.py) decides each step; this module holds what it needs to know of the
ring: the step's token budget (``step_tokens``), how many steps may travel at once (``inflight``:
on a fleet of N stages, N, so each stage works on a different step), each request's place in
the batching (:class:`StepSlot`: its batch job's micro-batches, whether its next row goes at once
alone after a failover), and the counters benchmarks, tests and batch-aware K read (``timing``:
decode steps' cost by rows and positions, send to result, fitted once for all requests).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeshard.services.coordinator.speculation.policy import TimingModel

# Tokens one step may carry beyond the decode rows; prefill chunks wait for a step with room.
DEFAULT_STEP_TOKENS = 512
# Prompt tokens per prefill step: the whole context, so a prompt is prefilled in one pass. Measured
# (docs/BENCHMARKS.md, bench-prefill): with the KV cache as graph state, the CPU plugin runs every
# multi-row step on a non-empty cache through its one-token attention kernel (scaled_attn.cpp:
# ``use_one_token = L1 == 1 || (fuse_concat && L0 > 0)``), so a 1024-token prompt in 256-token
# chunks cost 5x the CPU time of one pass; only the first chunk takes the multi-row kernel.
DEFAULT_PREFILL_CHUNK = 4096
# Prompt tokens per prefill frame on the paged backend: its attention kernel takes chunks of a
# prompt on a filled cache at full speed (unlike the stateful one, above), so a long
# prompt shares steps with the others' decode rows instead of stalling them.
PAGED_PREFILL_CHUNK = 256


@dataclass(eq=False)
class Grouping:
    """A batch job's micro-batches: its sessions' decode rows go in ``count`` groups, each a step,
    up to ``count`` of them travelling at once. What its auto probe measures: ``steps_run`` counts
    the steps that carried its rows, ``decode_rows_run`` its decode rows among them (its tokens;
    a prefill chunk is other work), ``last_prefill_step`` the latest of those steps that carried a
    prefill chunk of the job's, and ``launched_s`` when the latest left (the engine's clock)."""

    count: int = 1
    steps_run: int = 0
    decode_rows_run: int = 0
    last_prefill_step: int = 0
    launched_s: float = 0.0


@dataclass(eq=False)
class StepSlot:
    """One request's place in the batching for its whole life (across failovers): ``grouping`` its
    batch job's micro-batches (None: the engine's own groups), ``expedited`` its next row leaves
    at once, alone (a failover's resend), ``passed_over`` a prefill chunk of it was left out of a
    step once (it goes ahead of rows that became ready later), ``identity`` whose request it is
    (rows that cannot all ride take turns across identities)."""

    grouping: Grouping | None = None
    expedited: bool = False
    passed_over: bool = False
    identity: str = ""


@dataclass
class BatchSteps:
    """A batching ring's step settings (``step_tokens``, ``inflight``) and counters."""

    step_tokens: int = DEFAULT_STEP_TOKENS
    inflight: int = 1
    steps_run: int = 0  # steps formed so far (benchmarks and tests read it)
    rows_run: int = 0
    max_in_flight: int = 0  # the most steps that were in flight at once
    last_step_rows: int = 0  # rows and tokens of the latest step (how full steps run)
    last_step_tokens: int = 0
    timing: TimingModel = field(default_factory=TimingModel)

    def __post_init__(self) -> None:
        if self.inflight < 1:
            raise ValueError(f"inflight must be at least 1, got {self.inflight}")
