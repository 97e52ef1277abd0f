"""Protobuf <-> stage domain objects: every activation frame is built and read here, by the
stage (servicer, next hop) and by the coordinator (the token frames it sends into stage 0).

Every step travels as a plan frame, one row per session (one session's step is a plan of one
row): :func:`step_from_frame` reads one, :func:`frame_from_step` writes one.
"""

from __future__ import annotations

import math
import time
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeshard.errors import InvalidArgument, PipeshardError, ResourceExhausted
from pipeshard.services.stage.domain import ReturnMode, RowKind, SamplingStep, Step, StepOutput, StepRow
from pipeshard.services.stage.rows import plan_row, row_from_plan
from pipeshard.shard.draft_heads import HeadCandidates
from pipeshard.tensor_codec import Codec, decode, encode
from pipeshard.v1 import activation_pb2, tensor_pb2

WIRE_DTYPES = ("fp32", "fp16", "bf16")  # fp16 and bf16 are LOSSY opt-ins (docs/BENCHMARKS.md)


DEFAULT_MAX_FRAME_TOKENS = 8192  # a 4096-token prefill (the largest chunk) twice over
MAX_ID_CHARS = 256  # session and subscriber ids: a uuid is 36


@dataclass(frozen=True)
class FrameLimits:
    """What one frame may carry into a stage, held against the tensor's declared shape before
    anything is decompressed: the shard's hidden size and a token count per frame."""

    hidden_size: int
    max_tokens: int = DEFAULT_MAX_FRAME_TOKENS

    def check(self, tensor: tensor_pb2.Tensor, port: str, positions: int) -> int:
        """The bytes ``tensor`` may decode to; refuses a frame beyond the limits, naming them."""
        if positions > self.max_tokens:
            raise ResourceExhausted(
                f"`positions` holds {positions} tokens, over this stage's max_frame_tokens {self.max_tokens}"
            )
        want = [1, positions] if port == "input_ids" else [1, positions, self.hidden_size]
        if list(tensor.shape) != want:
            raise InvalidArgument(
                port, f"must have shape {want} for the frame's positions, got {list(tensor.shape)}"
            )
        return math.prod(want) * (8 if port == "input_ids" else 4)


def check_id(field: str, value: str) -> None:
    """Ids are keys of tables the stage keeps: bounded, so a caller cannot fill memory with one."""
    if len(value) > MAX_ID_CHARS:
        raise InvalidArgument(field, f"is {len(value)} characters, over the {MAX_ID_CHARS}-character limit")


def step_from_frame(
    frame: activation_pb2.ActivationFrame, port: str, limits: FrameLimits | None = None
) -> Step:
    """Decode a step frame for a stage whose input port is ``port`` (input_ids or hidden_states):
    one row per plan row, each taking its ``tokens`` of the positions and tensor rows in order.
    ``limits``: the stage's own, checked on the declared shape before the tensor is decoded."""
    tensors = {t.name: t.tensor for t in frame.tensors}
    if port not in tensors:
        raise InvalidArgument("tensors", f"must carry {port!r}, got {sorted(tensors) or 'none'}")
    if limits is None:
        x = _widen(decode(tensors[port], field=port))
    else:
        if not frame.plan.rows:
            raise InvalidArgument("plan", "must hold at least one row")
        for row in frame.plan.rows:
            check_id("plan.rows.session_id", row.session_id)
        check_id("owner", frame.owner)
        need = limits.check(tensors[port], port, len(frame.positions))
        x = _widen(decode(tensors[port], field=port, max_bytes=need, limit="frame shape"))
    rows = frame.plan.rows
    if not rows:
        raise InvalidArgument("plan", "must hold at least one row")
    counts = [row.tokens for row in rows]
    total = len(frame.positions)
    if min(counts) < 1 or sum(counts) != total or x.ndim < 2 or x.shape[0] != 1 or x.shape[1] != total:
        raise InvalidArgument(
            "plan", f"rows of {counts} tokens must cover the frame's {total} positions and {port} rows"
        )
    positions = np.asarray(frame.positions, dtype=np.int64)
    out, start = [], 0
    for row in rows:
        end = start + row.tokens
        out.append(row_from_plan(row, positions[start:end], x[:, start:end], frame.owner))
        start = end
    return Step(out, frame.owner, list(frame.stage_compute_micros), frame.sent_unix_nanos)


