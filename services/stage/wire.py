"""Protobuf <-> stage domain objects: every activation frame is built and read here, by the
stage (servicer, next hop) and by the coordinator (the token frames it sends into stage 0)."""

from __future__ import annotations

import time

import numpy as np

from pipeshard.errors import InvalidArgument, PipeshardError
from pipeshard.sampling import Distribution, check_rng_state
from pipeshard.services.stage.domain import ReturnMode, SamplingStep, StepInput, StepOutput
from pipeshard.tensor_codec import Codec, decode, encode
from pipeshard.v1 import activation_pb2, tensor_pb2

_MODES = {
    activation_pb2.RETURN_MODE_UNSPECIFIED: ReturnMode.TOP1,
    activation_pb2.RETURN_MODE_TOP1: ReturnMode.TOP1,
    activation_pb2.RETURN_MODE_LOGITS: ReturnMode.LOGITS,
    activation_pb2.RETURN_MODE_NONE: ReturnMode.NONE,
    activation_pb2.RETURN_MODE_SAMPLED: ReturnMode.SAMPLED,
}
_PB_MODES = {
    ReturnMode.TOP1: activation_pb2.RETURN_MODE_TOP1,
    ReturnMode.LOGITS: activation_pb2.RETURN_MODE_LOGITS,
    ReturnMode.NONE: activation_pb2.RETURN_MODE_NONE,
    ReturnMode.SAMPLED: activation_pb2.RETURN_MODE_SAMPLED,
}


def step_from_frame(frame: activation_pb2.ActivationFrame, port: str) -> StepInput:
    """Decode a frame for a stage whose input port is ``port`` (input_ids or hidden_states)."""
    if not frame.session_id:
        raise InvalidArgument("session_id", "must not be empty")
    tensors = {t.name: t.tensor for t in frame.tensors}
    if port not in tensors:
        raise InvalidArgument("tensors", f"must carry {port!r}, got {sorted(tensors) or 'none'}")
    if frame.return_mode not in _MODES:
        raise InvalidArgument("return_mode", f"unknown value {frame.return_mode}")
    return StepInput(
        session_id=frame.session_id,
        step_id=frame.step_id,
        positions=np.asarray(frame.positions, dtype=np.int64),
        activations=_widen(decode(tensors[port], field=port)),
        invalidate=[(r.start, r.end) for r in frame.mask_update.invalidate],
        return_mode=_MODES[frame.return_mode],
        return_last=frame.return_last or 1,
        compute_micros=list(frame.stage_compute_micros),
        sent_unix_nanos=frame.sent_unix_nanos,
        owner=frame.owner,
        sampling=_sampling_step(frame) if frame.return_mode == activation_pb2.RETURN_MODE_SAMPLED else None,
        tree_chains=max(1, frame.tree_chains),
        tree_keep=frame.tree_keep - 1,
    )


def _widen(x: np.ndarray) -> np.ndarray:
    """Hidden states sent as fp16 (``--wire-dtype fp16``, lossy) run as float32 like the rest."""
    return x.astype(np.float32) if x.dtype == np.float16 else x


def _sampling_step(frame, prefix: str = "") -> SamplingStep:
    """The sampling request of a frame or of a plan frame's row (``prefix`` names the field)."""
    if not frame.HasField("sampling"):
        raise InvalidArgument(f"{prefix}sampling", "is required with RETURN_MODE_SAMPLED")
    s = frame.sampling
    dist = Distribution(s.temperature, s.top_k, s.top_p)
    dist.check(f"{prefix}sampling.")
    check_rng_state(s.rng_state, f"{prefix}sampling.rng_state")
    return SamplingStep(dist, s.rng_state, list(s.draft_tokens))


def sampling_request(step: SamplingStep) -> activation_pb2.SamplingRequest:
    d = step.distribution
    return activation_pb2.SamplingRequest(
        temperature=d.temperature,
        top_k=d.top_k,
        top_p=d.top_p,
        rng_state=step.rng_state,
        draft_tokens=step.draft_tokens,
    )


WIRE_DTYPES = ("fp32", "fp16", "bf16")  # fp16 and bf16 are LOSSY opt-ins (docs/BENCHMARKS.md)


