"""One compiled stage shard and its per-session KV state.

``ShardRunner`` verifies a stage's files against the export manifest and compiles its model
once; ``ShardSession`` owns one InferRequest (so one KV cache held as graph state) and the
validity mask of its physical cache positions.

Physical vs logical positions: every ``run`` appends its T tokens to the cache at physical
indices ``past_length .. past_length + T - 1`` and marks them valid. ``invalidate(start, end)``
masks physical positions out without touching the state (the speculative rewind); later
queries then ignore them. ``position_ids`` are logical (rotary) positions; by default a run
continues at the number of valid positions, which is right after rewinds of rejected tokens.
``trim(length)`` cuts the state physically instead: the reference the mask-based rewind is
tested against, and the cost it avoids (``time_trim``).

Draft trees (``run_chains``): the stage's attention mask is per cache position, not per query, so a
tree cannot run as one sequence; its root-to-leaf chains run as batch rows instead. The export's
``beam_idx`` input gathers the cache's batch rows before every inference: ``[row] * W`` copies
the sequence's cache into W rows for the chains, and after acceptance ``keep_chain`` makes the
next inference gather the accepted chain's row back into one. So the accepted path sits
contiguously at the physical positions it was written at, and its rejected tail is masked like
a chain's (docs/ARCHITECTURE.md, "Draft trees").
"""

from __future__ import annotations

import contextlib
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import openvino as ov
import structlog

from pipeshard.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from pipeshard.precision import DEFAULT_PRECISION, Configuration, configuration
from pipeshard.shard.compile_cache import cache_config
from pipeshard.shard.device import DEFAULT_DEVICE, device_properties
from pipeshard.shard.features import FEATURES, add_features_output
from pipeshard.shard.kvblob import KvBlob, KvSource
from pipeshard.shard.manifest import load_manifest, verify_shard

if TYPE_CHECKING:
    from pipeshard.shard.self_check import Proof

log = structlog.get_logger(__name__)

# Tokens of the warm-up prefill. The plugin allocates its buffers for the largest shape seen so
# far: a first request longer than the warm-up paid about 1.2x its second's TTFT (bench-prefill).
WARMUP_PREFILL = 1024


def compile_properties(
    precision: str = DEFAULT_PRECISION,
    num_threads: int | None = None,
    num_streams: int | None = None,
    config: Configuration | None = None,
) -> dict[str, Any]:
    """CPU compile properties: the LATENCY hint, and the configuration's (``config``, else the
    precision's: pipeshard/precision.py; ``default`` is DEFAULT_PRECISION)
      ``fast``   the plugin's own choice: on this hardware bf16 inference, a u8 KV cache and
                 activations quantized on the fly per group inside INT4/INT8 matmuls, which makes
                 a row's logits depend on the rows computed with it and on its prompt's chunking;
      ``f32``    f32 inference, an f32 KV cache and no dynamic quantization;
      ``exact``  the same as ``f32``, with the promise that speculation, chunking, prefix reuse
                 and batching never change a token (every row's logits within 1e-3 of one-row
                 decoding, 1.4e-4 measured);
      ``invariant`` on a paged stage, the ladder rung it proved (``config``); elsewhere ``exact``.
    Threads and streams left unset follow the hint (all cores, one stream)."""
    props: dict[str, Any] = {"PERFORMANCE_HINT": "LATENCY"}
    props |= (config or configuration(precision)).properties
    for field, value, key in (
        ("num_threads", num_threads, "INFERENCE_NUM_THREADS"),
        ("num_streams", num_streams, "NUM_STREAMS"),
    ):
        if value is not None:
            if value < 1:
                raise InvalidArgument(field, f"must be positive, got {value}")
            props[key] = int(value)
    return props


def check_room(past: int, new: int, max_context: int) -> None:
    """The one cache-size check, so an overflow has one status code wherever it is caught."""
    if past + new > max_context:
        raise ResourceExhausted(
            f"the cache would grow to {past + new} positions, beyond this export's max_context {max_context}"
        )