def _widen(x: np.ndarray) -> np.ndarray:
    """Hidden states sent as fp16 (``--wire-dtype fp16``, lossy) run as float32 like the rest."""
    return x.astype(np.float32) if x.dtype == np.float16 else x


def frame_from_step(
    step: Step, codec: Codec = Codec.CODEC_NONE, wire_dtype: str = "fp32"
) -> activation_pb2.ActivationFrame:
    """The frame of a step: every row's activations concatenated (token ids into stage 0, hidden
    states onwards, narrowed to ``wire_dtype``) and one plan row each."""
    first = step.rows[0]
    if len(step.rows) == 1:  # a coordinator's token row: nothing to join
        x, positions = first.activations, first.positions
    else:
        x = np.concatenate([row.activations for row in step.rows], axis=1)
        positions = np.concatenate([row.positions for row in step.rows])
    name = "input_ids" if x.dtype == np.int64 else "hidden_states"
    tensor = encode(x, codec, as_fp16=wire_dtype == "fp16", as_bf16=wire_dtype == "bf16")
    return activation_pb2.ActivationFrame(
        session_id=first.session_id,
        step_id=first.step_id,
        positions=positions.tolist(),
        tensors=[tensor_pb2.NamedTensor(name=name, tensor=tensor)],
        plan=activation_pb2.PlanFrame(rows=[plan_row(row) for row in step.rows]),
        stage_compute_micros=step.compute_micros,
        sent_unix_nanos=step.sent_unix_nanos,
        owner=step.owner,
    )


def frame_from_outputs(
    step: Step,
    outs: list[StepOutput],
    codec: Codec = Codec.CODEC_NONE,
    wire_dtype: str = "fp32",
    received: activation_pb2.ActivationFrame | None = None,
) -> activation_pb2.ActivationFrame:
    """The frame a non-final stage sends on: the rows that ran, carrying their hidden states.
    When every row of ``received`` (the frame the step came in) ran, its plan and positions go on
    as they came, copied whole rather than rebuilt row by row."""
    if received is None or len(outs) != len(received.plan.rows):
        rows = [out.row.carrying(out.hidden) for out in outs]
        return frame_from_step(
            Step(rows, step.owner, step.compute_micros, step.sent_unix_nanos), codec, wire_dtype
        )
    x = outs[0].hidden if len(outs) == 1 else np.concatenate([o.hidden for o in outs], axis=1)
    tensor = encode(x, codec, as_fp16=wire_dtype == "fp16", as_bf16=wire_dtype == "bf16")
    return activation_pb2.ActivationFrame(
        session_id=received.session_id,
        step_id=received.step_id,
        positions=received.positions,
        tensors=[tensor_pb2.NamedTensor(name="hidden_states", tensor=tensor)],
        plan=received.plan,
        stage_compute_micros=step.compute_micros,
        sent_unix_nanos=step.sent_unix_nanos,
        owner=step.owner,
    )


def plan_from_frames(frames: list[activation_pb2.ActivationFrame]) -> activation_pb2.ActivationFrame:
    """The coordinator's frame for a step of many sessions: their token frames' rows in one."""
    return activation_pb2.ActivationFrame(
        session_id=frames[0].session_id,
        step_id=frames[0].step_id,
        positions=[p for f in frames for p in f.positions],
        tensors=[
            tensor_pb2.NamedTensor(
                name="input_ids", tensor=_joined_ids([f.tensors[0].tensor for f in frames])
            )
        ],
        plan=activation_pb2.PlanFrame(rows=[row for f in frames for row in f.plan.rows]),
        sent_unix_nanos=time.time_ns(),
        owner=frames[0].owner,
    )


