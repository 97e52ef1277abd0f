"""Hypothesis fuzzing of the stage's RPC messages against a real stage (stage 1 of the INT4
export, built in this process): every message is answered with a named refusal or served, never
INTERNAL; this process's peak RSS stays within a stated margin of the stage's own; and a normal
step is answered after every example. PIPESHARD_FUZZ_EXAMPLES sets the examples per RPC
(`make test-fuzz` runs the long profile)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeshard.errors import PipeshardError
from pipeshard.ownership import owner_key, owner_metadata
from pipeshard.services.stage.main import StageSettings, build_node
from pipeshard.services.stage.servicer import StageServicer
from pipeshard.services.stage.wire import token_frame
from pipeshard.tensor_codec import Codec, Dtype, encode
from pipeshard.v1 import activation_pb2, kv_pb2, stage_pb2, tensor_pb2

pytestmark = pytest.mark.slow

EXAMPLES = int(os.environ.get("PIPESHARD_FUZZ_EXAMPLES", "25"))
SECRET = "fuzzing-owner-secret-of-the-rpc-fuzz-test"
OWNER = owner_key(SECRET)
HIDDEN = 576
# The ceiling: the stage's peak after its warm-up (its KV pool reserved, so resident, by then),
# plus this margin for a few steps' working memory.
RSS_MARGIN = 192 << 20
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    database=None,
)


def peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


class Context:
    """What the servicer reads of a gRPC context: the caller's metadata."""

    def __init__(self):
        self._metadata = owner_metadata(SECRET)

    def invocation_metadata(self):
        return self._metadata

    async def send_initial_metadata(self, _metadata) -> None:
        return None


class Stage:
    def __init__(self, export: Path):
        node, info = build_node(StageSettings(stage=1, shards=export, max_sessions=8))
        self.node, self.servicer = node, StageServicer(node, info)
        self.loop = asyncio.new_event_loop()
        self.subscription = node.results.subscribe(OWNER, "fuzz")
        self.step = 0
        self.call("OpenSession", stage_pb2.OpenSessionRequest(session_id="ok", capacity=64))
        self.normal_step()
        self.ceiling = peak_rss() + RSS_MARGIN

    def run(self, coroutine):
        return self.loop.run_until_complete(coroutine)

    def call(self, method: str, request):
        """A unary call: its reply, or the domain error the interceptor would map (never INTERNAL)."""
        try:
            return self.run(getattr(self.servicer, method)(request, Context()))
        except PipeshardError as exc:
            assert exc.code != "INTERNAL", f"{method}: {exc}"
            return exc

    def forward(self, frame: activation_pb2.ActivationFrame) -> None:
        error = self.run(self.node.handle(frame))
        assert error is None or error.code != "INTERNAL", error.message
        self.drain()

    def drain(self) -> list:
        out = []
        while True:
            try:
                out.append(self.subscription._queue.get_nowait())
            except asyncio.QueueEmpty:
                return out

    def normal_step(self) -> None:
        """One step of a fresh session, answered (then released)."""
        session = f"normal-{self.step}"
        self.call("OpenSession", stage_pb2.OpenSessionRequest(session_id=session, capacity=16))
        frame = token_frame(session, self.step, [0], 0, True)
        self.step += 1
        frame.owner = OWNER
        hidden = np.full((1, 1, HIDDEN), 0.01, np.float32)
        frame.tensors[0].CopyFrom(tensor_pb2.NamedTensor(name="hidden_states", tensor=encode(hidden)))
        assert self.run(self.node.handle(frame)) is None
        (results,) = self.drain()
        assert not results[0].HasField("error"), results[0].error.message
        self.call("ReleaseSession", stage_pb2.ReleaseSessionRequest(session_id=session))

    def check(self) -> None:
        self.normal_step()
        peak = peak_rss()
        assert peak <= self.ceiling, f"peak RSS {peak >> 20} MiB, over the {self.ceiling >> 20} MiB ceiling"


@pytest.fixture(scope="module")
def stage(smollm2_export):
    return Stage(smollm2_export(2, "int4"))


dims = st.lists(st.one_of(st.integers(0, 8), st.integers(0, 1 << 40)), min_size=0, max_size=4)
tensors = st.builds(
    tensor_pb2.Tensor,
    dtype=st.sampled_from(list(Dtype.values())),
    shape=dims,
    data=st.binary(max_size=256),
    codec=st.sampled_from(list(Codec.values())),
    raw_size=st.integers(0, 1 << 40),
)
ids = st.text(max_size=8) | st.just("ok")
rows = st.builds(
    activation_pb2.PlanRow,
    session_id=ids,
    tokens=st.integers(-2, 6),
    kind=st.integers(0, 4),
    return_mode=st.integers(0, 5),
    return_last=st.integers(0, 6),
    tree_chains=st.integers(0, 4),
    tree_keep=st.integers(-1, 4),
    tree_parents=st.lists(st.integers(-3, 9), max_size=6),
    tree_kept=st.lists(st.integers(-2, 9), max_size=4),
    draft_heads=st.integers(0, 3),
    prefix_reuse_length=st.integers(0, 1 << 20),
)


@st.composite
def frames(draw):
    tokens = draw(st.integers(1, 6))
    hidden = np.full((1, tokens, HIDDEN), 0.01, np.float32)
    real = encode(
        hidden, draw(st.sampled_from([Codec.CODEC_NONE, Codec.CODEC_ZSTD, Codec.CODEC_QUANTUM_ZSTD]))
    )
    tensor = draw(st.one_of(st.just(real), tensors))
    return activation_pb2.ActivationFrame(
        session_id="ok",
        positions=draw(st.lists(st.integers(-2, 5000), min_size=0, max_size=8)),
        tensors=[
            tensor_pb2.NamedTensor(name=draw(st.sampled_from(["hidden_states", "input_ids"])), tensor=tensor)
        ],
        plan=activation_pb2.PlanFrame(rows=draw(st.lists(rows, min_size=0, max_size=3))),
        owner=draw(st.sampled_from([OWNER, "someone-else"])),
    )


