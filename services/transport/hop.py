"""A persistent Forward stream to the next hop, re-opened whenever it breaks.

Frames go into a queue; one task keeps a stream open (``wait_for_ready`` lets gRPC dial
with backoff until the hop is up, so start order does not matter) and feeds it from the
queue. A frame lost with a broken stream is not resent: the coordinator's step deadline
notices, names the stage and releases the session.

With ``delay_s`` > 0 (``--hop-delay-ms``, the in-process WAN emulation) the queue is a
:class:`DelayQueue`: each frame leaves ``delay_s`` after ``send``, in order, many in flight.

The stream also measures its link (``self.link``, pipeshard/link_model.py): at every connect
it sends an empty probe and a train of ``PROBE_TRAIN`` x ``PROBE_BYTES`` probes, then asks the
next hop to acknowledge frames large enough to time plus one small frame in ``RTT_SAMPLE_EVERY``.
Each acknowledgement's delay since the write is a sample. Emulated ``delay_s`` is spent before
the write, so it is not part of the measured link.

``on_state(up, reason)`` hears the hop come up (the first acknowledgement after a connect: a
call can look connected while no byte crosses, as during a partition) and go down (its stream
broke: a dead next stage, or a stall found by the channel's keepalive, channels.py). The stage
reports each next hop on its own health service (``next_hop_health``) and in GetStageInfo's
``next_hop_states``, so the coordinator names the hop that is down, not the whole next stage.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Coroutine
from typing import Any

import grpc
import structlog

from pipeshard import trace
from pipeshard.link_model import MIN_TIMED_BYTES, LinkEstimate, train_rate
from pipeshard.reach import unreachable_hint
from pipeshard.services.transport.channels import open_channel
from pipeshard.services.transport.delay import DelayQueue
from pipeshard.tls import TlsConfig
from pipeshard.v1 import activation_pb2, stage_pb2, stage_pb2_grpc

log = structlog.get_logger(__name__)

UNREACHABLE_AFTER_S = 20.0  # a hop not connected this long is named in the log, with the fix
PROBE_BYTES = 64 * 1024
PROBE_TRAIN = 5
RTT_SAMPLE_EVERY = 8
# The grpc.health.v1 service name on which a stage reports its next hop's stream (up or broken).
NEXT_HOP_HEALTH = "pipeshard.v1.StageService/next_hop"


def next_hop_health(index: int) -> str:
    """The health service name on which a stage reports its next hop ``index`` (an index into its
    GetStageInfo ``next_hops``); NEXT_HOP_HEALTH alone is the first's, as before per-hop routes."""
    return f"{NEXT_HOP_HEALTH}/{index}"


