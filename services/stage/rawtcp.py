"""The transport baseline: the paper's minimal wire format over raw TCP (benchmarks only).

A frame is a 20-byte header ``<IIIII``: session handle, step id, first position, token count,
payload bytes; then the raw payload (int64 ids for stage 0, float32 hidden states after it).
A result is ``<IIIf`` + padding: session handle, step id, top-1 id, probability. TCP_NODELAY
on every socket. No mask updates, sampling or error frames: this exists to measure how close
the gRPC path (pipeshard.services.transport.hop) comes to a transport with nothing in it.

The first byte a client sends names its role: ``F`` (frames in) or ``R`` (results out; the
final stage sends every result to the newest ``R`` connection).

There is no authentication here (off by default; benchmarks only): raw frames act for the fixed
owner of :data:`RAW_TCP_SECRET`, whose sessions the benchmark opens over gRPC with that secret.
"""

from __future__ import annotations

import asyncio
import socket
import struct

import numpy as np

from pipeshard.errors import FailedPrecondition
from pipeshard.ownership import owner_key
from pipeshard.services.stage.domain import RowKind, StepRow
from pipeshard.services.stage.engine import StageEngine

HEADER = struct.Struct("<IIIII")
RESULT = struct.Struct("<IIIf4x")
RAW_TCP_SECRET = "raw-tcp-baseline-benchmarks-only"


def _nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def pack_frame(session: int, step: int, position: int, payload: np.ndarray) -> bytes:
    n = payload.shape[1]
    data = payload.tobytes()
    return HEADER.pack(session, step, position, n, len(data)) + data


class RawTcpStage:
    """Serves raw frames for one stage, sharing the stage's engine (run inline on the event loop)."""

    def __init__(self, engine: StageEngine, next_hop: tuple[str, int] | None):
        self._engine = engine
        self._next = next_hop
        self._next_writer: asyncio.StreamWriter | None = None
        self._results: asyncio.StreamWriter | None = None

    async def serve(self, host: str, port: int) -> asyncio.AbstractServer:
        return await asyncio.start_server(self._accept, host, port)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        _nodelay(writer)
        role = await reader.readexactly(1)
        if role == b"R":
            self._results = writer
            return
        while True:
            try:
                header = await reader.readexactly(HEADER.size)
            except asyncio.IncompleteReadError:
                return
            session, step, position, n, size = HEADER.unpack(header)
            payload = await reader.readexactly(size)
            x: np.ndarray
            if self._engine.is_first:
                x = np.frombuffer(payload, dtype=np.int64).reshape(1, n).copy()
            else:
                x = np.frombuffer(payload, dtype=np.float32).reshape(1, n, -1).copy()
            row = StepRow(
                session_id=str(session),
                owner=owner_key(RAW_TCP_SECRET),
                step_id=step,
                kind=RowKind.DECODE if n == 1 else RowKind.PREFILL,
                positions=np.arange(position, position + n, dtype=np.int64),
                activations=x,
            )
            (out,) = self._engine.run([row])
            if isinstance(out, Exception):
                raise out
            if self._engine.is_last:
                if self._results is None:
                    raise FailedPrecondition("raw TCP: a frame came before the results connection")
                top1 = out.top1_answer
                self._results.write(
                    RESULT.pack(session, step, int(top1.token_ids[-1]), float(top1.probabilities[-1]))
                )
            else:
                if self._next_writer is None:
                    if self._next is None:
                        raise FailedPrecondition("raw TCP: a stage before the last needs a next hop")
                    _, self._next_writer = await asyncio.open_connection(*self._next)
                    _nodelay(self._next_writer)
                    self._next_writer.write(b"F")
                self._next_writer.write(pack_frame(session, step, position, out.hidden))


class RawTcpRing:
    """The coordinator's side: frames into stage 0, results from the final stage."""

    def __init__(self, first: tuple[str, int], last: tuple[str, int]):
        self._first, self._last = first, last

    async def connect(self) -> None:
        self._fr, self._fw = await asyncio.open_connection(*self._first)
        _nodelay(self._fw)
        self._fw.write(b"F")
        self._rr, self._rw = await asyncio.open_connection(*self._last)
        _nodelay(self._rw)
        self._rw.write(b"R")
        await self._rw.drain()

    async def step(self, session: int, step: int, position: int, ids: list[int]) -> int:
        self._fw.write(pack_frame(session, step, position, np.asarray([ids], dtype=np.int64)))
        _, _, token, _ = RESULT.unpack(await self._rr.readexactly(RESULT.size))
        return token

    async def close(self) -> None:
        for w in (self._fw, self._rw):
            w.close()
