"""CaptureKv / RestoreKv between real stage processes at the default precision: a session captured
on one stage process and restored on a second serving the same layers decodes what the original
decodes, token for token (at `invariant` the snapshot carries the last position's input, which
the restored stage re-feeds before its first one-token row, as the original does); every refusal
answers with its own status code and leaves the target untouched."""

from __future__ import annotations

import queue
import threading
import zlib

import grpc
import pytest

from pipeshard.ownership import owner_key, owner_metadata
from pipeshard.precision import CONFIGURATIONS, DEFAULT_PRECISION
from pipeshard.services.stage.wire import token_frame
from pipeshard.v1 import stage_pb2, stage_pb2_grpc, tensor_pb2

pytestmark = pytest.mark.slow


class Driver:
    """Talks to one final stage as a coordinator would: its own owner secret, a Results
    subscription, one Forward stream; ``step`` sends token ids and returns the greedy token."""

    def __init__(self, address: str, name: str, options=()):
        secret = f"{name}-secret-for-the-kv-migration-tests"
        self.metadata, self.owner = owner_metadata(secret), owner_key(secret)
        self.channel = grpc.insecure_channel(address, options=options)
        self.stub = stage_pb2_grpc.StageServiceStub(self.channel)
        self._results: queue.Queue = queue.Queue()
        self._subscription = self.stub.Results(
            stage_pb2.ResultsRequest(subscriber_id=name), metadata=self.metadata
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._frames: queue.Queue = queue.Queue()
        self._forward = self.stub.Forward(iter(self._frames.get, None), metadata=self.metadata)
        self.step_id = 0

    def _read(self) -> None:
        try:
            for response in self._subscription:
                self._results.put(response.result)
        except grpc.RpcError:
            pass

    def step(self, session_id: str, ids: list[int], start: int) -> int:
        frame = token_frame(session_id, self.step_id, ids, start, True)
        frame.owner = self.owner
        self.step_id += 1
        self._frames.put(stage_pb2.ForwardRequest(frame=frame))
        result = self._results.get(timeout=60)
        assert not result.HasField("error"), result.error.message
        return int(result.top1.token_ids[-1])

    def greedy(self, session_id: str, token: int, start: int, n: int) -> list[int]:
        out = []
        for i in range(n):
            token = self.step(session_id, [token], start + i)
            out.append(token)
        return out

    def call(self, method: str, request):
        return getattr(self.stub, method)(request, timeout=30, metadata=self.metadata)

    def close(self) -> None:
        self._frames.put(None)
        self._subscription.cancel()
        self.channel.close()


@pytest.fixture(scope="module")
def two_stage_processes(smollm2_export, fleet_factory):
    """Two 1-stage INT4 fleets at the default precision: two stage processes serving the same layers."""
    export = smollm2_export(1, "int4")
    return fleet_factory(export, 1).stages[0], fleet_factory(export, 1).stages[0]


def test_captured_session_continues_identically_on_another_process(two_stage_processes, chat_prompt_ids):
    src, dst = Driver(two_stage_processes[0], "src"), Driver(two_stage_processes[1], "dst")
    try:
        prompt = chat_prompt_ids[3]
        src.call("OpenSession", stage_pb2.OpenSessionRequest(session_id="m"))
        first = src.step("m", prompt, 0)
        head = src.greedy("m", first, len(prompt), 8)
        held = [*prompt, first, *head[:-1]]  # what the cache holds: the last token is not fed yet
        captured = src.call("CaptureKv", stage_pb2.CaptureKvRequest(session_id="m", token_ids=held))
        assert captured.positions == len(held) and list(captured.snapshot.token_ids) == held
        info = src.call("GetStageInfo", stage_pb2.GetStageInfoRequest())
        two_token = CONFIGURATIONS[info.configuration].two_token_rows
        assert info.precision == DEFAULT_PRECISION and two_token == (info.configuration != "exact")
        assert captured.snapshot.HasField("last_input") is two_token  # the last step fed it
        if two_token:
            assert list(captured.snapshot.last_input.shape) == [1]  # a token id on the first stage
        restored = dst.call(
            "RestoreKv", stage_pb2.RestoreKvRequest(session_id="m", snapshot=captured.snapshot)
        )
        assert restored.positions == len(held)
        want = src.greedy("m", head[-1], len(held), 32)
        got = dst.greedy("m", head[-1], len(held), 32)  # the session was created by the restore
        assert got == want

        # Refusals, each with its code; the target session keeps running afterwards.
        def refused(method: str, request, driver=dst) -> grpc.StatusCode:
            with pytest.raises(grpc.RpcError) as err:
                driver.call(method, request)
            return err.value.code(), err.value.details()

        def restore(snapshot):
            return stage_pb2.RestoreKvRequest(session_id="m2", snapshot=snapshot)

        wrong_model = stage_pb2.RestoreKvRequest()
        wrong_model.snapshot.CopyFrom(captured.snapshot)
        wrong_model.snapshot.model_fingerprint = "sha256:another-model"
        code, details = refused("RestoreKv", restore(wrong_model.snapshot))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "model" in details
        wrong_range = stage_pb2.RestoreKvRequest()
        wrong_range.snapshot.CopyFrom(captured.snapshot)
        wrong_range.snapshot.layer_start, wrong_range.snapshot.layer_end = 0, 15
        code, details = refused("RestoreKv", restore(wrong_range.snapshot))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "layers [0, 15)" in details
        corrupt = stage_pb2.RestoreKvRequest()
        corrupt.snapshot.CopyFrom(captured.snapshot)
        data = bytearray(corrupt.snapshot.states[5].tensor.data)
        data[100] ^= 0x40
        corrupt.snapshot.states[5].tensor.data = bytes(data)
        code, details = refused("RestoreKv", restore(corrupt.snapshot))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "crc32" in details  # the tensor's own check
        corrupt.snapshot.states[5].tensor.crc32 = zlib.crc32(bytes(data))  # passes it: the blob's checksum
        code, details = refused("RestoreKv", restore(corrupt.snapshot))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "corrupt" in details
        truncated = stage_pb2.RestoreKvRequest()
        truncated.snapshot.CopyFrom(captured.snapshot)
        del truncated.snapshot.states[-1]
        code, _ = refused("RestoreKv", restore(truncated.snapshot))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        code, details = refused("CaptureKv", stage_pb2.CaptureKvRequest(session_id="never-opened"))
        assert code == grpc.StatusCode.NOT_FOUND
        # Another owner's session is as unknown as a missing one; a prefix never kept is missing.
        intruder = Driver(two_stage_processes[1], "intruder")
        try:
            code, _ = refused("CaptureKv", stage_pb2.CaptureKvRequest(session_id="m"), driver=intruder)
        finally:
            intruder.close()
        assert code == grpc.StatusCode.NOT_FOUND
        code, _ = refused(
            "RestoreKv",
            stage_pb2.RestoreKvRequest(session_id="m2", cache_scope="x", cached_token_ids=held, positions=10),
        )
        assert code == grpc.StatusCode.NOT_FOUND
        after = dst.greedy("m", got[-1], len(held) + 32, 4)
        assert after == src.greedy("m", want[-1], len(held) + 32, 4)
        for driver in (src, dst):
            assert driver.call("ReleaseSession", stage_pb2.ReleaseSessionRequest(session_id="m")).released
    finally:
        src.close()
        dst.close()


@pytest.mark.extended
def test_fast_precision_sessions_move_as_verbatim_blocks(
    smollm2_export, fleet_factory, two_stage_processes, chat_prompt_ids
):
    """At `fast` precision paged stages keep a u8 cache: the snapshot carries its blocks byte
    for byte (block_tokens = 32), the restored session decodes what the original decodes, and a
    stage at the default precision (bf16 or f32 pools) refuses the snapshot by its layout."""
    export = smollm2_export(1, "int4")
    a, b = fleet_factory(export, 1, precision="fast"), fleet_factory(export, 1, precision="fast")
    src, dst = Driver(a.stages[0], "src"), Driver(b.stages[0], "dst")
    default = Driver(two_stage_processes[1], "default")
    try:
        prompt = chat_prompt_ids[1]
        src.call("OpenSession", stage_pb2.OpenSessionRequest(session_id="d"))
        first = src.step("d", prompt, 0)
        head = src.greedy("d", first, len(prompt), 8)
        held = [*prompt, first, *head[:-1]]
        snapshot = src.call("CaptureKv", stage_pb2.CaptureKvRequest(session_id="d", token_ids=held)).snapshot
        assert snapshot.block_tokens == 32 and snapshot.positions == len(held)
        assert list(snapshot.states[0].tensor.shape) == [-(-len(held) // 32), 3, 40, 64]
        assert snapshot.states[0].tensor.dtype == tensor_pb2.DTYPE_UINT8
        dst.call("RestoreKv", stage_pb2.RestoreKvRequest(session_id="d", snapshot=snapshot))
        assert dst.greedy("d", head[-1], len(held), 24) == src.greedy("d", head[-1], len(held), 24)
        with pytest.raises(grpc.RpcError) as err:
            default.call("RestoreKv", stage_pb2.RestoreKvRequest(session_id="d", snapshot=snapshot))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "uint8 blocks of 32 positions" in err.value.details()
    finally:
        for driver in (src, dst, default):
            driver.close()


def test_snapshots_beyond_the_message_limit_travel_in_chunks(two_stage_processes, chat_prompt_ids):
    """With the message limit shrunk to 1 MiB (this client's), a unary capture of a ~4 MiB session
    fails while CaptureKvStream / RestoreKvStream move it in chunks: the restored session decodes
    what the original decodes; a stream cut short restores nothing."""
    limit = 1 << 20
    options = [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]
    src = Driver(two_stage_processes[0], "src-chunks", options)
    dst = Driver(two_stage_processes[1], "dst-chunks", options)
    try:
        prompt = chat_prompt_ids[3]
        src.call("OpenSession", stage_pb2.OpenSessionRequest(session_id="big"))
        first = src.step("big", prompt, 0)
        capture = stage_pb2.CaptureKvRequest(session_id="big", token_ids=prompt)
        with pytest.raises(grpc.RpcError) as err:
            src.call("CaptureKv", capture)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        chunks = list(
            src.stub.CaptureKvStream(
                stage_pb2.CaptureKvStreamRequest(capture=capture, chunk_bytes=limit // 2),
                timeout=30,
                metadata=src.metadata,
            )
        )
        total = chunks[0].snapshot_bytes
        assert total > limit and sum(len(c.snapshot_chunk) for c in chunks) == total
        assert len(chunks) == -(-total // (limit // 2)) and chunks[0].positions == len(prompt)
        requests = [
            stage_pb2.RestoreKvStreamRequest(
                session_id="big" if i == 0 else "", snapshot_chunk=c.snapshot_chunk, snapshot_bytes=total
            )
            for i, c in enumerate(chunks)
        ]

        def restore(session_id: str, parts):
            parts = [stage_pb2.RestoreKvStreamRequest(session_id=session_id), *parts]
            parts[0].snapshot_bytes = total
            return dst.stub.RestoreKvStream(iter(parts), timeout=30, metadata=dst.metadata)

        with pytest.raises(grpc.RpcError) as err:
            restore("cut", requests[:-1])
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "announced" in err.value.details()
        with pytest.raises(grpc.RpcError):
            dst.call("CaptureKv", stage_pb2.CaptureKvRequest(session_id="cut"))  # nothing was opened
        restored = dst.stub.RestoreKvStream(iter(requests), timeout=30, metadata=dst.metadata)
        assert restored.positions == len(prompt)
        assert dst.greedy("big", first, len(prompt), 16) == src.greedy("big", first, len(prompt), 16)
    finally:
        src.close()
        dst.close()
