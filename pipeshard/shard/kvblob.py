"""A stage's KV cache for one sequence as a self-describing blob.

The blob holds, per state variable in layer order, the keys or values of the mask-valid positions
only, as f32 ``[kv_heads, T, head_dim]``, so a stateful session (graph state) and a paged one with
f32 pools can both write and read it. A paged stage whose pools are quantized (the default
precision's u8 cache, with each block's scale and zero-point rows) captures its blocks verbatim
instead (``BlockLayout``): re-quantizing f32 values would not give back the same bytes, and
only a stage with the same layout can read them. It names what it was taken from (model fingerprint,
export id, stage, layer range) so a restore into another model or another layer range is refused,
and carries a sha256 over everything it holds so a damaged blob is refused too. Dropping the
masked holes leaves the kept positions contiguous: their rotary positions were logical, so the
compacted cache is exactly the cache of the sequence without its rejected drafts.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np
from google.protobuf.message import DecodeError

from pipeshard.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from pipeshard.tensor_codec import decode, decoded_bytes, dtype_code, encode
from pipeshard.v1 import kv_pb2, tensor_pb2


@dataclass(frozen=True)
class BlockLayout:
    """A paged pool's own block format, captured and restored byte for byte."""

    dtype: str  # numpy dtype name of the pools, e.g. "uint8"
    tokens: int  # positions per block
    shapes: tuple[tuple[int, ...], ...]  # one block of each state variable: [kv_heads, rows, cols]

    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.tokens)

    def describe(self) -> str:
        return f"{self.dtype} blocks of {self.tokens} positions"


def describe_layout(layout: BlockLayout | None) -> str:
    return layout.describe() if layout else "float32 positions"


@dataclass(frozen=True)
class KvSource:
    """What a blob must match to be restored: the model, the export and the stage's layers."""

    model_fingerprint: str
    export_id: str
    stage_index: int
    layer_start: int
    layer_end: int  # exclusive
    names: tuple[str, ...]  # state variables, in layer order
    kv_heads: int
    head_dim: int
    blocks: BlockLayout | None = None  # None: f32 [kv_heads, T, head_dim] per state

    def shapes_for(self, positions: int) -> list[tuple[int, ...]]:
        """The shape each state's array has in a blob of ``positions`` positions."""
        if self.blocks is None:
            return [(self.kv_heads, positions, self.head_dim)] * len(self.names)
        n = self.blocks.blocks_for(positions)
        return [(n, *shape) for shape in self.blocks.shapes]

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.blocks.dtype if self.blocks else np.float32)


