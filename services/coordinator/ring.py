"""The coordinator's view of the fleet: frames into stage 0, results back from the final stage.

One persistent Forward stream to stage 0 and one Results subscription to the final stage
carry every session's steps; a step is a future keyed by (session id, step id). Control
calls (open, release) go to every stage directly. When a step misses its deadline the ring
asks each stage for its info and names the first that does not answer.
"""

from __future__ import annotations

import asyncio
import uuid

import grpc
import structlog

from pipeshard.errors import DeadlineExceeded, PipeshardError, Unavailable
from pipeshard.services.coordinator.local_stage import LocalEntry, LocalStageStub
from pipeshard.services.transport.channels import open_channel
from pipeshard.services.transport.hop import HopStream
from pipeshard.v1 import activation_pb2, stage_pb2, stage_pb2_grpc

log = structlog.get_logger(__name__)


class StageFailed(PipeshardError):
    """A stage rejected or failed a step; carries that stage's status code."""

    def __init__(self, error: activation_pb2.StageError):
        super().__init__(f"stage {error.stage_index}: {error.message}")
        self.code = error.code or "INTERNAL"
        self.stage_index = error.stage_index


class Ring:
    def __init__(
        self,
        stage_addresses: list[str],
        *,
        step_timeout_s: float = 30.0,
        control_timeout_s: float = 5.0,
        local_stage0: tuple[LocalEntry, LocalStageStub] | None = None,
        hop_delay_s: float = 0.0,
    ):
        """``stage_addresses`` lists every remote stage in order; with ``local_stage0`` they are
        stages 1..N-1 and stage 0 runs in this process. ``hop_delay_s`` delays the frames sent to
        stage 0 (emulated latency; a hosted stage 0 gets it on its own next hop instead)."""
        if not stage_addresses:
            raise ValueError("a ring needs at least one remote stage")
        self.step_timeout_s = step_timeout_s
        self.control_timeout_s = control_timeout_s
        self._channels = [open_channel(a) for a in stage_addresses]
        self._stubs = [stage_pb2_grpc.StageServiceStub(c) for c in self._channels]
        if local_stage0 is None:
            self.addresses = list(stage_addresses)
            self._entry = HopStream(stage_addresses[0], on_error=self._on_entry_error, delay_s=hop_delay_s)
        else:
            self.addresses = ["in-process", *stage_addresses]
            self._entry, stub0 = local_stage0
            self._stubs.insert(0, stub0)
        self._pending: dict[tuple[str, int], asyncio.Future] = {}
        self._subscriber_id = f"coordinator-{uuid.uuid4().hex[:8]}"
        self._results_task: asyncio.Task | None = None
        self._subscribed = asyncio.Event()

    async def start(self) -> None:
        self._entry.start()
        self._results_task = asyncio.create_task(self._read_results(), name="ring-results")

    async def close(self) -> None:
        if self._results_task is not None:
            self._results_task.cancel()
            await asyncio.gather(self._results_task, return_exceptions=True)
        await self._entry.close()
        for channel in self._channels:
            await channel.close()

    @property
    def num_stages(self) -> int:
        return len(self.addresses)

    async def step(self, frame: activation_pb2.ActivationFrame) -> activation_pb2.StepResult:
        """Send one frame around the ring and wait for the final stage's result."""
        key = (frame.session_id, frame.step_id)
        future = asyncio.get_running_loop().create_future()
        self._pending[key] = future
        try:
            await self._entry.send(frame)
            result = await asyncio.wait_for(future, self.step_timeout_s)
        except TimeoutError:
            raise await self._diagnose() from None
        finally:
            self._pending.pop(key, None)
        if result.HasField("error"):
            raise StageFailed(result.error)
        return result

    async def open_session(self, session_id: str) -> int:
        """Open the session on every stage; returns the smallest max_context among them."""
        try:
            responses = await self._on_all("OpenSession", stage_pb2.OpenSessionRequest(session_id=session_id))
        except PipeshardError:
            await self.release_session(session_id)  # all or nothing: no half-open session lingers
            raise
        return min(r.max_context for r in responses)

    async def release_session(self, session_id: str) -> None:
        """Release on every stage, tolerating stages that are down (their reaper frees it later)."""
        await self._on_all(
            "ReleaseSession", stage_pb2.ReleaseSessionRequest(session_id=session_id), tolerate=True
        )

    async def stage_info(self) -> list[stage_pb2.GetStageInfoResponse]:
        return await self._on_all("GetStageInfo", stage_pb2.GetStageInfoRequest())

    async def wait_ready(self, timeout_s: float) -> None:
        """Wait until every stage answers and the result subscription is live."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        for i, stub in enumerate(self._stubs):
            remaining = max(0.1, deadline - asyncio.get_running_loop().time())
            try:
                await stub.GetStageInfo(
                    stage_pb2.GetStageInfoRequest(), timeout=remaining, wait_for_ready=True
                )
            except grpc.aio.AioRpcError as exc:
                raise Unavailable(
                    f"stage {i} at {self.addresses[i]} is not ready: {exc.code().name}"
                ) from None
        await asyncio.wait_for(
            self._subscribed.wait(), max(0.1, deadline - asyncio.get_running_loop().time())
        )

    async def _on_all(self, method: str, request, *, tolerate: bool = False) -> list:
        async def call(i: int):
            try:
                return await getattr(self._stubs[i], method)(request, timeout=self.control_timeout_s)
            except grpc.aio.AioRpcError as exc:
                if tolerate:
                    log.warning("stage_control_failed", stage=i, method=method, code=exc.code().name)
                    return None
                raise _stage_rpc_error(i, self.addresses[i], exc) from None

        return list(await asyncio.gather(*(call(i) for i in range(self.num_stages))))

    async def _diagnose(self) -> PipeshardError:
        for i, stub in enumerate(self._stubs):
            try:
                await stub.GetStageInfo(stage_pb2.GetStageInfoRequest(), timeout=self.control_timeout_s)
            except grpc.aio.AioRpcError as exc:
                return Unavailable(f"stage {i} at {self.addresses[i]} is not answering ({exc.code().name})")
        return DeadlineExceeded(f"no result from the pipeline within {self.step_timeout_s:g} s")

    def _on_entry_error(self, response: stage_pb2.ForwardResponse) -> None:
        # Stage 0's own errors also travel the ring; this only logs them early.
        log.debug("stage0_rejected", session_id=response.session_id, code=response.error.code)

    async def _read_results(self) -> None:
        last = self._stubs[-1]
        while True:
            call = last.Results(
                stage_pb2.ResultsRequest(subscriber_id=self._subscriber_id), wait_for_ready=True
            )
            try:
                await call.wait_for_connection()
                self._subscribed.set()
                async for response in call:
                    future = self._pending.get((response.result.session_id, response.result.step_id))
                    if future is not None and not future.done():
                        future.set_result(response.result)
            except grpc.aio.AioRpcError as exc:
                log.warning("results_stream_broken", code=exc.code().name)
            finally:
                self._subscribed.clear()
                call.cancel()
            await asyncio.sleep(0.2)


def _stage_rpc_error(index: int, address: str, exc: grpc.aio.AioRpcError) -> PipeshardError:
    code = exc.code().name
    if code in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
        return Unavailable(f"stage {index} at {address} is unavailable ({exc.details()})")
    return StageFailed(activation_pb2.StageError(stage_index=index, code=code, message=exc.details() or code))