def check_activations(x: np.ndarray, *, is_first: bool, hidden_size: int) -> None:
    """The input port's contract, in one place for the runtime and the stage engine: int64 ids
    [1, T>0] on the first stage, float32 hidden states [1, T>0, H] on the others."""
    if is_first:
        if x.dtype != np.int64 or x.ndim != 2 or x.shape[0] != 1 or x.shape[1] == 0:
            raise InvalidArgument("input_ids", f"must be int64 [1, T>0], got {x.dtype} {list(x.shape)}")
    elif (
        x.dtype != np.float32
        or x.ndim != 3
        or x.shape[0] != 1
        or x.shape[1] == 0
        or x.shape[2] != hidden_size
    ):
        raise InvalidArgument(
            "hidden_states", f"must be float32 [1, T>0, {hidden_size}], got {x.dtype} {list(x.shape)}"
        )


def check_step(
    past: int,
    t: int,
    positions: int,
    return_last: int,
    *,
    max_context: int,
    is_last: bool,
    positions_field: str = "position_ids",
) -> None:
    """A step's checks against the session, in one place: the stage engine runs them before it
    touches a session's mask, the runtime before it touches the cache."""
    if positions != t:
        raise InvalidArgument(positions_field, f"has {positions} entries for {t} new tokens")
    check_room(past, t, max_context)
    if is_last and not 1 <= return_last <= t:
        raise InvalidArgument("return_last", f"must be in [1, {t}], got {return_last}")


class StageShard:
    """What every KV backend of one stage reads from the export (the stateful ``ShardRunner``, the
    paged ``PagedShard`` and the ``StaticShard``): the verified manifest entry, the stage's place
    and sizes, and how its models compile (device, precision, threads)."""

    def __init__(
        self,
        export_dir: Path | str,
        stage_index: int,
        precision: str,
        num_threads: int | None,
        *,
        verify: bool,
        core: ov.Core | None,
        device: str,
        num_streams: int | None = None,
        config: Configuration | None = None,
    ):
        self.export_dir = Path(export_dir)
        manifest = verify_shard(self.export_dir, stage_index) if verify else load_manifest(self.export_dir)
        self.manifest = manifest
        self.entry = manifest.stage(stage_index)
        self.stage_index = stage_index
        self.num_stages = manifest.num_stages
        self.is_first = stage_index == 0
        self.is_last = stage_index == self.num_stages - 1
        self.hidden_size = manifest.model.hidden_size
        self.vocab_size = manifest.model.vocab_size
        self.max_context = manifest.max_context
        self.precision = precision
        self.core = core or ov.Core()
        self.state_variables = list(self.entry.state_variables)
        # What a KV blob of this stage names (both backends capture the same per-layer K, V).
        self.kv_source = KvSource(
            model_fingerprint=manifest.model.fingerprint,
            export_id=manifest.export_id,
            stage_index=stage_index,
            layer_start=self.entry.layer_start,
            layer_end=self.entry.layer_end,
            names=tuple(self.state_variables),
            kv_heads=manifest.model.num_kv_heads,
            head_dim=manifest.model.head_dim,
        )
        self.device = device
        self.config = config or configuration(precision)
        self.proof: Proof | None = None  # the stage's self-check (self_check.prove)
        self._props = compile_properties(precision, num_threads, num_streams, self.config)

    def warmup(self) -> int:
        """Runs the inferences a fresh compiled shard needs before it serves; returns how many."""
        raise NotImplementedError

    def pool_bytes(self) -> int:
        """Bytes of a KV pool the shard allocates up front and ``reserve`` writes; 0: none (a
        stateful shard's caches come and go with its sessions)."""
        return 0

    def reserve(self) -> None:
        """Makes the up-front KV pool resident (``pool_bytes``); nothing without one."""

    def compile(self, model: ov.Model | str, compile_cache: str | Path | None) -> ov.CompiledModel:
        """Compile for the stage's device (checked, its properties adapted: device.py) through the
        compiled-model cache (compile_cache.py: "off" compiles every time, None or "" caches in the
        export folder)."""
        device = self.device
        config = device_properties(device, self._props, self.core, self.precision)
        config |= cache_config(compile_cache, self.manifest, device)
        started = time.perf_counter()
        compiled = self.core.compile_model(model, device, config)
        seconds = round(time.perf_counter() - started, 3)
        self.compile_seconds = seconds
        cache = config.get("CACHE_DIR")
        log.info("compiled", stage=self.stage_index, device=device, cache=cache, seconds=seconds)
        return compiled


