"""Hostile input against a real final stage process: decompression and allocation bombs, unbounded
restore streams, client-chosen chunk sizes and malformed draft trees are refused by name before
anything is decoded; the stage's peak RSS stays within a margin of its start, and a normal step is
answered after every attack."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import zstandard

from pipeshard.tensor_codec import Codec, Dtype
from pipeshard.v1 import stage_pb2, tensor_pb2
from tests.pipeline.hostile_stage import HIDDEN, HostileDriver, peak_rss_bytes, start_final_stage

pytestmark = pytest.mark.slow

# Each attack, undefended, asks the stage for 0.2 to 2 GiB; a step of the model's own takes a
# few MiB. The margin (measured: at most 46 MiB defended) leaves room for the allocator and the steps.
RSS_MARGIN = 96 << 20


@pytest.fixture(scope="module")
def stage(smollm2_export, tmp_path_factory):
    proc = start_final_stage(smollm2_export(2, "int4"), tmp_path_factory.mktemp("hostile-stage"))
    yield proc
    proc.popen.terminate()
    proc.popen.wait(15)


@pytest.fixture(scope="module")
def driver(stage):
    d = HostileDriver(stage.address)
    d.call("OpenSession", stage_pb2.OpenSessionRequest(session_id="ok", capacity=64))
    d.normal_step("ok")  # warm: the baseline RSS includes one inference
    yield d
    d.close()


@pytest.fixture
def rss_ceiling(stage, driver):
    """The stage's peak RSS after the test stays within RSS_MARGIN of its peak before it, and a
    normal step on a fresh session is answered afterwards."""
    before = peak_rss_bytes(stage.popen.pid)
    yield
    session = f"after-{driver.step_id}"
    driver.call("OpenSession", stage_pb2.OpenSessionRequest(session_id=session, capacity=64))
    driver.normal_step(session)
    driver.call("ReleaseSession", stage_pb2.ReleaseSessionRequest(session_id=session))
    grown = peak_rss_bytes(stage.popen.pid) - before
    assert grown <= RSS_MARGIN, f"the stage's peak RSS grew by {grown >> 20} MiB"


def quantum_bomb(values: int) -> bytes:
    """A valid CODEC_QUANTUM_ZSTD frame of ``values`` floats in about values / 8 bytes: every
    value a normal float with all its mantissa bits below the quantum (nothing kept), so the frame
    is its sign bits and a tiny exponent frame, while an unbounded decoder works on 32 bytes a value."""
    exponents = zstandard.ZstdCompressor().compress(bytes([113]) * values)
    head = np.asarray([-14 + 128, 0, len(exponents)], dtype="<u4").tobytes()
    return head + exponents + bytes((values + 7) // 8)


def bombed(driver: HostileDriver, tokens: int, shape: list[int]):
    frame = driver.frame("ok", tokens)
    values = int(np.prod(shape))
    tensor = tensor_pb2.Tensor(
        dtype=Dtype.DTYPE_FP32,
        shape=shape,
        data=quantum_bomb(values),
        codec=Codec.CODEC_QUANTUM_ZSTD,
        raw_size=values * 4,
    )
    frame.tensors[0].tensor.CopyFrom(tensor)
    return frame


def test_a_quantum_frame_declaring_more_than_the_frame_carries_is_refused_unread(driver, rss_ceiling):
    # 2 MiB on the wire declaring 64 MiB of floats for a 4-position frame.
    error = driver.refused(bombed(driver, 4, [1, 29127, HIDDEN]))
    assert error.code == "INVALID_ARGUMENT" and "hidden_states" in error.message, error.message


def test_a_frame_beyond_max_frame_tokens_is_refused_unread(driver, rss_ceiling):
    tokens = 8193
    error = driver.refused(bombed(driver, tokens, [1, tokens, HIDDEN]))
    assert error.code == "RESOURCE_EXHAUSTED" and "max_frame_tokens" in error.message, error.message


def test_a_quantum_frame_at_the_limit_decodes_in_bounded_memory(driver, rss_ceiling):
    # 4.7 M values: decoded at once, the bit arrays alone took about 0.5 GiB.
    tokens = 8192
    error = driver.refused(bombed(driver, tokens, [1, tokens, HIDDEN]))
    assert error.code in ("INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"), error.message


def test_a_frame_for_no_session_of_its_owner_is_refused_before_decoding(stage, driver, rss_ceiling):
    """The session is checked before any tensor is decoded: a frame naming a session its owner
    does not hold is NOT_FOUND even when its tensor is garbage that decoding would refuse (without
    the check the answer is the decoder's INVALID_ARGUMENT)."""
    frame = bombed(driver, 4, [1, 4, HIDDEN])
    frame.tensors[0].tensor.data = b"not a quantum frame"
    assert driver.refused(frame).code == "INVALID_ARGUMENT"  # a held session: decoded, refused
    for row in frame.plan.rows:
        row.session_id = "nobody-holds-this"
    error = driver.refused(frame)
    assert error.code == "NOT_FOUND" and "nobody-holds-this" in error.message, error.message
    other = HostileDriver(stage.address, name="other-owner")
    try:
        frame.owner = other.owner
        for row in frame.plan.rows:
            row.session_id = "ok"  # the driver's session, not this owner's
        error = other.refused(frame)
        assert error.code == "NOT_FOUND", error.message
    finally:
        other.close()


def test_a_malformed_tree_is_refused_by_name(driver, rss_ceiling):
    frame = driver.frame("ok", 4, 0)
    frame.plan.rows[0].tree_parents[:] = [-1, 7, 0, 1]  # 7: no such token
    error = driver.refused(frame)
    assert error.code == "INVALID_ARGUMENT" and "tree_parents" in error.message, error.message


def _captured(driver: HostileDriver):
    driver.call("OpenSession", stage_pb2.OpenSessionRequest(session_id="src", capacity=64))
    driver.normal_step("src", tokens=16)
    snapshot = driver.call("CaptureKv", stage_pb2.CaptureKvRequest(session_id="src")).snapshot
    driver.call("ReleaseSession", stage_pb2.ReleaseSessionRequest(session_id="src"))
    return snapshot


def _refused(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code(), err.value.details()


def test_kv_states_declaring_huge_shapes_are_refused_before_decompression(driver, rss_ceiling):
    snapshot = _captured(driver)
    shape = list(snapshot.states[0].tensor.shape)
    itemsize = 1 if snapshot.block_tokens else 4  # u8 blocks, or f32 [kv_heads, T, head_dim]
    axis = 0 if snapshot.block_tokens else 1
    shape[axis] = 1
    shape[axis] = (16 << 20) // (int(np.prod(shape)) * itemsize)  # 16 MiB a state, KiB of zstd each
    raw = int(np.prod(shape)) * itemsize
    bomb = zstandard.ZstdCompressor().compress(bytes(raw))
    for named in snapshot.states:
        named.tensor.CopyFrom(
            tensor_pb2.Tensor(
                dtype=named.tensor.dtype, shape=shape, data=bomb, codec=Codec.CODEC_ZSTD, raw_size=raw
            )
        )
    request = stage_pb2.RestoreKvRequest(session_id="bomb", snapshot=snapshot)
    code, details = _refused(lambda: driver.call("RestoreKv", request))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "snapshot.states" in details, details
    request.snapshot.positions = shape[axis] * (snapshot.block_tokens or 1)  # agrees, beyond max_context
    code, details = _refused(lambda: driver.call("RestoreKv", request))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "max_context" in details, details


def test_restore_streams_have_a_part_count_and_a_byte_total(driver, rss_ceiling):
    def parts(count: int, announced: int):
        for i in range(count):
            yield stage_pb2.RestoreKvStreamRequest(
                session_id="flood", snapshot_bytes=announced, snapshot_chunk=b"x", next_part=i > 0
            )

    code, details = _refused(lambda: driver.call("RestoreKvStream", parts(100_000, 1)))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_parts" in details, details
    code, details = _refused(lambda: driver.call("RestoreKvStream", parts(1, (1 << 31) - 1)))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_bytes" in details, details


def test_capture_chunks_have_a_floor_and_a_ceiling(driver):
    capture = stage_pb2.CaptureKvRequest(session_id="ok")
    for chunk_bytes in (1, 1 << 30):
        request = stage_pb2.CaptureKvStreamRequest(capture=capture, chunk_bytes=chunk_bytes)
        code, details = _refused(lambda r=request: list(driver.call("CaptureKvStream", r)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "chunk_bytes" in details, details


def test_ids_and_subscriptions_are_bounded(driver):
    code, details = _refused(
        lambda: driver.call("OpenSession", stage_pb2.OpenSessionRequest(session_id="s" * 10_000))
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "session_id" in details, details
    # The other session calls too (AbortSession logged its id: megabytes a call).
    for method, request in (
        ("ResetSession", stage_pb2.ResetSessionRequest(session_id="s" * 10_000)),
        ("ReleaseSession", stage_pb2.ReleaseSessionRequest(session_id="s" * 10_000)),
        ("AbortSession", stage_pb2.AbortSessionRequest(session_id="s" * 10_000, reason="r")),
    ):
        code, details = _refused(lambda m=method, r=request: driver.call(m, r))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "`session_id` is 10000 characters" in details, (
            details
        )
    streams = [
        driver.stub.Results(stage_pb2.ResultsRequest(subscriber_id=f"sub-{i}"), metadata=driver.metadata)
        for i in range(17)
    ]
    try:
        codes = []
        for stream in streams:
            stream.initial_metadata()  # an admitted stream sends it; a refused one has ended
            codes.append(stream.code() if stream.done() else None)
        # The driver's own subscription and 15 more are admitted; the 17th new one is refused.
        assert codes[:15] == [None] * 15 and grpc.StatusCode.RESOURCE_EXHAUSTED in codes[15:], codes
    finally:
        for stream in streams:
            stream.cancel()