@dataclass(frozen=True)
class KvBlob:
    """One stage's KV of one sequence: ``arrays[i]`` is state ``source.names[i]``, f32
    [kv_heads, T, head_dim], or the T positions' pool blocks [blocks, ...] in a block layout."""

    source: KvSource
    token_ids: tuple[int, ...]  # the tokens of the T positions when the caller knows them, else ()
    arrays: tuple[np.ndarray, ...]
    checksum: str
    positions: int  # T
    start: int = 0  # the first position held: more than 0 for a part (``join_parts``)
    # The stage's input at the last position ([1] ids or [1, hidden]) when its last step fed it:
    # what a two-token (``invariant``) stage re-feeds before the restored session's next row.
    last_input: np.ndarray | None = None

    @classmethod
    def build(
        cls,
        source: KvSource,
        arrays: list[np.ndarray],
        token_ids: tuple[int, ...] = (),
        *,
        positions: int | None = None,
        checksum: bool = True,
        start: int = 0,
        last_input: np.ndarray | None = None,
    ) -> KvBlob:
        """``positions`` defaults to the arrays' second axis (f32 layout); a block layout names it.
        ``start`` > 0: a part of a cache holding positions [start, start + positions)."""
        # Own copies: the arrays may be views of an InferRequest's state, which later runs overwrite.
        owned = tuple(np.array(a, dtype=source.dtype, order="C", copy=True) for a in arrays)
        token_ids = tuple(token_ids)
        if positions is None:
            positions = int(owned[0].shape[1]) if owned and source.blocks is None else 0
        last = None if last_input is None else np.array(last_input, copy=True)
        digest = _checksum(source, token_ids, owned, positions, start, last) if checksum else ""
        return cls(source, token_ids, owned, digest, positions, start, last)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)

    def check_for(self, target: KvSource, *, verify_checksum: bool = True) -> None:
        """Refuses a blob that does not belong to ``target`` or is damaged; returns quietly otherwise."""
        src = self.source
        if src.model_fingerprint != target.model_fingerprint or src.export_id != target.export_id:
            raise FailedPrecondition(
                f"KV snapshot is of model {src.model_fingerprint[:19]}... export {src.export_id[:19]}..., "
                f"this stage serves {target.model_fingerprint[:19]}... export {target.export_id[:19]}..."
            )
        if (src.layer_start, src.layer_end) != (target.layer_start, target.layer_end):
            raise FailedPrecondition(
                f"KV snapshot holds layers [{src.layer_start}, {src.layer_end}), "
                f"this stage runs layers [{target.layer_start}, {target.layer_end})"
            )
        if src.blocks != target.blocks:
            raise FailedPrecondition(
                f"KV snapshot holds {describe_layout(src.blocks)}, this stage keeps "
                f"{describe_layout(target.blocks)}: start both stages at the same --precision and --kv"
            )
        if src.names != target.names or len(self.arrays) != len(target.names):
            raise InvalidArgument(
                "snapshot.states",
                f"must be the {len(target.names)} state variables {target.names[0]}... in order",
            )
        t = self.positions
        if t < 1:
            raise InvalidArgument("snapshot.positions", f"must be at least 1, got {t}")
        dtype = target.dtype
        for name, a, want in zip(src.names, self.arrays, target.shapes_for(t), strict=True):
            if a.shape != want or a.dtype != dtype:
                raise InvalidArgument(
                    "snapshot.states", f"{name} must be {dtype} {list(want)}, got {a.dtype} {list(a.shape)}"
                )
        if self.token_ids and len(self.token_ids) != t:
            raise InvalidArgument("snapshot.token_ids", f"has {len(self.token_ids)} ids for {t} positions")
        if verify_checksum:
            self.verify_checksum()

    def verify_checksum(self) -> None:
        """Refuses a blob whose contents do not match its checksum (damaged on the way)."""
        digest = _checksum(
            self.source, self.token_ids, self.arrays, self.positions, self.start, self.last_input
        )
        if digest != self.checksum:
            raise InvalidArgument("snapshot.checksum", "does not match the snapshot's contents: corrupt")


def _checksum(
    source: KvSource,
    token_ids: tuple[int, ...],
    arrays: tuple[np.ndarray, ...],
    positions: int,
    start: int = 0,
    last_input: np.ndarray | None = None,
) -> str:
    digest = hashlib.sha256()
    part = f"from {start}|" if start else ""  # a whole cache's digest is what it always was
    head = (
        f"{source.model_fingerprint}|{source.export_id}|{source.stage_index}|"
        f"{source.layer_start}|{source.layer_end}|{positions}|{part}{describe_layout(source.blocks)}\n"
    )
    digest.update(head.encode())
    digest.update(np.asarray(token_ids, dtype="<i8").tobytes())
    for name, a in zip(source.names, arrays, strict=True):
        digest.update(f"{name}|{a.dtype.str}|{list(a.shape)}\n".encode())
        digest.update(np.ascontiguousarray(a).data.cast("B"))
    if last_input is not None:  # a blob without one keeps the digest it always had
        digest.update(f"last_input|{last_input.dtype.str}|{list(last_input.shape)}\n".encode())
        digest.update(np.ascontiguousarray(last_input).data.cast("B"))
    return "sha256:" + digest.hexdigest()


# -- proto mapping ------------------------------------------------------------------------------
LAST_INPUT_MAX_BYTES = 1 << 20  # one position's hidden state: 256k float32 values