class ShardRunner(StageShard):
    """A compiled stage of an export; hands out sessions (one InferRequest each)."""

    def __init__(
        self,
        export_dir: Path | str,
        stage_index: int,
        precision: str = DEFAULT_PRECISION,
        num_threads: int | None = None,
        *,
        num_streams: int | None = None,
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
            num_streams=num_streams,
            config=config,
        )
        model: ov.Model | str = str(self.export_dir / self.entry.model)
        if self.is_last:  # the final hidden state beside the logits, for feature-reading drafts
            model = add_features_output(self.core.read_model(model))
        self.compiled = self.compile(model, compile_cache)
        names = [p.get_any_name() for p in self.compiled.inputs]
        self.input_name = self.entry.input_name
        self._index = {n: i for i, n in enumerate(names)}
        for required in (self.input_name, "attention_mask", "position_ids"):
            if required not in self._index:
                raise InvalidArgument("export_dir", f"stage {stage_index} model has no `{required}` input")
        self.has_beam_idx = "beam_idx" in self._index
        # A draft's vocabulary slice: the token id of each logit column (None: column i is token i).
        manifest = self.manifest
        vocab_file = manifest.draft.vocab_ids if manifest.draft else None
        self.vocab_ids: np.ndarray | None = (
            np.load(self.export_dir / vocab_file, allow_pickle=False) if vocab_file else None
        )

    @property
    def output_name(self) -> str:
        return "logits" if self.is_last else "hidden_states"

    def compiled_properties(self) -> dict[str, str]:
        """A few properties the plugin actually chose (for logs and benchmarks)."""
        out = {}
        for key in (
            "INFERENCE_PRECISION_HINT",
            "KV_CACHE_PRECISION",
            "DYNAMIC_QUANTIZATION_GROUP_SIZE",
            "PERFORMANCE_HINT",
            "INFERENCE_NUM_THREADS",
            "NUM_STREAMS",
        ):
            with contextlib.suppress(RuntimeError):
                out[key] = str(self.compiled.get_property(key))
        return out

    def new_session(self) -> ShardSession:
        return ShardSession(self)

    def warmup(self, prefill: int = WARMUP_PREFILL, verify: int = 4, decode: int = 2) -> int:
        """Run a throwaway prefill, one multi-row step on the filled cache (a speculative verify)
        and a few decode steps; returns the number of inferences run. The CPU plugin allocates
        and prepares its kernels on the first inferences of new shapes, which would otherwise land
        in the first real request's TTFT."""
        session = self.new_session()
        prefill = max(1, min(prefill, self.max_context - verify - decode))
        steps = [prefill, verify] + [1] * decode
        for t in steps:
            x = (
                np.zeros((1, t), dtype=np.int64)
                if self.is_first
                else np.zeros((1, t, self.hidden_size), dtype=np.float32)
            )
            session.run(x, copy=False)
        return len(steps)