@given(frame=frames())
@FUZZ
def test_fuzzed_forward_frames(stage, frame):
    stage.forward(frame)
    stage.check()


snapshots = st.builds(
    kv_pb2.KvSnapshot,
    stage_index=st.integers(0, 3),
    positions=st.integers(-1, 1 << 30),
    block_tokens=st.integers(-1, 64),
    start_position=st.integers(-1, 1 << 20),
    layer_start=st.integers(0, 31),
    layer_end=st.integers(0, 31),
    states=st.lists(st.builds(tensor_pb2.NamedTensor, name=st.text(max_size=8), tensor=tensors), max_size=4),
    token_ids=st.lists(st.integers(0, 1 << 20), max_size=8),
)


@given(snapshot=snapshots, session=ids)
@FUZZ
def test_fuzzed_kv_restores(stage, snapshot, session):
    stage.call("RestoreKv", stage_pb2.RestoreKvRequest(session_id=session, snapshot=snapshot))
    stage.call(
        "ReleaseSession", stage_pb2.ReleaseSessionRequest(session_id=session)
    ) if session != "ok" else None
    stage.check()


@given(
    parts=st.lists(
        st.builds(
            stage_pb2.RestoreKvStreamRequest,
            session_id=ids,
            snapshot_bytes=st.integers(-1, 1 << 40),
            snapshot_chunk=st.binary(max_size=64),
            next_part=st.booleans(),
        ),
        max_size=6,
    ),
    chunk_bytes=st.integers(-1, 1 << 40),
)
@FUZZ
def test_fuzzed_kv_streams(stage, parts, chunk_bytes):
    async def requests():
        for part in parts:
            yield part

    stage.call("RestoreKvStream", requests())
    capture = stage_pb2.CaptureKvStreamRequest(
        capture=stage_pb2.CaptureKvRequest(session_id="ok"), chunk_bytes=chunk_bytes
    )

    async def chunks():
        return [c async for c in stage.servicer.CaptureKvStream(capture, Context())]

    try:
        stage.run(chunks())
    except PipeshardError as exc:
        assert exc.code != "INTERNAL", str(exc)
    stage.check()


control_ids = st.sampled_from(["mine", "", "x" * 257]) | st.text(max_size=8).filter(lambda i: i != "ok")
control_calls = st.one_of(
    st.tuples(
        st.just("OpenSession"),
        st.builds(
            stage_pb2.OpenSessionRequest,
            session_id=control_ids,
            capacity=st.integers(-(2**31), 2**31 - 1),
            results_link_bandwidth_bytes_per_second=st.floats(allow_nan=True, allow_infinity=True),
            codec=st.sampled_from(["", "none", "zstd", "quantum_zstd", "auto", "bogus"])
            | st.text(max_size=8),
            next_hop=st.none() | st.integers(0, 2**32 - 1) | st.integers(0, 2),
        ),
    ),
    st.tuples(
        st.just("RouteSession"),
        st.builds(
            stage_pb2.RouteSessionRequest,
            session_id=control_ids | st.just("ok"),
            next_hop=st.none() | st.integers(0, 2**32 - 1) | st.integers(0, 2),
            keep_positions=st.none() | st.integers(0, 2**32 - 1) | st.integers(0, 8),
        ),
    ),
    st.tuples(st.just("ResetSession"), st.builds(stage_pb2.ResetSessionRequest, session_id=control_ids)),
    st.tuples(st.just("ReleaseSession"), st.builds(stage_pb2.ReleaseSessionRequest, session_id=control_ids)),
    st.tuples(
        st.just("AbortSession"),
        st.builds(stage_pb2.AbortSessionRequest, session_id=control_ids, reason=st.text(max_size=600)),
    ),
    st.tuples(
        st.just("CaptureKv"),
        st.builds(
            stage_pb2.CaptureKvRequest,
            session_id=control_ids | st.just("ok"),
            token_ids=st.lists(st.integers(-(2**63), 2**63 - 1) | st.integers(0, 50_000), max_size=8),
            keep_in_cache=st.booleans(),
            cache_scope=st.text(max_size=8),
            from_position=st.integers(-(2**63), 2**63 - 1) | st.integers(0, 8),
        ),
    ),
    st.tuples(st.just("GetStageInfo"), st.just(stage_pb2.GetStageInfoRequest())),
    st.tuples(
        st.just("Results"),
        st.builds(
            stage_pb2.ResultsRequest,
            subscriber_id=control_ids.filter(lambda i: i != "fuzz"),
            link_probe=st.booleans(),
        ),
    ),
)


@given(call=control_calls)
@FUZZ
def test_fuzzed_control_calls(stage, call):
    """The session, capture, info and Results calls with drawn fields, under the owner (so they
    reach the code behind the owner check): a named refusal or an answer, never INTERNAL."""
    method, request = call
    if method != "Results":
        stage.call(method, request)
    else:

        async def first_result():
            results = stage.servicer.Results(request, Context())
            try:
                return await asyncio.wait_for(anext(results), 0.05)
            except TimeoutError:
                return None  # a live subscription with nothing to send
            finally:
                await results.aclose()

        try:
            stage.run(first_result())
        except PipeshardError as exc:
            assert exc.code != "INTERNAL", str(exc)
    stage.call("ReleaseSession", stage_pb2.ReleaseSessionRequest(session_id="mine"))
    stage.check()
