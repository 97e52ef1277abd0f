"""A static stage shard: S slots of C rows per inference over KV buffers the stage owns.

The export (``pipeshard export --static``, exporter/static_stage.py) has no graph state and only
static shapes, the form an NPU compiles. This module holds the cache instead: one f32 buffer
[S, kv_heads, L, head_dim] per layer and K/V, bound once to the request's KV inputs as tensors
sharing the buffers' memory (``set_tensor``), so a step copies none of the cache in. The model
returns the new rows' K/V into small output buffers bound the same way; the stage writes each
row's valid part into its slot at the slot's length (a copy of the new rows only, measured in
bench-static's ``step_costs``). Every input and output is preallocated and bound once.

An export with C > 1 also carries each stage's decode twin, the model traced at [S, 1]: a step
of single tokens runs it (S rows, not S x C) over the same bound KV buffers, so decode stops
paying for C - 1 padding rows per slot.

A sequence holds a slot from open to free; a step packs one row per sequence, at most C tokens,
into its slot; idle slots and padding rows are masked out (``attention_mask``) and their results
dropped, so a row's values do not depend on the other slots. Rewind: a slot's length shortens
and the next rows overwrite the tail.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import openvino as ov

from pipeshard.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from pipeshard.precision import DEFAULT_PRECISION, Configuration
from pipeshard.shard.device import DEFAULT_DEVICE
from pipeshard.shard.runtime import StageShard


@dataclass(frozen=True)
class StaticRow:
    """One sequence's part of a step: its slot, the cache length it starts from (after a rewind
    or a prefix reuse), its inputs (int64 ids [T] or f32 hidden [T, H]), their positions [T] and,
    on the last stage, how many trailing rows get logits."""

    slot: int
    start: int
    inputs: np.ndarray
    positions: np.ndarray
    logits: int = 0


class _Request:
    """One compiled static model (the [S, C] model or its [S, 1] decode twin) with its own input
    and output buffers, all preallocated and bound once; the KV buffers are the shard's, bound to
    every request, so both shapes read one cache."""

    def __init__(
        self, compiled: ov.CompiledModel, shard: StaticShard, chunk: int, cache: dict[str, np.ndarray]
    ):
        self.chunk = chunk
        self.req = compiled.create_infer_request()
        s, ctx, kv = shard.slots, shard.max_context, shard.kv_source
        self.x = (
            np.zeros((s, chunk), np.int64)
            if shard.is_first
            else np.zeros((s, chunk, shard.hidden_size), np.float32)
        )
        self.mask = np.zeros((s, ctx + chunk), np.int64)
        self.pos = np.zeros((s, chunk), np.int64)
        self.new = {name: np.zeros((s, kv.kv_heads, chunk, kv.head_dim), np.float32) for name in cache}
        self.out = np.zeros((s, chunk, shard.vocab_size if shard.is_last else shard.hidden_size), np.float32)
        inputs, outputs = compiled.input, compiled.output
        self._bind(inputs(shard.entry.input_name), self.x)
        self._bind(inputs("attention_mask"), self.mask)
        self._bind(inputs("position_ids"), self.pos)
        for name, buf in cache.items():
            self._bind(inputs(name), buf)
        for name, buf in self.new.items():
            self._bind(outputs("present." + name.removeprefix("past_key_values.")), buf)
        # By index: a middle stage's output carries its input's name (hidden_states in and out).
        self._bind(outputs(0), self.out)

    def _bind(self, port: ov.ConstOutput, buf: np.ndarray) -> None:
        """Binds a preallocated buffer to a port, sharing its memory (no copy per step)."""
        self.req.set_tensor(port, ov.Tensor(buf, shared_memory=True))


class StaticShard(StageShard):
    """One compiled static stage (and its decode twin, when the export has one) over slot-packed
    KV buffers."""

    def __init__(
        self,
        export_dir: Path | str,
        stage_index: int,
        precision: str = DEFAULT_PRECISION,
        num_threads: int | None = None,
        *,
        verify: bool = True,
        core: ov.Core | None = None,
        device: str = DEFAULT_DEVICE,
        compile_cache: str | Path | None = "off",
        config: Configuration | None = None,
    ):
        super().__init__(
            export_dir,
            stage_index,
            precision,
            num_threads,
            verify=verify,
            core=core,
            device=device,
            config=config,
        )
        layout = self.manifest.static
        if layout is None:
            raise FailedPrecondition(
                f"{self.export_dir} is a stateful export; static stages need `pipeshard export --static`"
            )
        self.slots, self.chunk = layout.slots, layout.chunk
        self.name = (
            f"static shard {self.manifest.name} stage {stage_index} ({self.slots} slots x {self.chunk})"
        )
        kv = (self.slots, self.kv_source.kv_heads, self.max_context, self.kv_source.head_dim)
        self._cache = {name: np.zeros(kv, np.float32) for name in self.state_variables}
        self.compiled = self.compile(str(self.export_dir / self.entry.model), compile_cache)
        self._chunked = _Request(self.compiled, self, self.chunk, self._cache)
        self._decode = self._chunked
        if self.entry.decode_model:
            seconds = self.compile_seconds
            twin = self.compile(str(self.export_dir / self.entry.decode_model), compile_cache)
            self._decode = _Request(twin, self, 1, self._cache)
            self.compile_seconds = round(seconds + self.compile_seconds, 3)
        self.lengths = np.zeros(self.slots, np.int64)  # cached positions per slot
        self._free = list(range(self.slots - 1, -1, -1))  # pop() hands out low slots first
        self._lock = threading.Lock()
        self.cache_bytes = sum(b.nbytes for b in self._cache.values())

    # -- slots -------------------------------------------------------------------------------
    def acquire(self) -> int:
        """A free slot for a new sequence, or RESOURCE_EXHAUSTED naming the shard's slots."""
        with self._lock:
            if not self._free:
                raise ResourceExhausted(
                    f"all {self.slots} slots of the {self.name} are taken (continuous batching holds "
                    f"at most {self.slots} sequences)"
                )
            slot = self._free.pop()
            self.lengths[slot] = 0
            return slot

    def release(self, slot: int) -> None:
        with self._lock:
            if slot not in self._free:
                self._free.append(slot)
                self._free.sort(reverse=True)

    @property
    def slots_used(self) -> int:
        return self.slots - len(self._free)

    def length(self, slot: int) -> int:
        return int(self.lengths[slot])

    def rewind(self, slot: int, length: int) -> None:
        """Shortens a slot to its first ``length`` positions: the next rows overwrite the rest."""
        if not 0 <= length <= self.lengths[slot]:
            raise InvalidArgument(
                "length", f"must be in [0, {self.lengths[slot]}] for slot {slot}, got {length}"
            )
        self.lengths[slot] = length

    def export_kv(self, slot: int, positions: int, start: int = 0) -> list[np.ndarray]:
        """The slot's cached positions [start, positions), f32 [kv_heads, positions - start,
        head_dim] per layer and K/V (the stateful export's blob layout)."""
        with self._lock:
            if not 0 < positions <= self.lengths[slot]:
                raise InvalidArgument("positions", f"must be in [1, {self.lengths[slot]}], got {positions}")
            if not 0 <= start < positions:
                raise InvalidArgument("from_position", f"must be in [0, {positions}), got {start}")
            return [buf[slot, :, start:positions].copy() for buf in self._cache.values()]

    def import_kv(self, slot: int, arrays: Sequence[np.ndarray], positions: int) -> None:
        """Writes ``export_kv``'s arrays into a slot; its length becomes ``positions``."""
        with self._lock:
            if len(arrays) != len(self._cache):
                raise InvalidArgument("arrays", f"must hold {len(self._cache)} states, got {len(arrays)}")
            if not 0 < positions <= self.max_context:
                raise ResourceExhausted(
                    f"{positions} positions exceed the {self.name}'s context {self.max_context}"
                )
            want = self.kv_source.shapes_for(positions)
            for name, array, shape in zip(self._cache, arrays, want, strict=True):
                if array.shape != shape:
                    raise InvalidArgument(
                        "arrays", f"{name} has shape {list(array.shape)}, not {list(shape)}"
                    )
            for buf, array in zip(self._cache.values(), arrays, strict=True):
                buf[slot, :, :positions] = array
            self.lengths[slot] = positions

    # -- compute -----------------------------------------------------------------------------
    def check(self, row: StaticRow) -> None:
        """A row's fit into the static shapes, before anything is written."""
        t = len(row.positions)
        if not 0 <= row.slot < self.slots:
            raise InvalidArgument(
                "slot_id", f"must be in [0, {self.slots}) on the {self.name}, got {row.slot}"
            )
        if not 1 <= t <= self.chunk:
            raise InvalidArgument(
                "tokens", f"a row holds at most {self.chunk} tokens on the {self.name} (its chunk), got {t}"
            )
        if row.start + t > self.max_context:
            raise InvalidArgument(
                "positions",
                f"slot {row.slot} would grow to {row.start + t} positions, beyond the {self.name}'s "
                f"max_context {self.max_context}",
            )

    def step(self, rows: Sequence[StaticRow]) -> list[np.ndarray]:
        """One inference over every slot; per row its hidden states [T, H] or, on the last stage,
        its logits [logits, vocab] (copies). Rows must name distinct slots."""
        for row in rows:
            self.check(row)
        if len({row.slot for row in rows}) != len(rows):
            raise InvalidArgument("slot_id", f"two rows name one slot of the {self.name}")
        ctx = self.max_context
        # A step of single tokens runs the decode twin: S rows instead of S x C.
        run = self._decode if all(len(row.positions) == 1 for row in rows) else self._chunked
        with self._lock:
            run.mask[:] = 0
            for row in rows:
                t, s = len(row.positions), row.slot
                run.x[s, :t] = row.inputs
                run.x[s, t:] = 0
                run.pos[s, :t] = row.positions
                run.pos[s, t:] = row.positions[-1]
                run.mask[s, : row.start] = 1
                run.mask[s, ctx : ctx + t] = 1
            run.req.infer()
            outs = []
            for row in rows:
                t, s, start = len(row.positions), row.slot, row.start
                for name, buf in self._cache.items():
                    buf[s, :, start : start + t] = run.new[name][s, :, :t]
                self.lengths[s] = start + t
                outs.append(run.out[s, t - row.logits : t].copy() if self.is_last else run.out[s, :t].copy())
            return outs

    def warmup(self) -> int:
        """Runs nothing: every port is static, so the plugin prepares each kernel when it compiles
        or imports the model; a first inference cost 1.2x the next (bench-static's
        ``first_inference_over_next``), less than a warm-up inference would add to every start.
        Returns the inferences run, 0."""
        return 0
