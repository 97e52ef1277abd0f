"""A stage in the ring: runs step frames on its shard in arrival order, then passes them on.

Every frame is a step of one or more rows, run by one engine call whatever the KV backend.
Inference runs on the event-loop thread itself (the CPU is the bottleneck, so one frame at a
time; frames arriving meanwhile wait in gRPC's buffers). A non-final stage forwards hidden
states to the next hop of each row's session (one of its ``next_hops``, the replicas of the next
stage: per-hop routing; a step whose rows go to several hops leaves as one frame per hop); the
final stage publishes results to the coordinator's subscription.
A failure becomes a StageError that travels the rest
of the ring, so the coordinator learns which stage failed and why.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence

import structlog

from pipeshard import allocator, trace
from pipeshard.errors import InvalidArgument, NotFound, Unimplemented
from pipeshard.link_model import CodecChooser, LinkEstimate, check_wire_dtype, parse_codec
from pipeshard.services.stage.domain import Step, StepOutput
from pipeshard.services.stage.kv import StageKv
from pipeshard.services.stage.results import ResultBroker
from pipeshard.services.stage.step_engine import RowEngine
from pipeshard.services.stage.wire import (
    DEFAULT_MAX_FRAME_TOKENS,
    MAX_ID_CHARS,
    FrameLimits,
    error_frame,
    error_result,
    frame_from_outputs,
    result_from_output,
    stage_error,
    step_from_frame,
)
from pipeshard.services.transport.hop import HopStream
from pipeshard.shard.manifest import input_port
from pipeshard.v1 import activation_pb2

log = structlog.get_logger(__name__)

IDLE_TRIM_S = 30.0  # how often an idle stage returns free heap pages (malloc_trim: a few ms)


class StageNode:
    def __init__(
        self,
        engine: RowEngine,
        stage_index: int,
        *,
        next_hops: Sequence[HopStream] = (),
        codec: CodecChooser | None = None,
        wire_dtype: str = "fp32",
        results_delay_s: float = 0.0,
        kv: StageKv | None = None,
        max_frame_tokens: int = DEFAULT_MAX_FRAME_TOKENS,
    ):
        """``codec`` picks the compression of each frame sent on (fixed or measured per link);
        ``wire_dtype`` fp16/bf16 narrows hidden states on the wire (lossy, opt-in);
        ``max_frame_tokens``: the most positions one frame may carry (refused before decoding).
        ``next_hops``: the replicas of the next stage a session may be routed to (OpenSession's
        ``next_hop`` indexes them), the first this replica's own lane's; ``codec`` measures its link."""
        if engine.is_last != (not next_hops):
            raise ValueError("exactly the final stage has no next hop")
        self.engine = engine
        self.stage_index = stage_index
        self.next_hops = list(next_hops)
        self.results = ResultBroker(results_delay_s)
        self._codec = codec or CodecChooser("none", None)
        # (hop, mode) -> chooser: every mode of a hop shares that hop's measured link
        self._hop_codecs: dict[tuple[int, str], CodecChooser] = {(0, self._codec.mode): self._codec}
        self._results_links: dict[str, LinkEstimate] = {}  # owner -> its return link
        self._results_codecs: dict[tuple[str, str], CodecChooser] = {}  # (owner, mode) -> chooser
        self._wire_dtype = wire_dtype
        self.kv = kv  # KV capture/restore and the prefix cache (None: a node without a shard runtime)
        self._port = input_port(engine.is_first)
        self._limits = FrameLimits(engine.hidden_size, max_frame_tokens)
        self._reaper: asyncio.Task | None = None

    @property
    def next_hop(self) -> HopStream | None:
        """This replica's own lane's next hop (the first), whose state its health reports."""
        return self.next_hops[0] if self.next_hops else None

    @property
    def kv_service(self) -> StageKv:
        """The node's KV capture and restore (Unimplemented on a node without a shard runtime)."""
        if self.kv is None:
            raise Unimplemented("this stage serves no KV capture or restore")
        return self.kv

    async def handle(self, frame: activation_pb2.ActivationFrame) -> activation_pb2.StageError | None:
        """Run a step frame's rows in one engine call and pass their outputs on; a failed row
        travels the ring as its own error, the others go on together. Returns this stage's
        first error, if any (the sender hears of a failed row)."""
        if frame.HasField("error"):
            await self._pass_on_error(frame, frame.error, frame.owner)
            return None
        try:
            self._check_sessions(frame)
            step = step_from_frame(frame, self._port, self._limits)
            trace.mark("decoded", frame.session_id, frame.step_id)
            # Inline on the event-loop thread: measured 0.3 ms per transfer and about 1.4 ms of
            # inference per token cheaper than a worker thread (docs/BENCHMARKS.md); frames that
            # arrive meanwhile wait in gRPC's buffers, in order.
            outs = self.engine.run_step(step)
            trace.mark("inferred", frame.session_id, frame.step_id)
        except Exception as exc:  # an undecodable frame or a failed inference fails every row
            error = stage_error(self.stage_index, exc)
            self._log_failure(frame, error)
            # Every row's session hears of it, not only the first: the others would wait for a timeout.
            for row in frame.plan.rows or [frame]:
                await self._pass_on_error(row, error, frame.owner)
            return error
        good, first_error = [], None
        for row, out in zip(step.rows, outs, strict=True):
            if isinstance(out, Exception):
                error = stage_error(self.stage_index, out)
                self._log_failure(row, error)
                await self._pass_on_error(row, error, frame.owner)
                first_error = first_error or error
            else:
                good.append(out)
        if not self.next_hops:
            if good:  # the step's rows in one message
                self.results.publish([self._result(out, step, frame.owner) for out in good], frame.owner)
            trace.mark("published", frame.session_id, frame.step_id)
        elif good:
            by_hop: dict[int, list[StepOutput]] = {}
            for out in good:
                by_hop.setdefault(self.engine.sessions.hop(frame.owner, out.row.session_id), []).append(out)
            for hop, sending in by_hop.items():
                # One tensor per hop: its first row's session names the codec. Every row to one
                # hop (lanes, or a fleet whose routes agree): the frame goes on as it came.
                chooser = self._hop_chooser(hop, frame.owner, sending[0].row.session_id)
                codec = chooser.choose(sending[0].hidden)
                sent = frame_from_outputs(step, sending, codec, self._wire_dtype, received=frame)
                tensor = sent.tensors[0].tensor
                chooser.sent(tensor.raw_size, len(tensor.data), codec)
                trace.mark("encoded", frame.session_id, frame.step_id)
                await self.next_hops[hop].send(sent)
        await asyncio.sleep(0)  # let the output leave before the next frame's compute starts
        return first_error

    def _check_sessions(self, frame: activation_pb2.ActivationFrame) -> None:
        """Refuses a frame for none of its owner's open sessions before any tensor is decoded:
        decoding costs memory and time, which only a session's owner may spend. A row whose session
        went meanwhile (aborted mid-step) still fails alone, after its step's others are decoded."""
        if not any(self.engine.sessions.has(frame.owner, row.session_id) for row in frame.plan.rows):
            named = frame.plan.rows[0].session_id if frame.plan.rows else frame.session_id
            raise NotFound(f"unknown session {named[:MAX_ID_CHARS]!r}")

    @staticmethod
    def _log_failure(row, error: activation_pb2.StageError) -> None:
        log_fn = log.error if error.code == "INTERNAL" else log.warning
        log_fn(
            "frame_failed",
            session_id=row.session_id,
            step_id=row.step_id,
            code=error.code,
            message=error.message,
            exc_info=error.code == "INTERNAL",
        )

    def note_results_link(self, owner: str, bandwidth_bytes_s: float) -> None:
        """The owner's measurement of its return link (final stage -> coordinator), sent with each
        OpenSession; the final stage chooses the codec of that owner's logits from it."""
        if not math.isfinite(bandwidth_bytes_s) or bandwidth_bytes_s < 0:
            raise InvalidArgument(
                "results_link_bandwidth_bytes_per_second", f"must be finite and >= 0, got {bandwidth_bytes_s}"
            )
        if not self.next_hops and bandwidth_bytes_s > 0:
            self._results_link(owner).observe_rate(bandwidth_bytes_s)

    def open_session(
        self, owner: str, session_id: str, capacity: int | None, codec: str, next_hop: int | None = None
    ) -> None:
        """Opens a session with the codec it asked for (empty: the stage's own ``--codec``); the
        frames and results this stage sends for it use it, so one fleet can compare codecs request
        by request. ``next_hop``: the index of the next stage's replica its frames go to (None: the
        first). Both are checked before the session opens, so a bad one opens nothing."""
        if codec:
            parse_codec(codec)
            check_wire_dtype(codec, self._wire_dtype)
        hop = self._check_hop(next_hop)
        self.engine.open(owner, session_id, capacity)
        self.engine.sessions.set_codec(owner, session_id, codec)
        self.engine.sessions.set_hop(owner, session_id, hop)

    def route_session(
        self, owner: str, session_id: str, next_hop: int | None, keep_positions: int | None
    ) -> int:
        """Re-points one of ``owner``'s sessions (a per-hop failover moved another stage's part of
        it): frames computed from now on go to ``next_hop`` (None: unchanged), and its cache keeps
        at most ``keep_positions`` positions (None: unchanged). Returns the positions it holds.
        Frames already computed went to the hop they were computed for: a step runs whole on the
        event loop before this call can."""
        hop = None if next_hop is None else self._check_hop(next_hop)
        self.engine.sessions.get(owner, session_id)  # another owner's session: as unknown as none
        if keep_positions is not None:
            self.engine.keep_positions(owner, session_id, keep_positions)
        if hop is not None:
            self.engine.sessions.set_hop(owner, session_id, hop)
        return self.engine.sessions.get(owner, session_id).past_length

    def _check_hop(self, next_hop: int | None) -> int:
        """A session's next hop as an index into ``next_hops``, never a free address."""
        if next_hop is None:
            return 0
        if not self.next_hops:
            raise InvalidArgument(
                "next_hop", f"stage {self.stage_index} is the final stage: it has no next hop"
            )
        if not 0 <= next_hop < len(self.next_hops):
            known = ", ".join(f"{i}: {hop.address}" for i, hop in enumerate(self.next_hops))
            raise InvalidArgument(
                "next_hop",
                f"{next_hop} names no replica of stage {self.stage_index + 1} "
                f"(this stage forwards to {known})",
            )
        return next_hop

    def _session_mode(self, owner: str, session_id: str) -> str:
        return self.engine.sessions.codec(owner, session_id) or self._codec.mode

    def _hop_chooser(self, hop: int, owner: str, session_id: str) -> CodecChooser:
        """Next hop ``hop``'s chooser for this session's codec mode; every mode shares the hop's link."""
        mode = self._session_mode(owner, session_id)
        chooser = self._hop_codecs.get((hop, mode))
        if chooser is None:
            chooser = self._codec.with_mode(mode)
            if hop:
                chooser = chooser.for_link(self.next_hops[hop].link)
            self._hop_codecs[(hop, mode)] = chooser
        return chooser

    def _results_link(self, owner: str) -> LinkEstimate:
        link = self._results_links.get(owner)
        if link is None:
            link = self._results_links[owner] = LinkEstimate(f"results-{owner[:8]}")
        return link

    def _results_chooser(self, owner: str, session_id: str) -> CodecChooser:
        mode = self._session_mode(owner, session_id)
        chooser = self._results_codecs.get((owner, mode))
        if chooser is None:
            chooser = self._codec.with_mode(mode).for_link(self._results_link(owner))
            self._results_codecs[(owner, mode)] = chooser
        return chooser

    def _forget_owner(self, owner: str) -> None:
        self._results_links.pop(owner, None)
        if self.kv is not None:
            self.kv.store.forget_owner(owner)
        for key in [k for k in self._results_codecs if k[0] == owner]:
            del self._results_codecs[key]

    def _result(self, out: StepOutput, step: Step, owner: str) -> activation_pb2.StepResult:
        """The final stage's result of a row for ``owner``. Only logits are worth compressing on the
        return link (top-1 and sampled ids are a few bytes): chosen like the next hop's codec, from
        the owner's measured return link."""
        if out.logits is None:
            return result_from_output(out, step.compute_micros)
        chooser = self._results_chooser(owner, out.row.session_id)
        codec = chooser.choose(out.logits)
        result = result_from_output(out, step.compute_micros, codec)
        chooser.sent(result.logits.raw_size, len(result.logits.data), codec)
        return result

    async def _pass_on_error(self, row, error: activation_pb2.StageError, owner: str) -> None:
        if not self.next_hops:
            self.results.publish([error_result(row, error)], owner)
        else:
            hop = self.engine.sessions.hop(owner, row.session_id)
            await self.next_hops[hop].send(error_frame(row, error, owner))

    def start_reaper(self, idle_timeout_s: float, lease_grace_s: float = 5.0) -> None:
        """Release sessions whose coordinator vanished without releasing them: all of an owner's
        sessions once it has held no Results subscription (its lease) for ``lease_grace_s``, and
        any session idle for ``idle_timeout_s``. When the last session has gone, and every
        ``IDLE_TRIM_S`` while none is open, hand malloc's free pages back to the OS (what steps
        and bursts of large messages left behind)."""
        detached: dict[str, float] = {}

        async def reap() -> None:
            loop = asyncio.get_running_loop()
            trimmed, served = loop.time(), False
            while True:
                await asyncio.sleep(min(1.0, max(0.1, lease_grace_s / 4)))
                now = loop.time()
                served = served or bool(len(self.engine.sessions))
                if not len(self.engine.sessions) and (served or now - trimmed >= IDLE_TRIM_S):
                    allocator.trim()
                    trimmed, served = now, False
                owners = self.engine.sessions.owners()
                for owner in list(detached):
                    if owner not in owners or self.results.subscribed(owner):
                        del detached[owner]
                for owner in owners:
                    if self.results.subscribed(owner):
                        continue
                    if now - detached.setdefault(owner, now) >= lease_grace_s:
                        released = self.engine.sessions.release_owner(owner)
                        del detached[owner]
                        self._forget_owner(owner)
                        log.info("owner_sessions_released", sessions=len(released), reason="no lease")
                for session_id in self.engine.sessions.reap_idle():
                    log.info("session_reaped", session_id=session_id, idle_timeout_s=idle_timeout_s)

        self._reaper = asyncio.create_task(reap(), name="session-reaper")

    async def close(self) -> None:
        """Ends result subscriptions and the next-hop stream so a drain does not wait on them."""
        if self._reaper is not None:
            self._reaper.cancel()
        self.results.close()
        for hop in self.next_hops:
            await hop.close()