def to_proto(blob: KvBlob) -> kv_pb2.KvSnapshot:
    src = blob.source
    snapshot = kv_pb2.KvSnapshot(
        stage_index=src.stage_index,
        model_fingerprint=src.model_fingerprint,
        token_ids=blob.token_ids,
        states=[
            tensor_pb2.NamedTensor(name=n, tensor=encode(a, field=f"snapshot.states[{n}]"))
            for n, a in zip(src.names, blob.arrays, strict=True)
        ],
        layer_start=src.layer_start,
        layer_end=src.layer_end,
        export_id=src.export_id,
        checksum=blob.checksum,
        positions=blob.positions,
        block_tokens=src.blocks.tokens if src.blocks else 0,
        start_position=blob.start,
    )
    if blob.last_input is not None:
        snapshot.last_input.CopyFrom(encode(blob.last_input, field="snapshot.last_input"))
    return snapshot


def check_declared(snapshot: kv_pb2.KvSnapshot, target: KvSource, max_positions: int) -> list[int]:
    """Holds a snapshot's declared fields and tensor shapes against the stage ``target`` that
    would restore it, before any state is decompressed (a blob of tiny states each declaring a
    huge shape would otherwise allocate without bound); returns each state's decoded bytes."""
    if snapshot.model_fingerprint != target.model_fingerprint or snapshot.export_id != target.export_id:
        raise FailedPrecondition(
            f"KV snapshot is of model {snapshot.model_fingerprint[:19]}... "
            f"export {snapshot.export_id[:19]}..., "
            f"this stage serves {target.model_fingerprint[:19]}... export {target.export_id[:19]}..."
        )
    if (snapshot.layer_start, snapshot.layer_end) != (target.layer_start, target.layer_end):
        raise FailedPrecondition(
            f"KV snapshot holds layers [{snapshot.layer_start}, {snapshot.layer_end}), "
            f"this stage runs layers [{target.layer_start}, {target.layer_end})"
        )
    tokens = target.blocks.tokens if target.blocks else 0
    if snapshot.block_tokens != tokens:
        n = snapshot.block_tokens
        said = f"blocks of {n} positions" if n else describe_layout(None)
        raise FailedPrecondition(
            f"KV snapshot holds {said}, this stage keeps {describe_layout(target.blocks)}: "
            "start both stages at the same --precision and --kv"
        )
    names = tuple(n.name for n in snapshot.states)
    if names != target.names:
        raise InvalidArgument(
            "snapshot.states",
            f"must be the {len(target.names)} state variables {target.names[0]}... in order",
        )
    t, start = snapshot.positions, snapshot.start_position
    if t < 1 or start < 0 or start + t > max_positions:
        raise InvalidArgument(
            "snapshot.positions",
            f"must hold 1 to {max_positions} positions (this stage's max_context) from start_position "
            f"{start}, got {t}",
        )
    code, sizes = dtype_code(target.dtype), []
    for named, want in zip(snapshot.states, target.shapes_for(t), strict=True):
        if named.tensor.dtype != code or tuple(named.tensor.shape) != want:
            raise InvalidArgument(
                "snapshot.states",
                f"{named.name} must be {target.dtype} {list(want)}, got shape {list(named.tensor.shape)}",
            )
        sizes.append(decoded_bytes(named.tensor, field=f"snapshot.states[{named.name}]"))
    return sizes


