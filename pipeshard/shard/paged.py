"""A stage shard that runs rows of many sequences in one inference over a paged KV cache.

At load time the stage's model goes through OpenVINO's PagedAttention pass (the
SDPAToPagedAttention transformation openvino_genai's continuous batching runs): the graph then
takes the tokens of every sequence of a step concatenated, with ``past_lens``,
``subsequence_begins`` and per-sequence block tables into per-layer K/V block pools that this
module owns. So decode tokens and prefill chunks of different sequences, of different lengths,
share one inference, and sequences join and leave between any two steps.

Two graph edits make our export fit the pass and serve batches:
  * a later stage's ``hidden_states`` input is renamed ``inputs_embeds`` (friendly AND tensor
    name): the pass finds the input by tensor name but makes it 2-D [tokens, hidden] only when
    the friendly name matches; left 3-D, the stage broadcast position tensors against the token
    axis at inference;
  * on the last stage the LM head reads its rows through a Gather on a new ``logits_indices``
    input (the ``logits_to_keep`` slice is meaningless once all sequences share one token axis),
    so a 1024-token prefill chunk asks for one row of logits, not a 1024 x 49152 matmul.

A sliding-window layer (Gemma 3's local layers) gets its window as its PagedAttention's
``sliding_window`` input (the pass leaves 0, attend to everything, since it drops the export's
in-graph window mask with the rest of the mask); global layers keep 0. Local layers also get
their own block table (``local_block_indices``): a sequence's local-layer blocks are taken as
its tokens arrive and given back once they lie wholly before the window of every token still
to come (at a step's start, behind its first token's window), so a local layer holds about
window + one block of tokens per sequence instead of the whole context. A dropped block's table
entry points at a zeroed block the window masks out. A rewind into dropped blocks, and a capture
of them, is refused by name; the global table still reserves the whole capacity at open.

A third edit serves draft trees: every PagedAttention's query-to-query mask inputs (QQ_BIAS,
QQ_BIAS_BEGINS, inputs 26 and 27 of the op, left as empty constants by the pass) become the
parameters ``qq_bias`` and ``qq_bias_begins``. A row with ``parents`` then runs as one sequence
whose tokens each attend the cache and their own ancestors only (the CPU plugin's per-sequence
square ancestor mask; an empty range keeps a row causal, and a step without tree rows passes no
mask at all). ``move`` then shifts the accepted path's cache slots down behind the cache.

Memory: the block pools are allocated once from a byte budget; a sequence reserves the blocks
for its whole capacity when it opens (admission), so nothing is evicted from under a running
sequence and a step never fails for want of blocks. Rewind (the rejected drafts of speculation)
shortens a sequence's length: the next step overwrites those cache slots, nothing is copied.

Shared prefixes: a full block of a kept sequence can be *pinned* under its prefix key (``pin``,
the prefix cache's keep), and a fresh sequence whose prompt starts with those blocks references
them (``share``) instead of copying them: its own block for that slot goes back to the pool.
Blocks are counted by reference, so n sequences on one prompt hold the prompt's full blocks
once. A sequence only writes at or past its length, and every block from there on is its own;
a rewind into blocks it shares first takes its own blocks back (copying the partial one), which
needs free blocks then. Pinned blocks no sequence uses are the pool's cache: the first to go
(least recently used first) when a sequence needs room.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import openvino as ov
import openvino.opset13 as ops
from openvino._offline_transformations import paged_attention_transformation

from pipeshard.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from pipeshard.precision import DEFAULT_PRECISION, Configuration
from pipeshard.shard.compile_cache import OFF
from pipeshard.shard.device import DEFAULT_DEVICE
from pipeshard.shard.features import FEATURES, add_features_output
from pipeshard.shard.kvblob import BlockLayout
from pipeshard.shard.manifest import ModelInfo
from pipeshard.shard.runtime import StageShard

# Default KV budget per stage: 256 MiB hold about 11,000 f32 tokens of a 15-layer SmolLM2 stage.
DEFAULT_CACHE_BYTES = 256 * 1024 * 1024
LOGITS_INDICES = "logits_indices"
QQ_BIAS, QQ_BIAS_BEGINS = "qq_bias", "qq_bias_begins"
_PA_QQ_BIAS = 26  # the PagedAttentionExtension inputs of the query-to-query mask (and 27, its begins)
_PA_SLIDING_WINDOW = 10  # its sliding-window input: 0 attends to the whole cache
_PA_BLOCK_INDICES = 7  # its block table (and 8, the table's per-sequence begins)
LOCAL_BLOCK_INDICES, LOCAL_BLOCK_INDICES_BEGINS = "local_block_indices", "local_block_indices_begins"


@dataclass(frozen=True)
class PagedRow:
    """One sequence's part of a step.

    ``inputs``: int64 token ids [T] on the first stage, float32 hidden states [T, hidden] on the
    others. ``positions``: the T logical (rotary) positions; None continues at the sequence's
    length. ``logits``: on the last stage, how many trailing tokens of the row get logits (0:
    none, for a prefill chunk that is not the prompt's last). ``parents``: a draft tree's row,
    each token's parent index within the row (-1: the cache); None: causal."""

    seq: Hashable
    inputs: np.ndarray
    positions: np.ndarray | None = None
    logits: int = 0
    parents: Sequence[int] | None = None


@dataclass(frozen=True)
class CacheUsage:
    """The block pool's budget and use, in bytes and blocks (GetStageInfo reports it)."""

    budget_bytes: int
    block_bytes: int  # every layer's pools, per block
    block_tokens: int
    blocks_total: int
    blocks_used: int  # referenced by some sequence (a shared block once)
    sequences: int
    blocks_cached: int = 0  # pinned prefix blocks no sequence uses (given up for room on demand)
    local_block_bytes: int = 0  # the local (sliding-window) layers' share of block_bytes
    local_blocks_used: int = 0  # blocks the local layers hold (they give back what leaves the window)

    @property
    def bytes_used(self) -> int:
        return (
            self.blocks_used * (self.block_bytes - self.local_block_bytes)
            + self.local_blocks_used * self.local_block_bytes
        )

    @property
    def blocks_free(self) -> int:
        """Blocks a new sequence may take: the free ones and the cached ones it would evict."""
        return self.blocks_total - self.blocks_used


@dataclass
class _Sequence:
    blocks: np.ndarray  # int32 block ids reserved for the sequence's whole capacity
    capacity: int  # tokens the reservation holds
    length: int = 0  # tokens in the cache
    local: list[int] = field(default_factory=list)  # local layers' block per logical block
    dropped: int = 0  # local layers' logical blocks [0, dropped) given back (their entries: the null block)
    # The last step's inputs and their logical positions, from cache slot ``fed_at`` on: what a
    # two-token row re-feeds (None after an import, whose inputs the stage never saw).
    fed: np.ndarray | None = None
    fed_positions: np.ndarray | None = None
    fed_at: int = 0

    def move_fed(self, src: np.ndarray, dst: np.ndarray) -> None:
        """The fed inputs follow their cache slots as a draft tree's path moves down (the next
        one-token row re-feeds the path's last token); forgotten if the move leaves them."""
        if self.fed is None or self.fed_positions is None:
            return
        s, d = src - self.fed_at, dst - self.fed_at
        if min(s.min(), d.min()) < 0 or max(s.max(), d.max()) >= len(self.fed):
            self.fed = None
            return
        self.fed, self.fed_positions = self.fed.copy(), self.fed_positions.copy()
        self.fed[d] = self.fed[s]
        self.fed_positions[d] = self.fed_positions[s]

    def previous(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The input and position of the token in the cache's last slot, when this stage fed it."""
        i = self.length - 1 - self.fed_at
        if self.fed is None or self.fed_positions is None or not 0 <= i < len(self.fed):
            return None
        return self.fed[i : i + 1], self.fed_positions[i : i + 1]


def _prepare_model(model: ov.Model, is_first: bool, is_last: bool) -> ov.Model:
    """Apply the PagedAttention pass (with the input naming it needs) and, on the last stage,
    the logits row gather."""
    if not is_first:
        for p in model.get_parameters():
            if p.get_output_tensor(0).get_any_name() == "hidden_states":
                p.set_friendly_name("inputs_embeds")
                p.get_output_tensor(0).set_names({"inputs_embeds"})
    paged_attention_transformation(model, False, False, False)
    _mask_inputs(model)
    if is_last:
        head = model.get_results()[0].input(0).get_source_output().get_node()
        keep = head.input(0).get_source_output().get_node()
        if head.get_type_name() != "MatMul" or keep.get_type_name() != "Gather":
            raise InvalidArgument("export_dir", "the last stage's LM head is not MatMul(Gather(hidden))")
        indices = ops.parameter([-1], ov.Type.i64, name=LOGITS_INDICES)
        indices.get_output_tensor(0).set_names({LOGITS_INDICES})
        rows = ops.gather(keep.input(0).get_source_output(), indices, ops.constant(0, ov.Type.i64))
        head.input(0).replace_source_output(rows.output(0))
        model.add_parameters([indices])
        for p in model.get_parameters():
            if p.get_friendly_name() == "logits_to_keep":
                model.remove_parameter(p)
        model.validate_nodes_and_infer_types()
        add_features_output(model)  # after the gather: the features of exactly the scored rows
    return model


def _mask_inputs(model: ov.Model) -> None:
    """Every PagedAttention's query-to-query mask inputs as the model's ``qq_bias`` (u8, the
    concatenated square ancestor masks) and ``qq_bias_begins`` (i32, each sequence's range)."""
    bias = ops.parameter([-1], ov.Type.u8, name=QQ_BIAS)
    begins = ops.parameter([-1], ov.Type.i32, name=QQ_BIAS_BEGINS)
    for p in (bias, begins):
        p.get_output_tensor(0).set_names({p.get_friendly_name()})
    attention = [n for n in model.get_ordered_ops() if n.get_type_name() == "PagedAttentionExtension"]
    if any(n.get_input_size() <= _PA_QQ_BIAS + 1 for n in attention):
        raise InvalidArgument("export_dir", "this OpenVINO's PagedAttention takes no query-to-query mask")
    for node in attention:
        node.input(_PA_QQ_BIAS).replace_source_output(bias.output(0))
        node.input(_PA_QQ_BIAS + 1).replace_source_output(begins.output(0))
    model.add_parameters([bias, begins])


def _window_inputs(model: ov.Model, layer_start: int, info: ModelInfo) -> set[int]:
    """Each local layer's PagedAttention attends within the model's sliding window and reads its
    own block table (``local_block_indices``); returns the stage's local layers, numbered from
    its first layer as its pools are (``key_cache.n``)."""
    if not info.local_layers or info.sliding_window is None:
        return set()
    local: set[int] = set()
    table = ops.parameter([-1], ov.Type.i32, name=LOCAL_BLOCK_INDICES)
    begins = ops.parameter([-1], ov.Type.i32, name=LOCAL_BLOCK_INDICES_BEGINS)
    for p in (table, begins):
        p.get_output_tensor(0).set_names({p.get_friendly_name()})
    for node in model.get_ordered_ops():
        if node.get_type_name() != "PagedAttentionExtension":
            continue
        n = int(node.input(3).get_source_output().get_node().get_friendly_name().rsplit(".", 1)[1])
        if layer_start + n in info.local_layers:
            local.add(n)
            window = ops.constant(np.array(info.sliding_window, dtype=np.int32))
            node.input(_PA_SLIDING_WINDOW).replace_source_output(window.output(0))
            node.input(_PA_BLOCK_INDICES).replace_source_output(table.output(0))
            node.input(_PA_BLOCK_INDICES + 1).replace_source_output(begins.output(0))
    if local:
        model.add_parameters([table, begins])
    model.validate_nodes_and_infer_types()
    return local


def ancestor_mask(parents: Sequence[int]) -> np.ndarray:
    """u8 [T, T]: token i sees token j when j is i or one of its ancestors."""
    mask = np.eye(len(parents), dtype=np.uint8)
    for i, parent in enumerate(parents):
        if parent >= 0:
            mask[i] |= mask[parent]
    return mask


class PagedShard(StageShard):
    """One compiled stage with a paged KV cache shared by many sequences (one InferRequest)."""

    def __init__(
        self,
        export_dir: Path | str,
        stage_index: int,
        precision: str = DEFAULT_PRECISION,
        num_threads: int | None = None,
        *,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        verify: bool = True,
        core: ov.Core | None = None,
        device: str = DEFAULT_DEVICE,
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
        self.two_token_rows = self.config.two_token_rows
        model = _prepare_model(
            self.core.read_model(str(self.export_dir / self.entry.model)), self.is_first, self.is_last
        )
        local_layers = _window_inputs(model, self.entry.layer_start, self.manifest.model)
        self.window = self.manifest.model.sliding_window if local_layers else None
        # No compiled-model cache here: OpenVINO 2026.4 writes a blob for this model transformed in
        # memory but never loads it (LOADED_FROM_CACHE stays false; each try cost 1-4 s more than
        # compiling on a SmolLM2 stage), and the transformed graph cannot be saved as IR to cache
        # by path (its PagedAttention nodes lose the runtime info the CPU plugin needs).
        self.compiled = self.compile(model, OFF)
        self._req = self.compiled.create_infer_request()
        self._input = "input_ids" if self.is_first else "inputs_embeds"
        cache_ports = [
            p for p in self.compiled.inputs if p.get_any_name().startswith(("key_cache.", "value_cache."))
        ]
        if not cache_ports:
            raise InvalidArgument("export_dir", f"stage {stage_index} has no attention layers to page")
        shapes = [p.get_partial_shape() for p in cache_ports]
        # Tokens per block from a value cache: a u8 key cache (the default precision) stores its
        # per-token scales and zero points as extra rows, [blocks, heads, 32 + 8, head_dim].
        values = [s for p, s in zip(cache_ports, shapes, strict=True) if "value_" in p.get_any_name()]
        self.block_tokens = values[0][2].get_length()
        block_bytes = sum(
            p.get_element_type().size * math.prod(s[i].get_length() for i in (1, 2, 3))
            for p, s in zip(cache_ports, shapes, strict=True)
        )
        if cache_bytes < block_bytes:
            raise InvalidArgument(
                "cache_bytes", f"must hold at least one block ({block_bytes} bytes), got {cache_bytes}"
            )
        self.block_bytes = block_bytes
        self.cache_bytes = cache_bytes
        self.blocks_total = cache_bytes // block_bytes
        # Local layers' pools hold one more block, the null block their dropped entries point at.
        self._null = self.blocks_total
        self.local_block_bytes = 0
        for port, shape in zip(cache_ports, shapes, strict=True):
            name = port.get_any_name()
            local = int(name.rsplit(".", 1)[1]) in local_layers
            dims = [self.blocks_total + local] + [shape[i].get_length() for i in (1, 2, 3)]
            tensor = ov.Tensor(port.get_element_type(), dims)
            if local:
                tensor.data[self._null] = 0  # masked out by the window, but never NaN
                self.local_block_bytes += tensor.byte_size // dims[0]
            self._req.set_tensor(name, tensor)
        # The pools in the order of the KV blob's state variables: K, V of each layer.
        self._state_pools = [
            f"{kind}.{i}" for i in range(len(cache_ports) // 2) for kind in ("key_cache", "value_cache")
        ]
        self._local_pools = {f"{kind}.{i}" for i in local_layers for kind in ("key_cache", "value_cache")}
        self._local_free = list(range(self.blocks_total - 1, -1, -1))
        self.kv_source = replace(self.kv_source, blocks=self._block_layout())
        # One value per slot (f32, f16, bf16 pools): a slot moves by copying it. A u8 pool keeps
        # each token's scale and zero point in extra rows of its block, so its slots do not move.
        self.moves_slots = all(
            self._req.get_tensor(name).element_type != ov.Type.u8 for name in self._state_pools
        )
        self._free = list(range(self.blocks_total - 1, -1, -1))  # pop() hands out low ids first
        self._refs = np.zeros(self.blocks_total, dtype=np.int32)  # sequences referencing each block
        self._pinned = np.zeros(self.blocks_total, dtype=bool)
        self._pins: OrderedDict[Hashable, int] = OrderedDict()  # prefix key -> block, oldest use first
        self._seqs: dict[Hashable, _Sequence] = {}
        self._lock = threading.Lock()

    def _block_layout(self) -> BlockLayout | None:
        """None for f32 pools (captured as f32 positions, like a stateful stage); a quantized
        pool's blocks are captured verbatim, scale and zero-point rows included."""
        tensors = [self._req.get_tensor(name) for name in self._state_pools]
        if all(t.element_type == ov.Type.f32 for t in tensors):
            return None
        dtype = tensors[0].data.dtype.name
        return BlockLayout(dtype, self.block_tokens, tuple(tuple(t.shape[1:]) for t in tensors))

    # -- sequences ---------------------------------------------------------------------------
    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_tokens)

    def open(self, seq: Hashable, capacity: int) -> None:
        """Reserve the blocks for ``capacity`` tokens of a new sequence, or refuse (admission)."""
        if not 1 <= capacity <= self.max_context:
            raise InvalidArgument("capacity", f"must be in [1, {self.max_context}], got {capacity}")
        need = self.blocks_for(capacity)
        with self._lock:
            if seq in self._seqs:
                raise InvalidArgument("seq", f"sequence {seq!r} is already open")
            blocks = self._take(need, f"{capacity} tokens")
            self._seqs[seq] = _Sequence(blocks=blocks, capacity=need * self.block_tokens)

    def free(self, seq: Hashable) -> bool:
        """Give a sequence's blocks back; False if it was not open."""
        with self._lock:
            state = self._seqs.pop(seq, None)
            if state is None:
                return False
            self._release(state.blocks[::-1])
            self._local_free.extend(b for b in state.local[::-1] if b != self._null)
            return True

    def pin(self, seq: Hashable, keys: Sequence[Hashable]) -> int:
        """Keeps the sequence's leading full blocks in the pool under their prefix keys (one key
        per block, in order), for ``share``; returns how many were newly pinned. A shard with
        local (sliding-window) layers pins nothing: their blocks follow a table of their own that
        sharing does not cover, so its restores copy."""
        with self._lock:
            state = self._get(seq)
            if self._local_pools:
                return 0
            if len(keys) * self.block_tokens > state.length:
                raise InvalidArgument(
                    "keys", f"name {len(keys)} full blocks; sequence {seq!r} holds {state.length} tokens"
                )
            added = 0
            for key, block in zip(keys, state.blocks, strict=False):
                if key in self._pins:
                    self._pins.move_to_end(key)
                    continue
                self._pins[key] = int(block)
                self._pinned[block] = True
                added += 1
            return added

    def share(self, seq: Hashable, keys: Sequence[Hashable]) -> int:
        """An empty sequence references the pinned blocks of its leading prefix keys (up to the
        first not pinned) instead of its own, which go back to the pool; its length becomes the
        positions they hold. Returns the blocks shared."""
        with self._lock:
            state = self._get(seq)
            if state.length:
                raise InvalidArgument("seq", f"sequence {seq!r} must be empty to share a prefix")
            shared = 0
            for key in keys[: len(state.blocks)]:
                block = self._pins.get(key)
                if block is None:
                    break
                self._pins.move_to_end(key)
                own = int(state.blocks[shared])
                state.blocks[shared] = block
                self._refs[block] += 1
                self._release([own])
                shared += 1
            state.length = shared * self.block_tokens
            return shared

    def _take(self, n: int, purpose: str) -> np.ndarray:
        """``n`` blocks for a sequence, evicting cached (pinned, unused) ones if the free ones are
        too few; refuses naming the budget when even that is not enough."""
        if n > len(self._free):
            for key, block in list(self._pins.items()):
                if len(self._free) >= n:
                    break
                if not self._refs[block]:
                    del self._pins[key]
                    self._pinned[block] = False
                    self._free.append(block)
        if n > len(self._free):
            raise ResourceExhausted(
                f"the KV cache budget of {self.cache_bytes} bytes ({self.blocks_total} blocks of "
                f"{self.block_tokens} tokens) has {len(self._free)} blocks free; {purpose} need {n}"
            )
        blocks = np.array([self._free.pop() for _ in range(n)], dtype=np.int32)
        self._refs[blocks] += 1
        return blocks

    def _release(self, blocks: Sequence[int] | np.ndarray) -> None:
        for block in blocks:
            self._refs[block] -= 1
            if not self._refs[block] and not self._pinned[block]:
                self._free.append(int(block))

    def _own_from(self, state: _Sequence, index: int) -> None:
        """Makes the sequence's blocks from ``index`` on its own (where it will write): each one
        it shares is replaced by a new block, the first holding a copy (its leading positions
        may still be in use)."""
        tail = state.blocks[index:]
        shared = np.nonzero((self._refs[tail] > 1) | self._pinned[tail])[0]
        if not shared.size:
            return
        fresh = self._take(len(shared), "the blocks a rewound sequence shared")
        for i, new in zip(shared, fresh, strict=True):
            old = int(tail[i])
            if i == 0:
                for name in self._state_pools:
                    if name in self._local_pools:
                        continue  # never shared (``pin``)
                    pool = self._pool(name)
                    pool[new] = pool[old]
            tail[i] = new
            self._release([old])

    def length(self, seq: Hashable) -> int:
        return self._get(seq).length

    def capacity(self, seq: Hashable) -> int:
        """Tokens the sequence's reservation holds (its blocks times the block size)."""
        return self._get(seq).capacity

    def rewind(self, seq: Hashable, length: int) -> None:
        """Shorten a sequence to its first ``length`` tokens (speculation's rejected drafts): the
        slots past it are simply overwritten by the next step; nothing moves or is copied."""
        with self._lock:
            state = self._get(seq)
            if not 0 <= length <= state.length:
                raise InvalidArgument(
                    "length", f"must be in [0, {state.length}] for sequence {seq!r}, got {length}"
                )
            if length == 0:  # a fresh start: the local layers give back everything
                self._local_free.extend(b for b in state.local[::-1] if b != self._null)
                state.local, state.dropped = [], 0
            elif self.window is not None and state.dropped * self.block_tokens > max(
                0, length - self.window + 1
            ):
                raise InvalidArgument(
                    "length",
                    f"{length} would need tokens the local (sliding-window) layers of sequence {seq!r} gave "
                    f"back: they keep tokens from {state.dropped * self.block_tokens} on",
                )
            if length < state.length:
                self._own_from(state, length // self.block_tokens)
            state.length = length

    def move(self, seq: Hashable, start: int, kept: Sequence[int]) -> None:
        """The cache of the sequence's tokens at ``start + kept[i]`` moves to ``start + i`` (a
        draft tree's accepted path, ascending, behind the cache), in every layer's pools; the
        length is left to ``rewind``. A u8 pool keeps scales per token in its blocks, so only
        pools of one value per slot (f32, f16, bf16: ``moves_slots``) move."""
        with self._lock:
            state = self._get(seq)
            if all(k == i for i, k in enumerate(kept)):
                return
            if not self.moves_slots:
                raise InvalidArgument(
                    "tree_kept",
                    "draft trees need KV pools of one value per slot (f32, f16, bf16); this stage's are u8",
                )
            if start + kept[-1] >= state.length:
                raise InvalidArgument(
                    "tree_kept", f"slot {start + kept[-1]} lies beyond the {state.length} tokens cached"
                )
            bt = self.block_tokens
            self._own_from(state, start // bt)
            src = start + np.asarray(kept, dtype=np.int64)
            dst = start + np.arange(len(kept), dtype=np.int64)
            src, dst = src[src != dst], dst[src != dst]
            # Ascending: every source lies past every destination (kept[i] >= i), so one gather
            # then one scatter per pool is the slot-by-slot move.
            for name in self._state_pools:
                pool, table = self._pool(name), self._table(state, name)
                pool[table[dst // bt], :, dst % bt] = pool[table[src // bt], :, src % bt]
            state.move_fed(src, dst)

    def export_kv(self, seq: Hashable, positions: int | None = None, start: int = 0) -> list[np.ndarray]:
        """The sequence's cached tokens [start, positions) (default: all), one array per state
        variable in layer order (K, V of each layer): f32 [kv_heads, positions - start, head_dim]
        from f32 pools (``f32``/``exact``), else the blocks those positions fill, verbatim
        (``kv_source.blocks``). Only those blocks are read; ``start`` must begin a block."""
        with self._lock:  # a batched ring steps on a worker thread meanwhile
            state = self._get(seq)
            n = state.length if positions is None else positions
            if not 0 < n <= state.length:
                raise InvalidArgument("positions", f"must be in [1, {state.length}], got {n}")
            if not 0 <= start < n or start % self.block_tokens:
                raise InvalidArgument(
                    "from_position",
                    f"must be a multiple of {self.block_tokens} (the block size) below {n}, got {start}",
                )
            first = start // self.block_tokens
            if self._local_pools and first < state.dropped:
                raise InvalidArgument(
                    "positions",
                    f"the local (sliding-window) layers of sequence {seq!r} gave back its tokens before "
                    f"{state.dropped * self.block_tokens}; a capture from {start} needs them",
                )
            span = slice(first, self.blocks_for(n))
            tables = [self._table(state, name)[span] for name in self._state_pools]
            if self.kv_source.blocks is not None:  # fancy indexing copies
                return [self._pool(name)[t] for name, t in zip(self._state_pools, tables, strict=True)]
            return [
                np.concatenate(list(self._pool(name)[t]), axis=1)[:, : n - start]
                for name, t in zip(self._state_pools, tables, strict=True)
            ]

    def last_input(self, seq: Hashable, positions: int) -> np.ndarray | None:
        """The input this stage fed at the sequence's position ``positions - 1`` ([1] ids or
        [1, hidden]) when its last step fed it (two-token rows keep it), for a capture to carry."""
        with self._lock:
            state = self._get(seq)
            i = positions - 1 - state.fed_at
            if state.fed is None or state.fed_positions is None or not 0 <= i < len(state.fed):
                return None
            if positions > state.length or state.fed_positions[i] != positions - 1:
                return None
            return np.array(state.fed[i : i + 1])

    def import_kv(
        self,
        seq: Hashable,
        arrays: Sequence[np.ndarray],
        positions: int,
        start: int = 0,
        last_input: np.ndarray | None = None,
    ) -> None:
        """Write ``export_kv``'s arrays of tokens [start, positions) into an open sequence that
        holds ``start`` (a multiple of the block size); its length becomes ``positions``.
        ``last_input`` (``last_input``'s answer on the stage captured): re-fed before the next
        one-token row, as if this stage had fed it."""
        if last_input is not None:
            self._check_last_input(last_input)
        with self._lock:
            state = self._get(seq)
            if start % self.block_tokens or not 0 <= start <= min(state.length, positions):
                raise InvalidArgument(
                    "start", f"must be a block boundary within the {state.length} tokens held, got {start}"
                )
            self._own_from(state, start // self.block_tokens)
            if len(arrays) != len(self._state_pools):
                raise InvalidArgument(
                    "arrays", f"must hold {len(self._state_pools)} states, got {len(arrays)}"
                )
            if positions > state.capacity:
                raise ResourceExhausted(
                    f"{positions} tokens of KV exceed the sequence's reservation of {state.capacity}"
                )
            want = self.kv_source.shapes_for(positions - start)
            for name, array, shape in zip(self._state_pools, arrays, want, strict=True):
                if array.shape != shape:
                    raise InvalidArgument(
                        "arrays", f"{name} has shape {list(array.shape)}, not {list(shape)}"
                    )
            if state.dropped and start:
                raise InvalidArgument(
                    "start",
                    f"the local (sliding-window) layers of sequence {seq!r} gave back tokens before {start}",
                )
            if state.dropped:  # the import replaces the sequence: the local layers start afresh
                self._local_free.extend(b for b in state.local[::-1] if b != self._null)
                state.local, state.dropped = [], 0
            self._grow_local(state, self.blocks_for(positions))
            for name, array in zip(self._state_pools, arrays, strict=True):
                pool = self._pool(name)
                blocks = self._table(state, name)[start // self.block_tokens : self.blocks_for(positions)]
                if self.kv_source.blocks is not None:
                    pool[blocks] = array
                    continue
                bt = self.block_tokens
                for i, block in enumerate(blocks):
                    part = array[:, i * bt : (i + 1) * bt]
                    pool[block, :, : part.shape[1]] = part
            state.length = positions
            state.fed = None  # the restored positions' inputs were never fed here, but the last
            if last_input is not None and self.two_token_rows:
                fed = np.array(last_input, dtype=np.int64 if self.is_first else np.float32)
                state.fed, state.fed_at = fed, positions - 1
                state.fed_positions = np.array([positions - 1], dtype=np.int64)

    def _check_last_input(self, x: np.ndarray) -> None:
        if self.is_first:
            ok = x.shape == (1,) and np.issubdtype(x.dtype, np.integer)
            want = "int64 [1] (a token id)"
        else:
            ok = x.shape == (1, self.hidden_size) and x.dtype == np.float32
            want = f"float32 [1, {self.hidden_size}] (a hidden state)"
        if not ok:
            raise InvalidArgument("snapshot.last_input", f"must be {want}, got {x.dtype} {list(x.shape)}")

    def _pool(self, name: str) -> np.ndarray:
        return self._req.get_tensor(name).data

    def _table(self, state: _Sequence, name: str) -> np.ndarray:
        """The pool ``name``'s block id for each of the sequence's logical blocks."""
        if name in self._local_pools:
            return np.asarray(state.local, dtype=np.int32)
        return state.blocks

    def _grow_local(self, state: _Sequence, blocks: int) -> None:
        """Local-layer blocks for the sequence's first ``blocks`` logical blocks. It never holds
        more of them than its global reservation, and the local pools have as many blocks as the
        global ones, so the free list cannot run dry."""
        if self._local_pools:
            state.local += [self._local_free.pop() for _ in range(blocks - len(state.local))]

    def _drop_local(self, state: _Sequence) -> None:
        """Gives back the local-layer blocks wholly before the window of the sequence's next token
        (no token still to come, nor a rewind to it or past it, reads them)."""
        if self.window is None or not self._local_pools:
            return
        drop = min(max(0, state.length - self.window + 1) // self.block_tokens, len(state.local))
        for j in range(state.dropped, drop):
            self._local_free.append(state.local[j])
            state.local[j] = self._null
        state.dropped = max(state.dropped, drop)

    def held_bytes(self, seq: Hashable) -> int:
        """The KV bytes the sequence holds now: its whole reservation in the global layers' pools,
        the blocks its window still needs in the local layers'."""
        with self._lock:
            state = self._get(seq)
            local = sum(b != self._null for b in state.local)
            return (
                len(state.blocks) * (self.block_bytes - self.local_block_bytes)
                + local * self.local_block_bytes
            )

    def usage(self) -> CacheUsage:
        with self._lock:
            used = int(np.count_nonzero(self._refs))
            return CacheUsage(
                budget_bytes=self.cache_bytes,
                block_bytes=self.block_bytes,
                block_tokens=self.block_tokens,
                blocks_total=self.blocks_total,
                blocks_used=used,
                sequences=len(self._seqs),
                blocks_cached=self.blocks_total - len(self._free) - used,
                local_block_bytes=self.local_block_bytes,
                local_blocks_used=self.blocks_total - len(self._local_free) if self._local_pools else 0,
            )

    def _get(self, seq: Hashable) -> _Sequence:
        state = self._seqs.get(seq)
        if state is None:
            raise NotFound(f"sequence {seq!r} is not open on stage {self.stage_index}")
        return state

    # -- compute -----------------------------------------------------------------------------
    def _check_row(self, row: PagedRow, seen: set) -> tuple[_Sequence, np.ndarray, np.ndarray]:
        state = self._get(row.seq)
        if row.seq in seen:
            raise InvalidArgument("rows", f"sequence {row.seq!r} appears twice in one step")
        seen.add(row.seq)
        x = np.asarray(row.inputs)
        if self.is_first:
            if x.ndim != 1 or x.shape[0] == 0 or not np.issubdtype(x.dtype, np.integer):
                raise InvalidArgument(
                    "input_ids", f"must be integer ids [T>0], got {x.dtype} {list(x.shape)}"
                )
            x = x.astype(np.int64, copy=False)
        else:
            if x.ndim != 2 or x.shape[0] == 0 or x.shape[1] != self.hidden_size or x.dtype != np.float32:
                raise InvalidArgument(
                    "hidden_states",
                    f"must be float32 [T>0, {self.hidden_size}], got {x.dtype} {list(x.shape)}",
                )
        t = x.shape[0]
        if row.positions is None:
            pos = np.arange(state.length, state.length + t, dtype=np.int64)
        else:
            pos = np.asarray(row.positions)
            if pos.ndim != 1 or pos.shape[0] != t or not np.issubdtype(pos.dtype, np.integer):
                raise InvalidArgument(
                    "position_ids", f"must be integer [{t}] for {t} new tokens, got {list(pos.shape)}"
                )
            if pos.size and (pos.min() < 0 or pos.max() >= self.max_context):
                raise InvalidArgument(
                    "position_ids", f"must be in [0, {self.max_context}), got {pos.min()}..{pos.max()}"
                )
        if state.length + t > state.capacity:
            raise ResourceExhausted(
                f"sequence {row.seq!r} would grow to {state.length + t} tokens, "
                f"beyond its reservation of {state.capacity}"
            )
        if row.parents is not None and len(row.parents) != t:
            raise InvalidArgument("parents", f"must hold one entry per token ({t}), got {len(row.parents)}")
        if self.is_last:
            if not 0 <= row.logits <= t:
                raise InvalidArgument("logits", f"must be in [0, {t}], got {row.logits}")
        elif row.logits:
            raise InvalidArgument(
                "logits", f"only the last stage returns logits; stage {self.stage_index} is not"
            )
        return state, x, pos

    def step(self, rows: Sequence[PagedRow]) -> list[np.ndarray]:
        """Run one inference over ``rows`` (at most one per sequence) and return, per row, its
        hidden states [T, hidden] (a copy), or on the last stage its logits [logits, vocab].

        Every row is checked before anything runs: a bad row fails the step and no cache
        changes."""
        return self.step_features(rows)[0]

    def step_features(self, rows: Sequence[PagedRow]) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
        """``step``, and on the last stage each row's final normed hidden state at its logits
        rows ([logits, hidden], pipeshard/shard/features.py; None on other stages)."""
        if not rows:
            raise InvalidArgument("rows", "must name at least one sequence")
        with self._lock:
            seen: set = set()
            checked = [self._check_row(row, seen) for row in rows]
            refed = [self._refeed(row, c) for row, c in zip(rows, checked, strict=True)]
            checked = [c if r is None else (c[0], *r) for c, r in zip(checked, refed, strict=True)]
            extra = [0 if r is None else 1 for r in refed]
            lengths = [x.shape[0] for _, x, _ in checked]
            past = np.array(
                [s.length - e for (s, _, _), e in zip(checked, extra, strict=True)], dtype=np.int32
            )
            ends = past + np.array(lengths, dtype=np.int32)
            begins = np.zeros(len(rows) + 1, dtype=np.int32)
            np.cumsum(lengths, out=begins[1:])
            used = [self.blocks_for(int(e)) for e in ends]
            table_begins = np.zeros(len(rows) + 1, dtype=np.int32)
            np.cumsum(used, out=table_begins[1:])
            for (state, _, _), n in zip(checked, used, strict=True):
                self._drop_local(state)
                self._grow_local(state, n)
            feed = {
                self._input: np.concatenate([x for _, x, _ in checked]),
                "position_ids": np.concatenate([p for _, _, p in checked]).astype(np.int64, copy=False),
                "past_lens": past,
                "subsequence_begins": begins,
                "block_indices": np.concatenate(
                    [s.blocks[:n] for (s, _, _), n in zip(checked, used, strict=True)]
                ),
                "block_indices_begins": table_begins,
            }
            feed.update(_tree_masks(rows))
            if self._local_pools:
                feed[LOCAL_BLOCK_INDICES] = np.concatenate(
                    [
                        np.asarray(s.local[:n], dtype=np.int32)
                        for (s, _, _), n in zip(checked, used, strict=True)
                    ]
                )
                feed[LOCAL_BLOCK_INDICES_BEGINS] = table_begins
            wanted = [row.logits for row in rows]
            if self.is_last:
                picks = [np.arange(b - k, b, dtype=np.int64) for b, k in zip(begins[1:], wanted, strict=True)]
                # At least one row goes through the head; a step that wants none discards it.
                feed[LOGITS_INDICES] = np.concatenate(picks) if sum(wanted) else np.zeros(1, dtype=np.int64)
            req = self._req
            for name, value in feed.items():
                req.set_tensor(name, ov.Tensor(np.ascontiguousarray(value), shared_memory=True))
            req.set_tensor("max_context_len", ov.Tensor(np.array(int(ends.max()), dtype=np.int32)))
            req.infer()
            for (state, x, pos), start, end in zip(checked, past, ends, strict=True):
                state.length = int(end)
                if self.two_token_rows:
                    state.fed, state.fed_positions, state.fed_at = np.array(x), np.array(pos), int(start)
            out = req.get_output_tensor(0).data
            if not self.is_last:
                hidden = np.split(out.reshape(-1, self.hidden_size).copy(), begins[1:-1])
                return [h[e:] for h, e in zip(hidden, extra, strict=True)], None
            splits = np.cumsum(wanted)[:-1]
            logits = out.reshape(-1, out.shape[-1])[: sum(wanted)]
            features = req.get_tensor(FEATURES).data.reshape(-1, self.hidden_size)[: sum(wanted)]
            return np.split(logits.copy(), splits), np.split(features.copy(), splits)

    def _refeed(
        self, row: PagedRow, checked: tuple[_Sequence, np.ndarray, np.ndarray]
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """A one-token row as two (``config.two_token_rows``): the token in the cache's last slot
        is fed again before it, rewriting its slot with what it already holds, so the row takes
        the multi-query attention path a chunk's tokens take (the single-query path rounds
        differently). None: the row runs as it came (another shape, a tree row, or an unknown
        previous input: the first token, or the first after an import)."""
        state, x, pos = checked
        if not self.two_token_rows or x.shape[0] != 1 or row.parents is not None:
            return None
        previous = state.previous()
        if previous is None:
            return None
        return np.concatenate([previous[0], x]), np.concatenate([previous[1], pos])

    def pool_bytes(self) -> int:
        return sum(self._req.get_tensor(name).byte_size for name in self._state_pools)

    def reserve(self) -> None:
        """Writes every page of the block pool (zeros), before any sequence holds a block. Left
        alone, the pool is paged in block by block as sessions first write blocks, so a serving
        stage's memory creeps up to its budget over hours (the hostile soak's growth once the
        plugin's caches were bounded); reserved, it holds the budget from the start. The stage
        service reserves; in-process shards (tests, the coordinator's ring) leave it paged in."""
        if self._seqs or self._pins:
            raise FailedPrecondition("the KV pool is reserved before any sequence holds a block")
        for name in self._state_pools:
            self._req.get_tensor(name).data.view(np.uint8)[...] = 0

    def warmup(self, prefill: int = 256, decode: int = 2) -> int:
        """A throwaway prefill and a few decode steps on a temporary sequence (the plugin prepares
        its kernels on the first inferences of new shapes); returns the inferences run, 0 when the
        budget has no room for it."""
        key = ("__warmup__",)
        prefill = max(
            1, min(prefill, self.blocks_total * self.block_tokens - decode, self.max_context - decode)
        )
        try:
            self.open(key, prefill + decode)
        except (ResourceExhausted, InvalidArgument):
            return 0
        try:
            steps = [prefill] + [1] * decode
            for t in steps:
                x = (
                    np.zeros(t, dtype=np.int64)
                    if self.is_first
                    else np.zeros((t, self.hidden_size), dtype=np.float32)
                )
                self.step([PagedRow(key, x, logits=1 if self.is_last else 0)])
            return len(steps)
        finally:
            self.free(key)


def _tree_masks(rows: Sequence[PagedRow]) -> dict[str, np.ndarray]:
    """The step's query-to-query masks: each tree row's ancestor mask and an empty range for a
    causal row; without tree rows, no ranges at all (every row causal)."""
    if all(row.parents is None for row in rows):
        return {QQ_BIAS: np.zeros(0, np.uint8), QQ_BIAS_BEGINS: np.zeros(0, np.int32)}
    masks = [
        np.zeros(0, np.uint8) if row.parents is None else ancestor_mask(row.parents).reshape(-1)
        for row in rows
    ]
    begins = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum([m.size for m in masks], out=begins[1:])
    return {QQ_BIAS: np.concatenate(masks), QQ_BIAS_BEGINS: begins}