class ShardSession:
    """One sequence's KV cache on one stage (batch 1)."""

    def __init__(self, runner: ShardRunner):
        self.runner = runner
        self._req = runner.compiled.create_infer_request()
        self._idx = runner._index
        self._mask = np.ones(runner.max_context, dtype=np.int64)
        self._past = 0
        self._valid = 0
        self._rows = 1  # batch rows the state holds (W after a tree step of W chains)
        self._row = 0  # the row holding this sequence, gathered by the next inference
        self._tree_start = 0  # physical length before the last tree step
        if runner.has_beam_idx:
            self._beam_idx = np.zeros(1, dtype=np.int32)
            self._req.set_input_tensor(self._idx["beam_idx"], ov.Tensor(self._beam_idx, shared_memory=True))
        self._keep = np.zeros((), dtype=np.int64)
        if runner.is_last:
            self._req.set_input_tensor(self._idx["logits_to_keep"], ov.Tensor(self._keep, shared_memory=True))

    # -- state ------------------------------------------------------------------------------
    @property
    def past_length(self) -> int:
        """Physical cache length: positions written so far, valid or not."""
        return self._past

    @property
    def valid_length(self) -> int:
        """Cache positions currently valid (the default next logical position)."""
        return self._valid

    @property
    def mask(self) -> np.ndarray:
        """A copy of the validity mask of the physical positions [0, past_length)."""
        return self._mask[: self._past].copy()

    @property
    def infer_request(self) -> ov.InferRequest:
        return self._req

    def reset(self) -> None:
        """Forget the sequence: empty KV state, every position valid again."""
        self._req.reset_state()
        self._mask[:] = 1
        self._past = 0
        self._valid = 0
        self._rows, self._row = 1, 0

    @property
    def pending_chains(self) -> bool:
        """A tree step ran and no step has named the chain to keep yet."""
        return self._rows > 1

    @property
    def tree_start(self) -> int:
        """Physical length before the last tree step (every chain's row agrees below it)."""
        return self._tree_start

    @property
    def kv_row(self) -> int:
        """The batch row of the state that holds this sequence's cache."""
        return self._row

    def keep_chain(self, index: int) -> None:
        """After ``run_chains``: keep chain ``index``'s cache (the next inference gathers it)."""
        if self._rows == 1 or not 0 <= index < self._rows:
            raise InvalidArgument(
                "tree_keep", f"must name one of the {self._rows} chains of the last step, got {index}"
            )
        self._row, self._rows = index, 1

    def _check_chosen(self) -> None:
        if self._rows > 1:
            raise InvalidArgument(
                "tree_keep", f"the last step ran {self._rows} chains: this step must name the one to keep"
            )

    def invalidate(self, start: int, end: int) -> None:
        """Mask physical positions [start, end) out of every later query (state untouched)."""
        if not 0 <= start <= end <= self._past:
            raise InvalidArgument(
                "invalidate", f"range [{start}, {end}) is outside the cache of {self._past}"
            )
        self._valid -= int(np.count_nonzero(self._mask[start:end]))
        self._mask[start:end] = 0

    def trim(self, length: int) -> None:
        """Cut the KV state physically to its first ``length`` positions; later runs continue there.

        Every state variable is read out and written back sliced. The CPU plugin hands the state
        out as f32 whatever its cache precision and re-quantizes it on write; with the u8 cache of
        the default precision the kept positions came back within 2e-6 (f32: exactly). Holes
        masked by ``invalidate`` before ``length`` stay masked.
        """
        if not 0 <= length <= self._past:
            raise InvalidArgument("trim", f"length {length} is outside the cache of {self._past}")
        if length == 0:
            self.reset()
            return
        if length < self._past:
            for state in self._req.query_state():
                kept = np.ascontiguousarray(state.state.data[:, :, :length])  # a fresh array: safe to share
                state.state = ov.Tensor(kept, shared_memory=True)
        self._mask[length:] = 1
        self._past = length
        self._valid = int(np.count_nonzero(self._mask[:length]))

    def restored(self, length: int) -> None:
        """The state now holds ``length`` valid positions written by ``import_kv``."""
        self._mask[:] = 1
        self._past = length
        self._valid = length
        self._rows, self._row = 1, 0

    # -- compute ----------------------------------------------------------------------------
    def features(self) -> np.ndarray:
        """The last stage's final normed hidden state at the positions the last run returned
        logits for: [n, H] (of a chain run: chain after chain), a copy."""
        if not self.runner.is_last:
            raise InvalidArgument("features", f"stage {self.runner.stage_index} is not the last stage")
        out = self._req.get_tensor(FEATURES).data
        return out.reshape(-1, out.shape[-1]).copy()

    def _check_input(self, x: np.ndarray) -> np.ndarray:
        """Takes 1-D ids as one row and any integer (or float) dtype the port can hold losslessly."""
        r = self.runner
        if r.is_first:
            if x.ndim == 1:
                x = x.reshape(1, -1)
            if x.dtype != np.int64:
                if not np.issubdtype(x.dtype, np.integer):
                    raise InvalidArgument("input_ids", f"must be integer token ids, got {x.dtype}")
                x = x.astype(np.int64)
        elif x.dtype != np.float32:
            x = x.astype(np.float32)
        check_activations(x, is_first=r.is_first, hidden_size=r.hidden_size)
        return np.ascontiguousarray(x)

    def run(
        self,
        x: np.ndarray,
        position_ids: np.ndarray | None = None,
        return_last: int = 1,
        *,
        copy: bool = True,
    ) -> np.ndarray:
        """Append T tokens: ``x`` is int64 ids [1, T] (stage 0) or f32 hidden states [1, T, H].

        Returns hidden states [1, T, H], or on the last stage logits [1, return_last, vocab] of
        the last ``return_last`` positions. With ``copy=False`` the result is a view of the
        request's output buffer, valid until this session runs again.
        """
        r = self.runner
        x = self._check_input(np.asarray(x))
        t = x.shape[1]
        past = self._past
        total = past + t
        if position_ids is None:
            pos = np.arange(self._valid, self._valid + t, dtype=np.int64).reshape(1, t)
        else:
            pos = np.ascontiguousarray(np.asarray(position_ids, dtype=np.int64).reshape(1, -1))
        check_step(past, t, pos.shape[1], return_last, max_context=r.max_context, is_last=r.is_last)
        self._check_chosen()
        if r.is_last:
            self._keep[...] = return_last
        self._mask[past:total] = 1
        mask = self._mask[:total].reshape(1, total)
        req, idx = self._req, self._idx
        req.set_input_tensor(idx[r.input_name], ov.Tensor(x, shared_memory=True))
        req.set_input_tensor(idx["attention_mask"], ov.Tensor(mask, shared_memory=True))
        req.set_input_tensor(idx["position_ids"], ov.Tensor(pos, shared_memory=True))
        if self._row:  # the first inference after a tree step gathers the kept chain
            self._beam_idx[0] = self._row
        req.infer()
        if self._row:
            self._beam_idx[0] = self._row = 0
        self._past = total
        self._valid += t
        out = req.get_output_tensor(0).data
        return out.copy() if copy else out

    def run_chains(
        self, x: np.ndarray, position_ids: np.ndarray, chains: int, return_last: int = 1
    ) -> np.ndarray:
        """Run ``chains`` equal-length chains that each continue this sequence: ``x`` holds them
        concatenated ([1, W*T] ids or [1, W*T, H] hidden states), ``position_ids`` their W*T
        logical positions. Returns [1, W*T, H], or logits [1, W*return_last, vocab] on the last
        stage, chain after chain. Until ``keep_chain`` names the chain to keep, no step may run."""
        r = self.runner
        if not r.has_beam_idx:
            raise InvalidArgument("tree_chains", "this stage's export has no beam_idx input: no draft trees")
        x = self._check_input(np.asarray(x))
        n = x.shape[1]
        if chains < 2 or n % chains:
            raise InvalidArgument(
                "tree_chains", f"must be >= 2 and divide the step's {n} tokens, got {chains}"
            )
        t = n // chains
        pos = np.ascontiguousarray(np.asarray(position_ids, dtype=np.int64).reshape(-1))
        check_step(
            self._past, t, pos.size // chains, return_last, max_context=r.max_context, is_last=r.is_last
        )
        if pos.size != n:
            raise InvalidArgument("position_ids", f"has {pos.size} entries for {n} new tokens")
        self._check_chosen()
        past, total = self._past, self._past + t
        self._tree_start = past
        if r.is_last:
            self._keep[...] = return_last
        self._mask[past:total] = 1
        req, idx = self._req, self._idx
        rows = np.ascontiguousarray(x.reshape(chains, t, *x.shape[2:]))
        req.set_input_tensor(idx[r.input_name], ov.Tensor(rows))
        req.set_input_tensor(idx["attention_mask"], ov.Tensor(np.tile(self._mask[:total], (chains, 1))))
        req.set_input_tensor(idx["position_ids"], ov.Tensor(pos.reshape(chains, t)))
        req.set_input_tensor(idx["beam_idx"], ov.Tensor(np.full(chains, self._row, dtype=np.int32)))
        try:
            req.infer()
        finally:
            req.set_input_tensor(idx["beam_idx"], ov.Tensor(self._beam_idx, shared_memory=True))
        self._beam_idx[0] = self._row = 0
        self._rows = chains
        self._past = total
        self._valid += t
        out = req.get_output_tensor(0).data
        return out.reshape(1, -1, out.shape[-1]).copy()