def from_proto(snapshot: kv_pb2.KvSnapshot, target: KvSource | None = None, max_positions: int = 0) -> KvBlob:
    """The blob a snapshot describes (shapes are checked against a stage by ``check_for``);
    with ``target``, its declared shapes are checked first (:func:`check_declared`) and no
    state decodes to more than its shape there needs."""
    sizes = check_declared(snapshot, target, max_positions) if target is not None else None
    if not snapshot.states:
        raise InvalidArgument("snapshot.states", "is empty")
    if snapshot.block_tokens < 0:
        raise InvalidArgument("snapshot.block_tokens", f"must be >= 0, got {snapshot.block_tokens}")
    if snapshot.start_position < 0:
        raise InvalidArgument("snapshot.start_position", f"must be >= 0, got {snapshot.start_position}")
    ndim = 4 if snapshot.block_tokens else 3
    arrays = []
    for i, named in enumerate(snapshot.states):
        field = f"snapshot.states[{named.name}]"
        a = (
            decode(named.tensor, field=field)
            if sizes is None
            else decode(named.tensor, field=field, max_bytes=sizes[i], limit="stage's state shape")
        )
        if a.ndim != ndim:
            raise InvalidArgument(
                "snapshot.states", f"{named.name} must be {ndim}-D, got shape {list(a.shape)}"
            )
        arrays.append(a)
    first = arrays[0] if ndim == 3 else arrays[0][0]
    blocks = None
    if snapshot.block_tokens:
        blocks = BlockLayout(first.dtype.name, snapshot.block_tokens, tuple(a.shape[1:] for a in arrays))
    source = KvSource(
        model_fingerprint=snapshot.model_fingerprint,
        export_id=snapshot.export_id,
        stage_index=snapshot.stage_index,
        layer_start=snapshot.layer_start,
        layer_end=snapshot.layer_end,
        names=tuple(n.name for n in snapshot.states),
        kv_heads=int(first.shape[0]),
        head_dim=int(first.shape[2]),
        blocks=blocks,
    )
    last_input = None
    if snapshot.HasField("last_input"):
        last_input = decode(
            snapshot.last_input,
            field="snapshot.last_input",
            max_bytes=LAST_INPUT_MAX_BYTES,
            limit="LAST_INPUT_MAX_BYTES",
        )
    return KvBlob(
        source,
        tuple(snapshot.token_ids),
        tuple(arrays),
        snapshot.checksum,
        snapshot.positions,
        snapshot.start_position,
        last_input,
    )


def join_parts(parts: list[KvBlob], *, checksum: bool = True) -> KvBlob:
    """One whole cache from consecutive parts of one stage's capture (the first from position 0,
    each starting where the one before ended; in a block layout every part but the last ends on a
    block boundary), checksummed anew (``checksum=False``: left without one, for a caller that
    verified every part's and restores the whole at once). Refuses parts that do not chain."""
    if not parts:
        raise InvalidArgument("parts", "must hold at least one part")
    source, end = parts[0].source, 0
    for i, part in enumerate(parts):
        if part.source != source:
            raise InvalidArgument("parts", f"part {i} is of another stage or layout than part 0")
        if part.start != end:
            raise InvalidArgument("parts", f"part {i} starts at position {part.start}, not {end}")
        if source.blocks is not None and i < len(parts) - 1 and part.positions % source.blocks.tokens:
            raise InvalidArgument(
                "parts", f"part {i} ends inside a block of {source.blocks.tokens} positions"
            )
        end += part.positions
    axis = 0 if source.blocks is not None else 1
    arrays = tuple(np.concatenate([p.arrays[i] for p in parts], axis=axis) for i in range(len(source.names)))
    token_ids = sum((p.token_ids for p in parts), ()) if all(p.token_ids for p in parts) else ()
    last = parts[-1].last_input  # the whole cache's last position is the last part's
    digest = _checksum(source, token_ids, arrays, end, 0, last) if checksum else ""
    return KvBlob(source, token_ids, arrays, digest, end, 0, last)


# -- snapshots in chunks (CaptureKvStream / RestoreKvStream) -------------------------------------
DEFAULT_CHUNK_BYTES = 1 << 20
MIN_CHUNK_BYTES = 64 << 10  # a caller's chunk: smaller ones cost a message per few bytes
MAX_CHUNK_BYTES = 16 << 20  # a quarter of the default gRPC message limit
MAX_SNAPSHOT_BYTES = (1 << 31) - 1  # protobuf parses no larger message
_PART_OVERHEAD_BYTES = 64 << 10  # a part's own fields beyond its states (ids, names, checksum)


