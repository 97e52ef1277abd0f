"""The ring's transport to stage services over gRPC: frames into stage 0, results back from the
final stage (the in-process transport is in_process.py; the ring over either is ring.py).

One persistent Forward stream to stage 0 and one Results subscription to the final stage
carry every session's steps; a step's rows are futures keyed by (session id, step id). Control
calls (open, release) go to every stage directly. Every call carries this ring's owner secret
(pipeshard.ownership) and every frame its owner key, so stages keep its sessions to itself; a
Results subscription on every remote stage is its lease there (sessions are released a few
seconds after it closes). A :class:`StageWatch` holds a health stream to every remote stage:
when one breaks, every pending step fails at once with UNAVAILABLE naming the stage (the step
deadline remains for a stage that freezes: then the ring asks each stage for its info and names
the first that does not answer). Releases a stage missed while unreachable are sent again as
aborts when it answers again.

Replicas (replicas.py) run one of these per lane, all sharing one owner secret and one table of
pending steps (:class:`PendingSteps`): a session routed across lanes (per-hop routing) is opened
on each of its stages by that stage's lane, under the same owner, enters at its stage 0 replica's
lane and is answered through its final replica's lane's subscription. The per-stage calls
(``stages=``, ``open_stage``, ``route_stage``, ``capture_stage``, ``restore_stage``) serve such
routes; a lane's own sessions use the whole-lane calls.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable

import grpc
import structlog

from pipeshard import trace
from pipeshard.errors import DeadlineExceeded, PipeshardError, Unavailable
from pipeshard.link_model import LinkEstimate, train_rate
from pipeshard.ownership import new_secret, owner_key, owner_metadata
from pipeshard.services.coordinator.local_stage import LocalEntry, LocalStageStub
from pipeshard.services.coordinator.ring import PLAIN, SessionTerms, ShuttingDown, StageFailed
from pipeshard.services.coordinator.stage_watch import StageWatch
from pipeshard.services.coordinator.step_deadline import StepDeadline
from pipeshard.services.stage.wire import plan_from_frames
from pipeshard.services.transport.channels import open_channel
from pipeshard.services.transport.hop import PROBE_TRAIN, HopStream, keep_open
from pipeshard.shard.kvblob import SnapshotBytes
from pipeshard.tls import TlsConfig
from pipeshard.v1 import activation_pb2, stage_pb2, stage_pb2_grpc

log = structlog.get_logger(__name__)

# A control call slower than this is logged (``stage_control_slow``): a stage answering late, long
# before ``control_timeout_s`` fails it.
SLOW_CONTROL_S = 1.0

_MAX_UNRELEASED = 4096  # sessions remembered per unreachable stage, to abort when it returns


class PendingSteps:
    """The steps awaiting their results, by (session id, step id): one table for every lane of a
    coordinator, since a session's final replica may sit in another lane than its entry."""

    def __init__(self) -> None:
        self._futures: dict[tuple[str, int], asyncio.Future] = {}

    def add(self, keys: list[tuple[str, int]], futures: list[asyncio.Future]) -> None:
        self._futures.update(zip(keys, futures, strict=True))

    def pop(self, key: tuple[str, int]) -> None:
        self._futures.pop(key, None)

    def resolve(self, result: activation_pb2.StepResult) -> None:
        future = self._futures.get((result.session_id, result.step_id))
        if future is not None and not future.done():
            future.set_result(result)

    def fail(self, error: PipeshardError, affected: Callable[[str], bool] = lambda session_id: True) -> None:
        """Fails the pending steps of the sessions ``affected`` names (every one by default)."""
        for (session_id, _), future in list(self._futures.items()):
            if not future.done() and affected(session_id):
                future.set_exception(error)


def _answer(future: asyncio.Future):
    """A frame's answer from its settled future: its StepResult, or the exception for it (a
    stage's error answer, or the failure ``PendingSteps.fail`` set), each row its own."""
    error = future.exception()
    if error is not None:
        return error
    result = future.result()
    return StageFailed(result.error) if result.HasField("error") else result


