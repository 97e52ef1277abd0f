"""A stage's KV cache for one sequence as a self-describing, backend-neutral blob.

The blob holds, per state variable in layer order, the keys or values of the mask-valid positions
only, as f32 ``[kv_heads, T, head_dim]``, so a stateful session (graph state) and a paged one
(block pools) can both write and read it. It names what it was taken from (model fingerprint,
export id, stage, layer range) so a restore into another model or another layer range is refused,
and carries a sha256 over everything it holds so a damaged blob is refused too. Dropping the
masked holes leaves the kept positions contiguous: their rotary positions were logical, so the
compacted cache is exactly the cache of the sequence without its rejected drafts.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
from google.protobuf.message import DecodeError

from pipeshard.errors import FailedPrecondition, InvalidArgument
from pipeshard.tensor_codec import decode, encode
from pipeshard.v1 import kv_pb2, tensor_pb2


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


@dataclass(frozen=True)
class KvBlob:
    """One stage's KV of one sequence: ``arrays[i]`` is state ``source.names[i]`` [kv_heads, T, head_dim]."""

    source: KvSource
    token_ids: tuple[int, ...]  # the tokens of the T positions when the caller knows them, else ()
    arrays: tuple[np.ndarray, ...]
    checksum: str

    @classmethod
    def build(
        cls,
        source: KvSource,
        arrays: list[np.ndarray],
        token_ids: tuple[int, ...] = (),
        *,
        checksum: bool = True,
    ) -> KvBlob:
        # Own copies: the arrays may be views of an InferRequest's state, which later runs overwrite.
        arrays = tuple(np.array(a, dtype=np.float32, order="C", copy=True) for a in arrays)
        token_ids = tuple(token_ids)
        return cls(source, token_ids, arrays, _checksum(source, token_ids, arrays) if checksum else "")

    @property
    def positions(self) -> int:
        return int(self.arrays[0].shape[1]) if self.arrays else 0

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
        if src.names != target.names or len(self.arrays) != len(target.names):
            raise InvalidArgument(
                "snapshot.states",
                f"must be the {len(target.names)} state variables {target.names[0]}... in order",
            )
        t = self.positions
        want = (target.kv_heads, t, target.head_dim)
        for name, a in zip(src.names, self.arrays, strict=True):
            if a.shape != want or a.dtype != np.float32:
                raise InvalidArgument(
                    "snapshot.states", f"{name} must be float32 {list(want)}, got {a.dtype} {list(a.shape)}"
                )
        if self.token_ids and len(self.token_ids) != t:
            raise InvalidArgument("snapshot.token_ids", f"has {len(self.token_ids)} ids for {t} positions")
        if verify_checksum and _checksum(src, self.token_ids, self.arrays) != self.checksum:
            raise InvalidArgument("snapshot.checksum", "does not match the snapshot's contents: corrupt")


def _checksum(source: KvSource, token_ids: tuple[int, ...], arrays: tuple[np.ndarray, ...]) -> str:
    digest = hashlib.sha256()
    head = (
        f"{source.model_fingerprint}|{source.export_id}|{source.stage_index}|"
        f"{source.layer_start}|{source.layer_end}\n"
    )
    digest.update(head.encode())
    digest.update(np.asarray(token_ids, dtype="<i8").tobytes())
    for name, a in zip(source.names, arrays, strict=True):
        digest.update(f"{name}|{a.dtype.str}|{list(a.shape)}\n".encode())
        digest.update(memoryview(np.ascontiguousarray(a)).cast("B"))
    return "sha256:" + digest.hexdigest()


# -- proto mapping ------------------------------------------------------------------------------
def to_proto(blob: KvBlob) -> kv_pb2.KvSnapshot:
    src = blob.source
    return kv_pb2.KvSnapshot(
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
    )


def from_proto(snapshot: kv_pb2.KvSnapshot) -> KvBlob:
    """The blob a snapshot describes (shapes are checked against a stage by ``check_for``)."""
    if not snapshot.states:
        raise InvalidArgument("snapshot.states", "is empty")
    arrays = []
    for named in snapshot.states:
        a = decode(named.tensor, field=f"snapshot.states[{named.name}]")
        if a.ndim != 3:
            raise InvalidArgument("snapshot.states", f"{named.name} must be 3-D, got shape {list(a.shape)}")
        arrays.append(a)
    first = arrays[0]
    source = KvSource(
        model_fingerprint=snapshot.model_fingerprint,
        export_id=snapshot.export_id,
        stage_index=snapshot.stage_index,
        layer_start=snapshot.layer_start,
        layer_end=snapshot.layer_end,
        names=tuple(n.name for n in snapshot.states),
        kv_heads=int(first.shape[0]),
        head_dim=int(first.shape[2]),
    )
    return KvBlob(source, tuple(snapshot.token_ids), tuple(arrays), snapshot.checksum)


# -- snapshots in chunks (CaptureKvStream / RestoreKvStream) -------------------------------------
DEFAULT_CHUNK_BYTES = 1 << 20
MAX_SNAPSHOT_BYTES = (1 << 31) - 1  # protobuf parses no larger message


def snapshot_chunks(snapshot: kv_pb2.KvSnapshot, chunk_bytes: int = 0) -> tuple[int, list[bytes]]:
    """The serialized snapshot's size and its bytes cut into chunks of ``chunk_bytes`` (0: 1 MiB),
    so a snapshot beyond the gRPC message limit travels as several messages below it."""
    if chunk_bytes < 0:
        raise InvalidArgument("chunk_bytes", f"must be >= 0, got {chunk_bytes}")
    step = chunk_bytes or DEFAULT_CHUNK_BYTES
    data = snapshot.SerializeToString()
    return len(data), [data[i : i + step] for i in range(0, len(data), step)]


class SnapshotAssembler:
    """Collects a snapshot's chunks; refuses more or fewer bytes than the sender announced."""

    def __init__(self, total: int):
        if not 0 < total <= MAX_SNAPSHOT_BYTES:
            raise InvalidArgument("snapshot_bytes", f"must be in [1, {MAX_SNAPSHOT_BYTES}], got {total}")
        self.total = total
        self._buffer = bytearray()

    def add(self, chunk: bytes) -> None:
        if len(self._buffer) + len(chunk) > self.total:
            raise InvalidArgument("snapshot_chunk", f"chunks exceed the announced {self.total} bytes")
        self._buffer += chunk

    def snapshot(self) -> kv_pb2.KvSnapshot:
        if len(self._buffer) != self.total:
            raise InvalidArgument(
                "snapshot_chunk", f"chunks hold {len(self._buffer)} of the announced {self.total} bytes"
            )
        try:
            return kv_pb2.KvSnapshot.FromString(bytes(self._buffer))
        except DecodeError:
            raise InvalidArgument("snapshot_chunk", "the chunks do not parse as a KvSnapshot") from None