def check_chunk_bytes(chunk_bytes: int) -> int:
    """A caller's capture chunk size (0: the default), between the floor and the ceiling."""
    if chunk_bytes == 0:
        return DEFAULT_CHUNK_BYTES
    if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise InvalidArgument(
            "chunk_bytes",
            f"must be 0 (1 MiB) or in [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}], got {chunk_bytes}",
        )
    return chunk_bytes


@dataclass(frozen=True)
class RestoreLimits:
    """What one restore stream may bring into a stage: parts and bytes of at most its
    max_context positions in its own layout, counted as they arrive (before any decoding)."""

    max_positions: int
    max_parts: int
    max_bytes: int
    max_chunks: int

    @classmethod
    def of(cls, source: KvSource, max_positions: int) -> RestoreLimits:
        parts = source.blocks.blocks_for(max_positions) if source.blocks else max_positions
        per_state = [math.prod(shape) for shape in source.shapes_for(max_positions)]
        states = sum(per_state) * source.dtype.itemsize
        max_bytes = states + 12 * max_positions + parts * _PART_OVERHEAD_BYTES
        return cls(max_positions, parts, max_bytes, parts + max_bytes // MIN_CHUNK_BYTES)

    def check(self, parts: int, announced: int, chunks: int) -> None:
        if parts > self.max_parts:
            raise ResourceExhausted(f"restore stream: more than {self.max_parts} parts (max_parts)")
        if announced > self.max_bytes:
            raise ResourceExhausted(
                f"restore stream: parts announce {announced} bytes, over its {self.max_bytes}-byte "
                f"budget (max_bytes: {self.max_positions} positions of this stage's KV)"
            )
        if chunks > self.max_chunks:
            raise ResourceExhausted(f"restore stream: more than {self.max_chunks} chunks (max_chunks)")


def snapshot_chunks(snapshot: kv_pb2.KvSnapshot, chunk_bytes: int = 0) -> tuple[int, list[bytes]]:
    """The serialized snapshot's size and its bytes cut into chunks of ``chunk_bytes`` (0: 1 MiB),
    so a snapshot beyond the gRPC message limit travels as several messages below it."""
    if chunk_bytes < 0:
        raise InvalidArgument("chunk_bytes", f"must be >= 0, got {chunk_bytes}")
    step = chunk_bytes or DEFAULT_CHUNK_BYTES
    data = snapshot.SerializeToString()
    return len(data), [data[i : i + step] for i in range(0, len(data), step)]


@dataclass(frozen=True)
class SnapshotBytes:
    """A serialized KvSnapshot kept as the chunks it arrived in, never decoded: a part of a
    standby copy, sent back as it came (RestoreKvStreamRequest.next_part)."""

    chunks: tuple[bytes, ...]
    positions: int  # the positions the snapshot holds

    @property
    def nbytes(self) -> int:
        return sum(len(chunk) for chunk in self.chunks)


class SnapshotAssembler:
    """Collects a snapshot's chunks; refuses more or fewer bytes than the sender announced. The
    chunks are joined once, at the end (growing one buffer chunk by chunk copied a long
    session's KV over and over, on the restore's critical path)."""

    def __init__(self, total: int):
        if not 0 < total <= MAX_SNAPSHOT_BYTES:
            raise InvalidArgument("snapshot_bytes", f"must be in [1, {MAX_SNAPSHOT_BYTES}], got {total}")
        self.total = total
        self._chunks: list[bytes] = []
        self._received = 0

    def add(self, chunk: bytes) -> None:
        if self._received + len(chunk) > self.total:
            raise InvalidArgument("snapshot_chunk", f"chunks exceed the announced {self.total} bytes")
        self._chunks.append(chunk)
        self._received += len(chunk)

    def snapshot(self) -> kv_pb2.KvSnapshot:
        if self._received != self.total:
            raise InvalidArgument(
                "snapshot_chunk", f"chunks hold {self._received} of the announced {self.total} bytes"
            )
        try:
            return kv_pb2.KvSnapshot.FromString(b"".join(self._chunks))
        except DecodeError:
            raise InvalidArgument("snapshot_chunk", "the chunks do not parse as a KvSnapshot") from None