def _joined_ids(tensors: list[tensor_pb2.Tensor]) -> tensor_pb2.Tensor:
    """Token frames' input_ids [1, T_i] as one [1, sum T_i]: their raw int64 bytes joined (what
    :func:`frame_from_step` writes of a token row), or decoded and joined when written otherwise."""
    if all(_raw_ids_row(t) for t in tensors):
        data = b"".join(t.data for t in tensors)
        return tensor_pb2.Tensor(
            dtype=tensor_pb2.DTYPE_INT64,
            shape=[1, len(data) // 8],
            data=data,
            codec=Codec.CODEC_NONE,
            raw_size=len(data),
            crc32=zlib.crc32(data),
        )
    return encode(np.concatenate([decode(t, field="input_ids") for t in tensors], axis=1))


def _raw_ids_row(t: tensor_pb2.Tensor) -> bool:
    """An uncompressed int64 [1, T] whose bytes are exactly its T ids."""
    plain = t.codec == Codec.CODEC_NONE and t.dtype == tensor_pb2.DTYPE_INT64
    return plain and len(t.shape) == 2 and t.shape[0] == 1 and len(t.data) == 8 * t.shape[1]


def result_from_output(
    out: StepOutput, compute_micros: list[int], codec: Codec = Codec.CODEC_NONE
) -> activation_pb2.StepResult:
    """The final stage's result for a row; ``codec`` compresses its logits (the return link's choice)."""
    row = out.row
    result = activation_pb2.StepResult(
        session_id=row.session_id, step_id=row.step_id, stage_compute_micros=compute_micros
    )
    if out.top1 is not None:
        result.top1.token_ids.extend(out.top1.token_ids.tolist())
        result.top1.probabilities.extend(out.top1.probabilities.tolist())
    if out.logits is not None:
        result.logits.CopyFrom(encode(out.logits, codec))
    if out.sampled is not None:
        result.sampled.token_ids.extend(out.sampled.token_ids)
        result.sampled.rng_state = out.sampled.rng_state
    if out.features is not None:  # a draft's input only: fp16 halves it, no token depends on it
        result.features.CopyFrom(encode(out.features, codec, as_fp16=True, field="features"))
    if out.head_candidates is not None:
        c = out.head_candidates
        result.head_candidates.CopyFrom(
            activation_pb2.HeadCandidates(
                row=c.row,
                heads=c.token_ids.shape[0],
                width=c.token_ids.shape[1],
                token_ids=c.token_ids.reshape(-1).tolist(),
                probabilities_fp16=c.probabilities.astype("<f2").tobytes(),
            )
        )
    return result


def head_candidates(result: activation_pb2.StepResult) -> HeadCandidates | None:
    """A result's draft-head candidates, or None when it carries none (or malformed ones)."""
    if not result.HasField("head_candidates"):
        return None
    c = result.head_candidates
    n = c.heads * c.width
    if c.heads < 1 or c.width < 1 or len(c.token_ids) != n or len(c.probabilities_fp16) != 2 * n:
        return None
    ids = np.asarray(c.token_ids, dtype=np.int64).reshape(c.heads, c.width)
    probs = np.frombuffer(c.probabilities_fp16, dtype="<f2").astype(np.float32).reshape(c.heads, c.width)
    return HeadCandidates(c.row, ids, probs)


def stage_error(stage_index: int, exc: BaseException) -> activation_pb2.StageError:
    code = exc.code if isinstance(exc, PipeshardError) else "INTERNAL"
    message = str(exc) if isinstance(exc, PipeshardError) else f"internal error: {type(exc).__name__}"
    return activation_pb2.StageError(stage_index=stage_index, code=code, message=message)


def error_frame(row, error: activation_pb2.StageError, owner: str) -> activation_pb2.ActivationFrame:
    """A frame that carries an earlier stage's failure of one row down the ring (no tensors);
    ``row`` is the failed row or error frame (anything with a session id and a step id)."""
    return activation_pb2.ActivationFrame(
        session_id=row.session_id, step_id=row.step_id, error=error, owner=owner
    )


def error_result(row, error: activation_pb2.StageError) -> activation_pb2.StepResult:
    return activation_pb2.StepResult(session_id=row.session_id, step_id=row.step_id, error=error)


def token_row(
    session_id: str,
    step: int,
    ids: list[int],
    start: int,
    greedy: bool,
    *,
    fill_only: bool = False,
    return_last: int = 1,
    invalidate: list[tuple[int, int]] | None = None,
    sampling: SamplingStep | None = None,
    kind: RowKind | None = None,
    chains: int = 1,
    keep_chain: int = -1,
    parents: tuple[int, ...] = (),
    kept: tuple[int, ...] = (),
    probabilities: bool = True,
    features: bool = False,
    heads: int = 0,
    allowed: bytes = b"",
) -> StepRow:
    """The typed row that carries one session's token ids into stage 0 at logical positions
    ``start...``: every option of a coordinator's row is decided here, once; the frame is
    written from it by :func:`frame_from_step`, the one translation.

    ``fill_only``: a prefill chunk, no result; otherwise the final stage answers for the last
    ``return_last`` ids (the last token and the drafts after it): Top1 when ``greedy``, drawn
    tokens when ``sampling`` is given, else logits. ``invalidate``: physical cache ranges every
    stage drops before running (rejected drafts of the previous step). ``kind``: what the row
    is; by default a prefill chunk when it fills only or carries several tokens without drafts.
    ``chains`` > 1: ``ids`` are that many equal-length chains of a draft tree, each at positions
    ``start...``; ``keep_chain``: the chain of the previous (tree) step whose cache is kept.
    ``parents``: a draft tree as one sequence (each id's parent within ``ids``, -1 for the cache;
    each id sits one position after its parent); ``kept``: the ids of the previous such step
    whose cache is kept.
    ``probabilities`` False: a Top1 answer carries the ids only (no softmax on the final stage).
    ``features``: the final stage also returns its final normed hidden state at those ids.
    ``heads`` > 0: the final stage's draft heads return that many candidates each (greedy rows).
    ``allowed``: a grammar's bitmask of the tokens allowed at the one returned position; the
    final stage answers the Top1 among them.
    """
    if fill_only:
        mode, sampling = ReturnMode.NONE, None
    elif sampling is not None:
        mode = ReturnMode.SAMPLED
    else:
        mode = ReturnMode.TOP1 if greedy or allowed else ReturnMode.LOGITS
    if kind is None:
        if return_last > 1:
            kind = RowKind.VERIFY
        else:
            kind = RowKind.PREFILL if fill_only or len(ids) > 1 else RowKind.DECODE
    if parents:
        positions = tree_positions(start, parents).tolist()
    else:
        positions = list(range(start, start + len(ids) // chains)) * chains
    return StepRow(
        session_id=session_id,
        step_id=step,
        kind=kind,
        positions=np.asarray(positions, dtype=np.int64),
        activations=np.asarray([ids], dtype=np.int64),
        invalidate=tuple(invalidate or ()),
        return_mode=mode,
        return_last=return_last,
        sampling=sampling,
        tree_chains=chains,
        tree_keep=keep_chain,
        tree_parents=parents,
        tree_kept=kept,
        top1_ids_only=mode is ReturnMode.TOP1 and not probabilities,
        return_features=features and not fill_only,
        draft_heads=0 if fill_only else heads,
        head_path_tokens=tuple(ids[len(ids) - return_last :]) if heads and not fill_only else (),
        allowed_tokens=b"" if fill_only else allowed,
    )


def token_frame(
    session_id: str, step: int, ids: list[int], start: int, greedy: bool, **options: Any
) -> activation_pb2.ActivationFrame:
    """The frame of one :func:`token_row` (its arguments), stamped as sent now: the row built
    and translated by the one builder and the one translation."""
    row = token_row(session_id, step, ids, start, greedy, **options)
    return frame_from_step(Step([row], sent_unix_nanos=time.time_ns()))


def tree_positions(start: int, parents: tuple[int, ...]) -> np.ndarray:
    """The logical positions of a tree row's tokens: ``start`` after the cache, its parent's + 1
    below it."""
    out = np.empty(len(parents), dtype=np.int64)
    for i, parent in enumerate(parents):
        out[i] = start if parent < 0 else out[parent] + 1
    return out