def steps_from_plan(frame: activation_pb2.ActivationFrame, port: str) -> list[StepInput]:
    """Decode a plan frame (continuous batching): one StepInput per row, each taking its
    ``tokens`` of the frame's positions and tensor rows in row order."""
    tensors = {t.name: t.tensor for t in frame.tensors}
    if port not in tensors:
        raise InvalidArgument("tensors", f"must carry {port!r}, got {sorted(tensors) or 'none'}")
    x = decode(tensors[port], field=port)
    counts = [row.tokens for row in frame.plan.rows]
    total = len(frame.positions)
    if min(counts) < 1 or sum(counts) != total or x.ndim < 2 or x.shape[0] != 1 or x.shape[1] != total:
        raise InvalidArgument(
            "plan", f"rows of {counts} tokens must cover the frame's {total} positions and {port} rows"
        )
    positions = np.asarray(frame.positions, dtype=np.int64)
    steps, start = [], 0
    for row in frame.plan.rows:
        if not row.session_id:
            raise InvalidArgument("plan.rows.session_id", "must not be empty")
        if row.return_mode not in _MODES:
            raise InvalidArgument("plan.rows.return_mode", f"unknown value {row.return_mode}")
        end = start + row.tokens
        steps.append(
            StepInput(
                session_id=row.session_id,
                step_id=row.step_id,
                positions=positions[start:end],
                activations=x[:, start:end],
                invalidate=[(r.start, r.end) for r in row.mask_update.invalidate],
                return_mode=_MODES[row.return_mode],
                return_last=row.return_last or 1,
                compute_micros=list(frame.stage_compute_micros),
                sent_unix_nanos=frame.sent_unix_nanos,
                owner=frame.owner,
                sampling=(
                    _sampling_step(row, "plan.rows.")
                    if row.return_mode == activation_pb2.RETURN_MODE_SAMPLED
                    else None
                ),
            )
        )
        start = end
    return steps


def _plan_row(step: StepInput, tokens: int) -> activation_pb2.PlanRow:
    return activation_pb2.PlanRow(
        slot_id=-1,
        position=int(step.positions[0]) if len(step.positions) else 0,
        session_id=step.session_id,
        step_id=step.step_id,
        tokens=tokens,
        return_mode=_PB_MODES[step.return_mode],
        return_last=step.return_last,
        mask_update=activation_pb2.MaskUpdate(
            invalidate=[activation_pb2.CacheRange(start=s, end=e) for s, e in step.invalidate]
        ),
        sampling=sampling_request(step.sampling) if step.sampling is not None else None,
    )


def plan_from_outputs(
    outs: list[StepOutput], codec: int = Codec.CODEC_NONE
) -> activation_pb2.ActivationFrame:
    """The plan frame a non-final stage sends on: every row's hidden states concatenated."""
    hidden = np.concatenate([o.hidden_states for o in outs], axis=1)
    first = outs[0].step
    return activation_pb2.ActivationFrame(
        session_id=first.session_id,
        step_id=first.step_id,
        positions=np.concatenate([o.step.positions for o in outs]).tolist(),
        tensors=[tensor_pb2.NamedTensor(name="hidden_states", tensor=encode(hidden, codec))],
        plan=activation_pb2.PlanFrame(rows=[_plan_row(o.step, o.hidden_states.shape[1]) for o in outs]),
        stage_compute_micros=first.compute_micros,
        sent_unix_nanos=first.sent_unix_nanos,
        owner=first.owner,
    )


def plan_from_frames(frames: list[activation_pb2.ActivationFrame]) -> activation_pb2.ActivationFrame:
    """The coordinator's plan frame for a step of many sessions' token frames (one row each)."""
    ids = [decode(f.tensors[0].tensor, field="input_ids") for f in frames]
    rows = [
        activation_pb2.PlanRow(
            slot_id=-1,
            position=f.positions[0],
            session_id=f.session_id,
            step_id=f.step_id,
            tokens=len(f.positions),
            return_mode=f.return_mode,
            return_last=f.return_last,
            mask_update=f.mask_update,
            sampling=f.sampling if f.HasField("sampling") else None,
        )
        for f in frames
    ]
    return activation_pb2.ActivationFrame(
        session_id=frames[0].session_id,
        step_id=frames[0].step_id,
        positions=[p for f in frames for p in f.positions],
        tensors=[tensor_pb2.NamedTensor(name="input_ids", tensor=encode(np.concatenate(ids, axis=1)))],
        plan=activation_pb2.PlanFrame(rows=rows),
        sent_unix_nanos=time.time_ns(),
        owner=frames[0].owner,
    )


