"""A real final stage process driven as a hostile caller would: raw frames and KV messages, the
process's peak RSS read from /proc, and a normal step that must still be answered after each."""

from __future__ import annotations

import os
import queue
import threading
from pathlib import Path

import grpc
import numpy as np

from pipeshard.ownership import owner_key, owner_metadata
from pipeshard.services.launcher import Process, spawn
from pipeshard.services.stage.wire import token_frame
from pipeshard.tensor_codec import encode
from pipeshard.v1 import activation_pb2, stage_pb2, stage_pb2_grpc, tensor_pb2

HIDDEN = 576  # SmolLM2-135M


def start_final_stage(export: Path, run_dir: Path, *extra: str) -> Process:
    """Stage 1 of a 2-stage export as its own process (the final stage: results, no next hop)."""
    args = ["stage", "--stage", "1", "--shards", str(export), "--port", "0", *extra]
    return spawn("stage1", args, run_dir, dict(os.environ), 240)


def peak_rss_bytes(pid: int) -> int:
    """The process's high-water mark of resident memory (VmHWM): catches a transient allocation."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc status")


class HostileDriver:
    """An owner of sessions on one final stage: a Forward stream whose error replies it reads,
    a Results subscription, and unary calls."""

    def __init__(self, address: str, name: str = "hostile"):
        secret = f"{name}-secret-of-the-hostile-input-tests"
        self.metadata, self.owner = owner_metadata(secret), owner_key(secret)
        self.channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 64 << 20)])
        self.stub = stage_pb2_grpc.StageServiceStub(self.channel)
        self.results: queue.Queue = queue.Queue()
        self.errors: queue.Queue = queue.Queue()
        self._subscription = self.stub.Results(
            stage_pb2.ResultsRequest(subscriber_id=name), metadata=self.metadata
        )
        self._frames: queue.Queue = queue.Queue()
        self._forward = self.stub.Forward(iter(self._frames.get, None), metadata=self.metadata)
        threading.Thread(target=self._read_results, daemon=True).start()
        threading.Thread(target=self._read_forward, daemon=True).start()
        self.step_id = 0

    def _read_results(self) -> None:
        try:
            for response in self._subscription:
                self.results.put(response.result)
        except grpc.RpcError:
            pass

    def _read_forward(self) -> None:
        try:
            for response in self._forward:
                if response.HasField("error"):
                    self.errors.put(response.error)
        except grpc.RpcError as exc:
            self.errors.put(exc)

    def call(self, method: str, request, timeout: float = 60):
        return getattr(self.stub, method)(request, timeout=timeout, metadata=self.metadata)

    def frame(self, session_id: str, tokens: int, start: int = 0) -> activation_pb2.ActivationFrame:
        """A well-formed hidden-states frame of ``tokens`` positions for ``session_id``."""
        frame = token_frame(session_id, self.step_id, [0] * tokens, start, True)
        self.step_id += 1
        frame.owner = self.owner
        hidden = np.random.default_rng(tokens).standard_normal((1, tokens, HIDDEN)).astype(np.float32)
        del frame.tensors[:]
        frame.tensors.append(tensor_pb2.NamedTensor(name="hidden_states", tensor=encode(hidden)))
        return frame

    def send(self, frame: activation_pb2.ActivationFrame) -> None:
        self._frames.put(stage_pb2.ForwardRequest(frame=frame))

    def refused(
        self, frame: activation_pb2.ActivationFrame, timeout: float = 60
    ) -> activation_pb2.StageError:
        """Sends a frame the stage must refuse; returns the error it answered with."""
        self.send(frame)
        error = self.errors.get(timeout=timeout)
        assert isinstance(error, activation_pb2.StageError), f"the Forward stream broke: {error}"
        result = self.results.get(timeout=timeout)  # the row's session hears of it too
        assert result.HasField("error")
        return error

    def normal_step(self, session_id: str, start: int = 0, tokens: int = 4) -> int:
        """A normal step, answered: the greedy token of its last position."""
        self.send(self.frame(session_id, tokens, start))
        result = self.results.get(timeout=120)
        assert not result.HasField("error"), result.error.message
        assert result.session_id == session_id
        return int(result.top1.token_ids[-1])

    def close(self) -> None:
        self._frames.put(None)
        self._subscription.cancel()
        self.channel.close()