def export_kv(
    session: ShardSession,
    positions: int | None = None,
    token_ids=(),
    *,
    checksum: bool = True,
    start: int = 0,
) -> KvBlob:
    """The session's KV as a blob: the mask-valid positions [start, positions) (default: all; a
    ``start`` above 0 makes a part, kvblob.join_parts), masked holes dropped, every state variable
    in layer order. ``checksum=False`` skips hashing the bytes (a capture that never leaves this
    process)."""
    valid = session.valid_length
    n = valid if positions is None else positions
    if not 0 < n <= valid:
        raise InvalidArgument("positions", f"must be in [1, {valid}] (the valid positions), got {n}")
    if not 0 <= start < n:
        raise InvalidArgument("from_position", f"must be in [0, {n - 1}], got {start}")
    keep = np.flatnonzero(session.mask)[:n]
    if session.pending_chains and keep[-1] >= session.tree_start:
        raise FailedPrecondition(
            f"positions past {session.tree_start} differ by chain until the next step names the one to keep"
        )
    contiguous = keep[-1] == n - 1  # no holes before position n: a slice, no gather
    states = {s.name: s for s in session.infer_request.query_state()}
    arrays = []
    for name in session.runner.state_variables:
        data = states[name].state.data[session.kv_row]  # [kv_heads, past, head_dim]
        arrays.append(data[:, start:n] if contiguous else data[:, keep[start:]])
    return KvBlob.build(session.runner.kv_source, arrays, tuple(token_ids), checksum=checksum, start=start)