def frame_from_output(
    out: StepOutput, codec: int = Codec.CODEC_NONE, wire_dtype: str = "fp32"
) -> activation_pb2.ActivationFrame:
    """The frame a non-final stage sends on: its hidden states plus the step's bookkeeping."""
    step = out.step
    hidden = encode(out.hidden_states, codec, as_fp16=wire_dtype == "fp16", as_bf16=wire_dtype == "bf16")
    return activation_pb2.ActivationFrame(
        session_id=step.session_id,
        step_id=step.step_id,
        positions=step.positions.tolist(),
        mask_update=activation_pb2.MaskUpdate(
            invalidate=[activation_pb2.CacheRange(start=s, end=e) for s, e in step.invalidate]
        ),
        tensors=[tensor_pb2.NamedTensor(name="hidden_states", tensor=hidden)],
        return_mode=_PB_MODES[step.return_mode],
        return_last=step.return_last,
        stage_compute_micros=step.compute_micros,
        sent_unix_nanos=step.sent_unix_nanos,
        owner=step.owner,
        sampling=sampling_request(step.sampling) if step.sampling is not None else None,
        tree_chains=step.tree_chains if step.tree_chains > 1 else 0,
        tree_keep=step.tree_keep + 1,
    )


def result_from_output(out: StepOutput, codec: int = Codec.CODEC_NONE) -> activation_pb2.StepResult:
    """The final stage's result; ``codec`` compresses its logits (the return link's choice)."""
    step = out.step
    result = activation_pb2.StepResult(
        session_id=step.session_id, step_id=step.step_id, stage_compute_micros=step.compute_micros
    )
    if out.top1 is not None:
        result.top1.token_ids.extend(out.top1.token_ids.tolist())
        result.top1.probabilities.extend(out.top1.probabilities.tolist())
    if out.logits is not None:
        result.logits.CopyFrom(encode(out.logits, codec))
    if out.sampled is not None:
        result.sampled.token_ids.extend(out.sampled.token_ids)
        result.sampled.rng_state = out.sampled.rng_state
    return result


def stage_error(stage_index: int, exc: BaseException) -> activation_pb2.StageError:
    code = exc.code if isinstance(exc, PipeshardError) else "INTERNAL"
    message = str(exc) if isinstance(exc, PipeshardError) else f"internal error: {type(exc).__name__}"
    return activation_pb2.StageError(stage_index=stage_index, code=code, message=message)


def error_frame(frame, error: activation_pb2.StageError):
    """A frame that carries an earlier stage's failure down the ring (no tensors); ``frame`` is
    the failed frame or step (a plan frame's row fails alone)."""
    return activation_pb2.ActivationFrame(
        session_id=frame.session_id, step_id=frame.step_id, error=error, owner=frame.owner
    )


def error_result(frame, error: activation_pb2.StageError):
    return activation_pb2.StepResult(session_id=frame.session_id, step_id=frame.step_id, error=error)


def token_frame(
    session_id: str,
    step: int,
    ids: list[int],
    start: int,
    greedy: bool,
    *,
    fill_only: bool = False,
    return_last: int = 1,
    invalidate: list[tuple[int, int]] | None = None,
    sampling: activation_pb2.SamplingRequest | None = None,
    chains: int = 1,
    keep_chain: int = -1,
) -> activation_pb2.ActivationFrame:
    """The frame that carries token ids into stage 0 at logical positions ``start...``.

    ``fill_only``: a prefill chunk, no result; otherwise the final stage answers for the last
    ``return_last`` ids (the last token and the drafts after it): Top1 when ``greedy``, drawn
    tokens when ``sampling`` is given, else logits. ``invalidate``: physical cache
    ranges every stage masks out before running (rejected drafts of the previous step).
    ``chains`` > 1: ``ids`` are that many equal-length chains of a draft tree, each at positions
    ``start...``; ``keep_chain``: the chain of the previous (tree) step whose cache is kept.
    """
    if fill_only:
        mode, sampling = activation_pb2.RETURN_MODE_NONE, None
    elif sampling is not None:
        mode = activation_pb2.RETURN_MODE_SAMPLED
    else:
        mode = activation_pb2.RETURN_MODE_TOP1 if greedy else activation_pb2.RETURN_MODE_LOGITS
    return activation_pb2.ActivationFrame(
        session_id=session_id,
        step_id=step,
        positions=list(range(start, start + len(ids) // chains)) * chains,
        mask_update=activation_pb2.MaskUpdate(
            invalidate=[activation_pb2.CacheRange(start=s, end=e) for s, e in invalidate or ()]
        ),
        tensors=[tensor_pb2.NamedTensor(name="input_ids", tensor=encode(np.asarray([ids], dtype=np.int64)))],
        return_mode=mode,
        return_last=return_last,
        sent_unix_nanos=time.time_ns(),
        sampling=sampling,
        tree_chains=chains if chains > 1 else 0,
        tree_keep=keep_chain + 1,
    )