class RemoteStages:
    def __init__(
        self,
        stage_addresses: list[str],
        *,
        step_timeout_s: float = 30.0,
        control_timeout_s: float = 30.0,
        local_stage0: tuple[LocalEntry, LocalStageStub] | None = None,
        hop_delay_s: float = 0.0,
        tls: TlsConfig | None = None,
        secret: str | None = None,
        pending: PendingSteps | None = None,
    ):
        """``stage_addresses`` lists every remote stage in order; with ``local_stage0`` they are
        stages 1..N-1 and stage 0 runs in this process. ``hop_delay_s`` delays the frames sent to
        stage 0 (emulated latency; a hosted stage 0 gets it on its own next hop instead).
        ``secret`` and ``pending``: the owner secret and the pending steps this transport shares
        with the other lanes of its coordinator (its own by default)."""
        if not stage_addresses:
            raise ValueError("a ring needs at least one remote stage")
        self.step_timeout_s = step_timeout_s
        self.deadline = StepDeadline(step_timeout_s)
        self.control_timeout_s = control_timeout_s
        secret = secret or new_secret()
        self._owner = owner_key(secret)
        self._metadata = owner_metadata(secret)
        self._channels = [open_channel(a, tls) for a in stage_addresses]
        self._stubs: list[stage_pb2_grpc.StageServiceStub | LocalStageStub] = [
            stage_pb2_grpc.StageServiceStub(c) for c in self._channels
        ]
        self._entry: HopStream | LocalEntry
        if local_stage0 is None:
            self.addresses = list(stage_addresses)
            self._entry = HopStream(
                stage_addresses[0],
                on_error=self._on_entry_error,
                delay_s=hop_delay_s,
                channel=self._channels[0],
            )
        else:
            self.addresses = ["in-process", *stage_addresses]
            self._entry, stub0 = local_stage0
            self._stubs.insert(0, stub0)
        self._pending = pending or PendingSteps()
        # Whether a session's steps pass through this transport's stage i (replicas.py routes
        # sessions across lanes; alone, all of them do): a stage lost fails only those.
        self.routes_through: Callable[[str, int], bool] = lambda session_id, i: True
        self._subscriber_id = f"coordinator-{uuid.uuid4().hex[:8]}"
        self._remote = self._stubs[self.num_stages - len(stage_addresses) :]
        self._subscriptions: list[asyncio.Task] = []
        self._subscribed = [asyncio.Event() for _ in self._remote]
        first_remote = self.num_stages - len(self._channels)
        self.watch = StageWatch(
            {first_remote + j: c for j, c in enumerate(self._channels)}, self.addresses, self._on_reachability
        )
        self.on_health: Callable[[bool], None] = lambda serving: None  # the coordinator's health
        self._unreleased: dict[int, set[str]] = {}  # stage -> sessions it missed the release of
        self._background: set[asyncio.Task] = set()
        self._stopped: ShuttingDown | None = None
        # The return link (final stage -> here), probed at each Results subscription; the final
        # stage hears of it with every OpenSession and picks its results codec from it.
        self.results_link = LinkEstimate("results")

    @property
    def healthy(self) -> bool:
        """True while every stage is reachable."""
        return not self.watch.down

    async def start(self) -> None:
        self._entry.start()
        self._subscriptions = [
            asyncio.create_task(self._subscribe(i), name=f"ring-results-{i}")
            for i in range(len(self._remote))
        ]
        self.watch.start()

    def stop_steps(self, reason: str) -> None:
        """Fails every pending and future step with :class:`ShuttingDown` (end of a drain)."""
        self._stopped = ShuttingDown(reason)
        self._fail_pending(self._stopped)

    async def close(self) -> None:
        await self.watch.close()
        tasks = [*self._subscriptions, *self._background]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._entry.close()
        for channel in self._channels:
            await channel.close()

    @property
    def num_stages(self) -> int:
        return len(self.addresses)

    async def run(self, frames: list[activation_pb2.ActivationFrame], *, checked: bool = True) -> list:
        """Send a step (one session's frame, or many sessions' frames as one plan frame) around
        the stages; answers each frame with its StepResult or the error to raise for it.
        ``checked=False``: the caller checked the sessions' routes (some may leave this lane)."""
        if self._stopped is not None:
            return [self._stopped] * len(frames)
        if checked and self.watch.down:
            return [Unavailable(self.watch.describe(min(self.watch.down)))] * len(frames)
        loop = asyncio.get_running_loop()
        keys = [(f.session_id, f.step_id) for f in frames]
        futures = [loop.create_future() for _ in frames]
        self._pending.add(keys, futures)
        try:
            trace.mark("plan_build", frames[0].session_id, frames[0].step_id)
            plan = frames[0] if len(frames) == 1 else plan_from_frames(frames)
            trace.mark("plan_send", plan.session_id, plan.step_id)
            if trace.enabled():  # one per row, under the plan's key: the timeline counts rows per step
                for _ in frames:
                    trace.mark("plan_row", plan.session_id, plan.step_id)
            plan.owner = self._owner
            sent = loop.time()
            await self._entry.send(plan)
            rows = len(plan.positions)
            timeout = self.timeout_for(rows)
            done, _ = await asyncio.wait(futures, timeout=timeout)
            if len(done) < len(futures):
                error = await self._diagnose(timeout)  # a stage named here fails the other steps too
                # A step that finished while its stages were asked was slow, not lost.
                if not all(f.done() and f.exception() is None for f in futures):
                    return [_answer(f) if f in done else error for f in futures]
            if all(f.exception() is None for f in futures):
                seconds = loop.time() - sent
                self.deadline.observe(rows, seconds)
                if seconds > self.deadline.floor(rows):  # a fixed budget would have failed it
                    log.info("step_slow", rows=rows, seconds=round(seconds, 1), deadline_s=round(timeout, 1))
        finally:
            for key in keys:
                self._pending.pop(key)
            for future in futures:  # each failed one's exception retrieved, whatever way this ends
                if future.done():
                    future.exception()
                else:
                    future.cancel()
        return [_answer(f) for f in futures]

    def timeout_for(self, rows: int) -> float:
        """How long a step of ``rows`` rows may take before the stages are asked whether one froze
        (step_deadline.py: by its rows and this ring's measured time per row)."""
        return self.deadline.for_rows(rows)

    def _open_request(
        self, session_id: str, terms: SessionTerms, next_hop: int | None = None
    ) -> stage_pb2.OpenSessionRequest:
        request = stage_pb2.OpenSessionRequest(
            session_id=session_id,
            capacity=terms.capacity or 0,
            results_link_bandwidth_bytes_per_second=self.results_link.bandwidth_bytes_s or 0.0,
            codec=terms.codec,
        )
        if next_hop is not None:
            request.next_hop = next_hop
        return request

    async def open_session(self, session_id: str, terms: SessionTerms = PLAIN) -> int:
        """Open the session on every stage; returns the smallest max_context among them.
        ``terms``: the tokens it may use (a paged stage reserves them or refuses) and its codec."""
        request = self._open_request(session_id, terms)
        try:
            responses = await self._on_all("OpenSession", request)
        except BaseException:
            # All or nothing, also when the caller is cancelled meanwhile: no half-open session lingers.
            self._in_background(self.release_session(session_id), f"release-{session_id}")
            raise
        return min(r.max_context for r in responses)

    async def open_stage(self, i: int, session_id: str, terms: SessionTerms, next_hop: int | None) -> int:
        """Opens the session on stage ``i`` alone, forwarding to its next hop ``next_hop`` (an
        index into the stage's next hops; None: its first); returns its max_context. The caller
        releases it if the rest of the route fails."""
        request = self._open_request(session_id, terms, next_hop)
        (response,) = await self._on_all("OpenSession", request, stages=[i])
        return response.max_context

    async def route_stage(self, i: int, session_id: str, next_hop: int | None, keep_positions: int) -> int:
        """Re-points the session on stage ``i`` (RouteSession): its next hop (None: unchanged) and
        the positions its cache keeps; returns the positions it holds."""
        request = stage_pb2.RouteSessionRequest(session_id=session_id, keep_positions=keep_positions)
        if next_hop is not None:
            request.next_hop = next_hop
        (response,) = await self._on_all("RouteSession", request, stages=[i])
        return response.positions

    async def release_session(self, session_id: str, stages: list[int] | None = None) -> None:
        """Release on every stage (or ``stages``), tolerating stages that are down: each is sent an
        abort for it again when it answers again (a frozen stage still holds the session then)."""
        stages = list(range(self.num_stages)) if stages is None else stages
        responses = await self._on_all(
            "ReleaseSession",
            stage_pb2.ReleaseSessionRequest(session_id=session_id),
            tolerate=True,
            stages=stages,
        )
        for i, response in zip(stages, responses, strict=True):
            missed = self._unreleased.setdefault(i, set())
            if response is None and len(missed) < _MAX_UNRELEASED:
                missed.add(session_id)  # beyond the cap (a long outage) the stage's reaper frees them

    async def abort_session(self, session_id: str, reason: str, stages: list[int] | None = None) -> None:
        """Abort on every stage (or ``stages``) after a failed generation (logged there with the
        reason); frees the state like a release, tolerating stages that are down."""
        await self._on_all(
            "AbortSession",
            stage_pb2.AbortSessionRequest(session_id=session_id, reason=reason),
            tolerate=True,
            stages=stages,
        )

    async def keep_kv(
        self, session_id: str, scope: str, token_ids: list[int], stages: list[int] | None = None
    ) -> set[str]:
        """Every stage (or ``stages``) keeps the session's KV of ``token_ids`` in its prefix cache;
        returns the block keys any stage reports dropped (the prefix index forgets them)."""
        request = stage_pb2.CaptureKvRequest(
            session_id=session_id, token_ids=token_ids, keep_in_cache=True, cache_scope=scope
        )
        return {
            key for r in await self._on_all("CaptureKv", request, stages=stages) for key in r.evicted_blocks
        }

    async def restore_kv(
        self,
        session_id: str,
        scope: str,
        token_ids: list[int],
        positions: int,
        timeout_s: float,
        stages: list[int] | None = None,
    ) -> set[str]:
        """Restore the first ``positions`` positions of a cached sequence on every stage within
        ``timeout_s``; raises if any stage fails (the caller then discards the session). Returns
        the block keys any stage reports dropped."""
        request = stage_pb2.RestoreKvRequest(
            session_id=session_id, cache_scope=scope, cached_token_ids=token_ids, positions=positions
        )
        # a late stage: UNAVAILABLE
        responses = await self._on_all("RestoreKv", request, timeout=timeout_s, stages=stages)
        return {key for r in responses for key in r.evicted_blocks}

    async def capture_part(self, session_id: str, token_ids: list[int], start: int) -> list[SnapshotBytes]:
        """Every stage's KV of the session's positions [start, len(token_ids)), a part each, kept
        serialized as it arrived (no decoding here: the stage that restores it checks it);
        raises as a control call."""
        stages = range(self.num_stages)
        return list(
            await asyncio.gather(*(self.capture_stage(i, session_id, token_ids, start) for i in stages))
        )

    async def capture_stage(self, i: int, session_id: str, token_ids: list[int], start: int) -> SnapshotBytes:
        """Stage ``i``'s part of ``capture_part``."""
        request = stage_pb2.CaptureKvStreamRequest(
            capture=stage_pb2.CaptureKvRequest(
                session_id=session_id, token_ids=token_ids, from_position=start
            )
        )
        chunks, positions = [], 0
        try:
            call = self._stubs[i].CaptureKvStream(
                request, timeout=self.step_timeout_s, metadata=self._metadata
            )
            async for chunk in call:
                chunks.append(chunk.snapshot_chunk)
                positions = chunk.positions
        except grpc.aio.AioRpcError as exc:
            limit = f"{self.step_timeout_s:g} s (--step-timeout-s)"
            raise _stage_rpc_error(i, self.addresses[i], exc, "CaptureKvStream", limit) from None
        if not chunks:
            raise Unavailable(f"stage {i} at {self.addresses[i]} sent no snapshot")
        return SnapshotBytes(tuple(chunks), positions)

    async def restore_parts(
        self, session_id: str, parts: list[list[SnapshotBytes]], timeout_s: float
    ) -> None:
        """Restores stage i's consecutive parts ``parts[i]`` (as captured) into the session on
        every stage at once, streamed chunk by chunk; the stage joins them. Raises if any stage
        fails (the caller discards the session)."""
        stages = range(self.num_stages)
        results = await asyncio.gather(
            *(self.restore_stage(i, session_id, parts[i], timeout_s) for i in stages), return_exceptions=True
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def restore_stage(
        self, i: int, session_id: str, parts: list[SnapshotBytes], timeout_s: float
    ) -> None:
        """Stage ``i``'s part of ``restore_parts``: its consecutive ``parts``."""
        requests = (
            stage_pb2.RestoreKvStreamRequest(
                session_id=session_id if p == 0 and j == 0 else "",
                snapshot_chunk=chunk,
                snapshot_bytes=part.nbytes,
                next_part=p > 0 and j == 0,
            )
            for p, part in enumerate(parts)
            for j, chunk in enumerate(part.chunks)
        )
        try:
            await self._stubs[i].RestoreKvStream(requests, timeout=timeout_s, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            limit = f"{timeout_s:g} s"
            raise _stage_rpc_error(i, self.addresses[i], exc, "RestoreKvStream", limit) from None

    async def wait_ready(self, timeout_s: float) -> None:
        """Wait until every stage answers and the result subscription is live."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        for i, stub in enumerate(self._stubs):
            remaining = max(0.1, deadline - asyncio.get_running_loop().time())
            try:
                await stub.GetStageInfo(
                    stage_pb2.GetStageInfoRequest(),
                    timeout=remaining,
                    wait_for_ready=True,
                    metadata=self._metadata,
                )
            except grpc.aio.AioRpcError as exc:
                raise Unavailable(
                    f"stage {i} at {self.addresses[i]} is not ready: {exc.code().name}"
                ) from None
        for subscribed in self._subscribed:
            await asyncio.wait_for(subscribed.wait(), max(0.1, deadline - asyncio.get_running_loop().time()))

    async def stage_infos(self, stages: list[int] | None = None) -> list[stage_pb2.GetStageInfoResponse]:
        """Every stage's (or ``stages``') GetStageInfo answer, in pipeline order."""
        return await self._on_all("GetStageInfo", stage_pb2.GetStageInfoRequest(), stages=stages)

    async def _on_all(
        self,
        method: str,
        request,
        *,
        tolerate: bool = False,
        timeout: float | None = None,
        stages: list[int] | None = None,
    ) -> list:
        """``method`` on every stage (or ``stages``), answers in that order."""
        limit = timeout or self.control_timeout_s

        async def call(i: int):
            started = time.perf_counter()
            try:
                return await getattr(self._stubs[i], method)(request, timeout=limit, metadata=self._metadata)
            except grpc.aio.AioRpcError as exc:
                if tolerate:
                    log.warning("stage_control_failed", stage=i, method=method, code=exc.code().name)
                    return None
                hint = "" if timeout else " (--control-timeout-s)"
                raise _stage_rpc_error(i, self.addresses[i], exc, method, f"{limit:g} s{hint}") from None
            finally:
                seconds = time.perf_counter() - started
                if seconds > SLOW_CONTROL_S:
                    log.info("stage_control_slow", stage=i, method=method, seconds=round(seconds, 2))

        # Every call is waited for before an error is raised: a release that overtook a still
        # running open would leave that stage's session behind.
        stages = list(range(self.num_stages)) if stages is None else stages
        results = await asyncio.gather(*(call(i) for i in stages), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return results

    async def _diagnose(self, waited_s: float) -> PipeshardError:
        async def probe(i: int) -> str | None:
            try:
                await self._stubs[i].GetStageInfo(
                    stage_pb2.GetStageInfoRequest(), timeout=self.control_timeout_s, metadata=self._metadata
                )
            except grpc.aio.AioRpcError as exc:
                return exc.code().name
            return None

        answers = await asyncio.gather(*(probe(i) for i in range(self.num_stages)))
        for i, code in enumerate(answers):
            if code is not None:
                self.watch.mark_down(i, f"not answering: {code}")
                return Unavailable(f"stage {i} at {self.addresses[i]} is not answering ({code})")
        return DeadlineExceeded(f"no result from the pipeline within {round(waited_s, 1):g} s")

    def _fail_pending(self, error: PipeshardError) -> None:
        self._pending.fail(error)

    def _on_reachability(self, index: int, up: bool, reason: str) -> None:
        if up:
            sessions = self._unreleased.pop(index, set())
            if sessions:
                self._in_background(self._abort_on(index, sessions), f"abort-on-stage{index}")
        else:  # the steps of the sessions routed through it
            error = Unavailable(self.watch.describe(index))
            self._pending.fail(error, lambda session_id: self.routes_through(session_id, index))
        self.on_health(self.healthy)

    def _in_background(self, coro, name: str) -> None:
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _abort_on(self, index: int, sessions: set[str]) -> None:
        """Frees on a stage that is back the sessions whose release it missed."""
        for session_id in sessions:
            request = stage_pb2.AbortSessionRequest(
                session_id=session_id, reason="released while this stage was unreachable"
            )
            try:
                await self._stubs[index].AbortSession(
                    request, timeout=self.control_timeout_s, metadata=self._metadata
                )
            except grpc.aio.AioRpcError as exc:
                log.warning("stage_abort_failed", stage=index, session_id=session_id, code=exc.code().name)
                self._unreleased.setdefault(index, set()).add(session_id)

    def _on_entry_error(self, response: stage_pb2.ForwardResponse) -> None:
        # Stage 0's own errors also travel the ring; this only logs them early.
        log.debug("stage0_rejected", session_id=response.session_id, code=response.error.code)

    async def _subscribe(self, index: int) -> None:
        """Keep a Results subscription on remote stage ``index``: the final stage's delivers the
        results; the others carry none and hold this ring's lease on its sessions there."""

        def on_response(response: stage_pb2.ResultsResponse) -> None:
            results = response.results or (response.result,)  # a step's rows, or its one row
            trace.mark("result_recv", results[0].session_id, results[0].step_id)
            for result in results:
                self._pending.resolve(result)

        final = index == len(self._remote) - 1
        train: list[tuple[int, float]] = []

        def on_message(response: stage_pb2.ResultsResponse) -> None:
            if not response.padding:
                on_response(response)
                return
            train.append((response.ByteSize(), time.perf_counter()))
            if len(train) == PROBE_TRAIN:
                self.results_link.observe_rate(train_rate(train))
                log.info("results_link_measured", bandwidth_bytes_s=self.results_link.bandwidth_bytes_s)

        def open_call():
            train.clear()  # each (re)subscription probes the return link again
            return self._remote[index].Results(request, wait_for_ready=True, metadata=self._metadata)

        request = stage_pb2.ResultsRequest(subscriber_id=self._subscriber_id, link_probe=final)
        await keep_open(
            open_call,
            on_message,
            self._subscribed[index],
            "results",
            stage=index,
        )


def _stage_rpc_error(
    index: int, address: str, exc: grpc.aio.AioRpcError, call: str, limit: str
) -> PipeshardError:
    """The error a stage's failed ``call`` raises; a deadline names the call and its ``limit``."""
    code = exc.code().name
    if code == "DEADLINE_EXCEEDED":
        return Unavailable(f"stage {index} at {address} did not answer {call} within {limit}")
    if code == "UNAVAILABLE":
        return Unavailable(f"stage {index} at {address} is unavailable for {call} ({exc.details()})")
    return StageFailed(activation_pb2.StageError(stage_index=index, code=code, message=exc.details() or code))