def import_kv(session: ShardSession, blob: KvBlob, *, verify_checksum: bool = True) -> None:
    """Load ``blob`` into an empty session; later runs continue at position ``blob.positions``.
    Refuses a blob of another model, export or layer range, a damaged one and wrong shapes
    before touching the session."""
    runner = session.runner
    blob.check_for(runner.kv_source, verify_checksum=verify_checksum)
    if session.past_length:
        raise FailedPrecondition(
            f"KV restore needs an empty session; this one holds {session.past_length} positions"
        )
    t = blob.positions
    if not 0 < t <= runner.max_context:
        raise InvalidArgument("snapshot.states", f"must hold 1..{runner.max_context} positions, got {t}")
    states = {s.name: s for s in session.infer_request.query_state()}
    for name, array in zip(runner.state_variables, blob.arrays, strict=True):
        # Copied in (shared_memory=False): the blob stays the caller's, later runs write the state.
        states[name].state = ov.Tensor(np.ascontiguousarray(array[None]), shared_memory=False)
    session.restored(t)


def time_trim(session: ShardSession, reps: int = 20) -> float:
    """Median seconds of one ``trim`` dropping one position: each rep appends a token (untimed) and
    trims it off again, so the session ends as it started."""
    if session.past_length < 1 or reps < 1:
        raise InvalidArgument("time_trim", "needs a session with cached positions and reps >= 1")
    x = (
        np.zeros((1, 1), dtype=np.int64)
        if session.runner.is_first
        else np.zeros((1, 1, session.runner.hidden_size), dtype=np.float32)
    )
    times = []
    for _ in range(reps):
        length = session.past_length
        session.run(x, copy=False)
        t0 = time.perf_counter()
        session.trim(length)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