class HopStream:
    """Sends activation frames to ``address`` over one long-lived bidirectional stream."""

    def __init__(
        self,
        address: str,
        *,
        on_error: Callable[[stage_pb2.ForwardResponse], None] | None = None,
        queue_size: int = 1024,
        delay_s: float = 0.0,
        tls: TlsConfig | None = None,
        channel: grpc.aio.Channel | None = None,
    ):
        """``channel`` shares one the caller owns (it then closes it); else one is opened."""
        self.address = address
        self._on_error = on_error
        self._queue: asyncio.Queue | DelayQueue = (
            DelayQueue(delay_s, queue_size) if delay_s > 0 else asyncio.Queue(maxsize=queue_size)
        )
        self._owns_channel = channel is None
        self._channel = channel or open_channel(address, tls)
        self._stub = stage_pb2_grpc.StageServiceStub(self._channel)
        self._task: asyncio.Task | None = None
        self._watch_task: asyncio.Task | None = None
        self.connected = asyncio.Event()
        self.link = LinkEstimate(address)
        self._ack_ids = itertools.count(1)
        self._acks: dict[int, tuple[int, float, bool]] = {}  # ack id -> (bytes, write time, probe)
        self._train: list[tuple[int, float]] = []  # (bytes, ack time) of the probe train
        self.on_state: Callable[[bool, str], None] = lambda up, reason: None
        self._up = False  # acknowledged since the last connect
        self.reason = "not yet connected"  # why the hop is in its state (GetStageInfo's next_hop_states)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"hop->{self.address}")
            self._watch_task = asyncio.create_task(self._watch(), name=f"hop-watch->{self.address}")

    async def _watch(self) -> None:
        """While the hop stays unreachable, say so every ``UNREACHABLE_AFTER_S`` with why and the
        fix (one call that does not wait for the channel shows gRPC's reason), not a silent wait."""
        while True:
            await asyncio.sleep(UNREACHABLE_AFTER_S)
            if self.connected.is_set():
                continue
            try:
                await self._stub.GetStageInfo(stage_pb2.GetStageInfoRequest(), timeout=5)
            except grpc.aio.AioRpcError as exc:
                hint = unreachable_hint("next hop", self.address, exc.details() or "")
                log.error("next_hop_unreachable", address=self.address, hint=hint)

    async def send(self, frame: activation_pb2.ActivationFrame) -> None:
        trace.mark("hop_send", frame.session_id, frame.step_id)
        self.start()
        await self._queue.put(frame)

    async def close(self) -> None:
        for task in (self._task, self._watch_task):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self._owns_channel:
            await self._channel.close()

    async def _run(self) -> None:
        def on_response(response: stage_pb2.ForwardResponse) -> None:
            if response.ack_id:
                self._on_ack(response.ack_id)
            if response.HasField("error") and self._on_error is not None:
                self._on_error(response)

        await keep_open(
            lambda: self._stub.Forward(wait_for_ready=True),
            on_response,
            self.connected,
            "hop",
            write=self._write,
            on_state=lambda up, reason: None if up else self._report(False, reason),
            address=self.address,
        )

    async def _write(self, call) -> None:
        """Feeds the queue into one call. Owned by ``keep_open`` and cancelled when the call ends, so
        a broken call never takes a frame meant for the next one (grpc's own request-iterator
        poller outlives a call that ended by itself and would)."""
        self._acks.clear()
        await self._probe(call)
        for sent in itertools.count():
            frame = await self._queue.get()
            request = stage_pb2.ForwardRequest(frame=frame)
            if sent % RTT_SAMPLE_EVERY == 0 or frame.ByteSize() >= MIN_TIMED_BYTES:
                await self._timed_write(call, request, probe=False)
            else:
                await call.write(request)

    async def _probe(self, call) -> None:
        """An empty probe (RTT) then a train of ``PROBE_TRAIN`` x ``PROBE_BYTES`` (bandwidth from
        the spacing of its acks: a token-bucket link lets its first burst through at line rate,
        so one message alone would overstate it)."""
        self._train = []
        await self._timed_write(call, stage_pb2.ForwardRequest(), probe=True)
        for _ in range(PROBE_TRAIN):
            await self._timed_write(call, stage_pb2.ForwardRequest(padding=bytes(PROBE_BYTES)), probe=True)

    async def _timed_write(self, call, request: stage_pb2.ForwardRequest, *, probe: bool) -> None:
        request.ack_id = next(self._ack_ids)
        self._acks[request.ack_id] = (request.ByteSize(), time.perf_counter(), probe)
        await call.write(request)

    @property
    def up(self) -> bool:
        """Whether frames reach the hop now: acknowledged since its stream last connected."""
        return self._up

    def _report(self, up: bool, reason: str) -> None:
        if up != self._up:
            self._up, self.reason = up, reason
            self.on_state(up, reason)

    def _on_ack(self, ack_id: int) -> None:
        self._report(True, "acknowledged")
        sent = self._acks.pop(ack_id, None)
        if sent is None:
            return
        nbytes, written, probe = sent
        now = time.perf_counter()
        if not probe or nbytes < PROBE_BYTES:
            self.link.observe(nbytes, now - written)
            return
        self._train.append((nbytes, now))
        if len(self._train) == PROBE_TRAIN:
            self.link.observe_rate(train_rate(self._train))
            log.info(
                "link_measured",
                address=self.address,
                rtt_s=self.link.rtt_s,
                bandwidth_bytes_s=self.link.bandwidth_bytes_s,
            )


async def keep_open(
    open_call: Callable[[], Any],
    on_message: Callable[[Any], None],
    connected: asyncio.Event,
    name: str,
    *,
    write: Callable[[Any], Coroutine[Any, Any, None]] | None = None,
    on_state: Callable[[bool, str], None] | None = None,
    **log_fields: Any,
) -> None:
    """Hold one persistent streaming call open for good: (re)open it, mark ``connected`` while it
    is up, hand every message to ``on_message``, reopen 0.2 s after it breaks (until cancelled).
    ``write(call)``, for a bidirectional call, runs as a task for the life of each call;
    ``on_state(up, reason)`` hears each connect and each break of a connected call."""
    while True:
        call = open_call()
        writer: asyncio.Task | None = None
        reason = "stream ended"
        try:
            await call.wait_for_connection()
            connected.set()
            log.info(f"{name}_connected", **log_fields)
            if on_state is not None:
                on_state(True, "connected")
            if write is not None:
                writer = asyncio.create_task(write(call), name=f"{name}-write")
            async for message in call:
                on_message(message)
        except grpc.aio.AioRpcError as exc:
            reason = f"{exc.code().name}: {exc.details()}"
            log.warning(f"{name}_stream_broken", code=exc.code().name, details=exc.details(), **log_fields)
        finally:
            if connected.is_set() and on_state is not None:
                on_state(False, reason)
            connected.clear()
            if writer is not None:
                writer.cancel()
                await asyncio.gather(writer, return_exceptions=True)
            call.cancel()
        await asyncio.sleep(0.2)
