"""Random and mutated requests to every RPC of real stage, coordinator and exporter processes.

Messages are drawn from each request type's descriptor (every field, nested messages, repeated
fields, extreme numbers, any text) and then sometimes mutated at the byte level (flipped bytes,
truncation, invalid UTF-8), so both well-formed nonsense and undecodable bytes reach the server.
No call may end INTERNAL or UNKNOWN, no process may exit, and each still serves afterwards.
Generate is also fuzzed field by field on a servable prompt (so the sampling checks, grammars and
the scheduler are reached, not only the first refusal), with every process's peak RSS held under
a ceiling; so are RunBatch's jobs, every stage RPC under an owner secret (so the calls pass the owner
check and reach the session code) and the exporter's RPCs, field by field. PIPESHARD_FUZZ_EXAMPLES
sets their examples (`make test-fuzz` runs the long profile).
"""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeshard.clients.client import PipeshardClient
from pipeshard.ownership import owner_metadata
from pipeshard.v1 import coordinator_pb2, coordinator_pb2_grpc, exporter_pb2, stage_pb2, stage_pb2_grpc
from tests.pipeline.stage_probe import sessions_after_release

pytestmark = pytest.mark.slow

FORBIDDEN = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
EXAMPLES = 40
GENERATE_EXAMPLES = int(os.environ.get("PIPESHARD_FUZZ_EXAMPLES", "15"))
# Each process's peak RSS may grow this much over its peak before the Generate fuzz (a few
# requests' grammars, sessions and steps); an unbounded list or allocation takes far more.
RSS_MARGIN = 192 << 20
_T = FieldDescriptor
_INTS = {
    _T.TYPE_INT32: (-(2**31), 2**31 - 1),
    _T.TYPE_SINT32: (-(2**31), 2**31 - 1),
    _T.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    _T.TYPE_INT64: (-(2**63), 2**63 - 1),
    _T.TYPE_SINT64: (-(2**63), 2**63 - 1),
    _T.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    _T.TYPE_UINT32: (0, 2**32 - 1),
    _T.TYPE_FIXED32: (0, 2**32 - 1),
    _T.TYPE_UINT64: (0, 2**64 - 1),
    _T.TYPE_FIXED64: (0, 2**64 - 1),
}


def _scalar(field: FieldDescriptor) -> st.SearchStrategy:
    if field.type in _INTS:
        lo, hi = _INTS[field.type]
        return st.one_of(st.integers(max(lo, -3), 300), st.sampled_from([lo, hi]), st.integers(lo, hi))
    if field.type == _T.TYPE_BOOL:
        return st.booleans()
    if field.type in (_T.TYPE_FLOAT, _T.TYPE_DOUBLE):
        width = 32 if field.type == _T.TYPE_FLOAT else 64
        return st.floats(width=width, allow_nan=True, allow_infinity=True)
    if field.type == _T.TYPE_ENUM:
        return st.one_of(st.sampled_from([v.number for v in field.enum_type.values]), st.integers(-5, 1000))
    if field.type == _T.TYPE_STRING:
        return st.text(max_size=40)
    if field.type == _T.TYPE_BYTES:
        return st.binary(max_size=64)
    raise AssertionError(f"unhandled field type {field.type}")


def messages(cls: type[Message], depth: int = 0) -> st.SearchStrategy[Message]:
    """Messages of ``cls`` with a random subset of fields set (nested up to depth 3)."""
    fields = [f for f in cls.DESCRIPTOR.fields if f.type != _T.TYPE_GROUP]

    @st.composite
    def build(draw) -> Message:
        message = cls()
        for field in fields:
            if not draw(st.booleans()):
                continue
            nested = field.type == _T.TYPE_MESSAGE
            if nested and (depth >= 3 or field.message_type.GetOptions().map_entry):
                continue
            element = _nested(field, depth) if nested else _scalar(field)
            if field.is_repeated:
                values = draw(st.lists(element, max_size=4))
                container = getattr(message, field.name)
                if nested:
                    for value in values:
                        container.add().CopyFrom(value)
                else:
                    container.extend(values)
            elif nested:
                getattr(message, field.name).CopyFrom(draw(element))
            else:
                setattr(message, field.name, draw(element))
        return message

    return build()


def _nested(field: FieldDescriptor, depth: int) -> st.SearchStrategy[Message]:
    return messages(message_factory.GetMessageClass(field.message_type), depth + 1)


@st.composite
def wire_bytes(draw, cls: type[Message]) -> bytes:
    """A drawn message serialized, then perhaps mutated at the byte level."""
    data = bytearray(draw(messages(cls)).SerializeToString())
    mutation = draw(st.sampled_from(["none", "none", "flip", "truncate", "bad_utf8", "random"]))
    if mutation == "flip" and data:
        for _ in range(draw(st.integers(1, 4))):
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    elif mutation == "truncate" and data:
        data = data[: draw(st.integers(0, len(data) - 1))]
    elif mutation == "bad_utf8" and data:
        data[-1] = 0xFF
    elif mutation == "random":
        data = bytearray(draw(st.binary(max_size=128)))
    return bytes(data)


def _call(
    channel: grpc.Channel, path: str, kind: str, payload: bytes, timeout: float, metadata=None
) -> list[bytes]:
    """Sends raw bytes; reads a few responses of a stream; fails on a forbidden status code.
    Returns the responses read (serialized)."""
    try:
        if kind == "unary":
            return [channel.unary_unary(path)(payload, timeout=timeout, metadata=metadata)]
        if kind == "client_stream":
            return [channel.stream_unary(path)(iter([payload, payload]), timeout=timeout, metadata=metadata)]
        if kind == "server_stream":
            call = channel.unary_stream(path)(payload, timeout=timeout, metadata=metadata)
        else:
            call = channel.stream_stream(path)(iter([payload, payload]), timeout=timeout, metadata=metadata)
        read = []
        for i, response in enumerate(call):
            read.append(response)
            if i >= 8:
                call.cancel()
                break
        return read
    except grpc.RpcError as exc:
        assert exc.code() not in FORBIDDEN, f"{path}: {exc.code().name} {exc.details()}"
        return []


_STAGE_RPCS = [
    ("Forward", "bidi", stage_pb2.ForwardRequest),
    ("Results", "server_stream", stage_pb2.ResultsRequest),
    ("OpenSession", "unary", stage_pb2.OpenSessionRequest),
    ("ResetSession", "unary", stage_pb2.ResetSessionRequest),
    ("ReleaseSession", "unary", stage_pb2.ReleaseSessionRequest),
    ("AbortSession", "unary", stage_pb2.AbortSessionRequest),
    ("CaptureKv", "unary", stage_pb2.CaptureKvRequest),
    ("RestoreKv", "unary", stage_pb2.RestoreKvRequest),
    ("GetStageInfo", "unary", stage_pb2.GetStageInfoRequest),
    ("CaptureKvStream", "server_stream", stage_pb2.CaptureKvStreamRequest),
    ("RestoreKvStream", "client_stream", stage_pb2.RestoreKvStreamRequest),
]
_EXPORTER_RPCS = [
    ("Export", "server_stream", exporter_pb2.ExportRequest),
    ("FetchShard", "server_stream", exporter_pb2.FetchShardRequest),
]


@pytest.fixture(scope="module")
def fuzz_fleet(smollm2_export, fleet_factory):
    shards = smollm2_export(2, "int4")
    # Fuzzed OpenSession calls leave sessions behind: a short idle timeout reaps them.
    return fleet_factory(shards, 2, exporter_port=0, extra_stage_args=["--idle-timeout-s", "5"])


@pytest.mark.parametrize(("method", "kind", "cls"), _STAGE_RPCS, ids=[r[0] for r in _STAGE_RPCS])
def test_fuzz_stage(fuzz_fleet, method, kind, cls):
    with (
        grpc.insecure_channel(fuzz_fleet.stages[0]) as first,
        grpc.insecure_channel(fuzz_fleet.stages[1]) as last,
    ):

        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
        @given(payload=wire_bytes(cls), final=st.booleans())
        def run(payload: bytes, final: bool) -> None:
            # A valid Results subscription stays open until its deadline: keep that short.
            timeout = 0.3 if method == "Results" else 2.0
            _call(last if final else first, f"/pipeshard.v1.StageService/{method}", kind, payload, timeout)

        run()
    _still_serves(fuzz_fleet)


@pytest.mark.parametrize(("method", "kind", "cls"), _EXPORTER_RPCS, ids=[r[0] for r in _EXPORTER_RPCS])
def test_fuzz_exporter(fuzz_fleet, method, kind, cls):
    with grpc.insecure_channel(fuzz_fleet.process("exporter").address) as channel:

        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
        @given(payload=wire_bytes(cls))
        def run(payload: bytes) -> None:
            _call(channel, f"/pipeshard.v1.ExporterService/{method}", kind, payload, 5.0)

        run()
    _still_serves(fuzz_fleet)


@pytest.mark.parametrize(
    ("method", "cls"),
    [("Generate", coordinator_pb2.GenerateRequest), ("RunBatch", coordinator_pb2.RunBatchRequest)],
)
def test_fuzz_coordinator(fuzz_fleet, method, cls):
    with grpc.insecure_channel(fuzz_fleet.coordinator) as channel:

        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
        @given(payload=wire_bytes(cls))
        def run(payload: bytes) -> None:
            _call(channel, f"/pipeshard.v1.CoordinatorService/{method}", "server_stream", payload, 0.5)

        run()
    _still_serves(fuzz_fleet)


def peak_rss_bytes(pid: int) -> int:
    """The process's high-water mark of resident memory (VmHWM): catches a transient allocation."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc status")


@st.composite
def generate_requests(draw) -> coordinator_pb2.GenerateRequest:
    """A servable prompt or chat with drawn fields: sampling parameters, speculation, ids."""
    request = coordinator_pb2.GenerateRequest(params=draw(messages(coordinator_pb2.SamplingParams)))
    if draw(st.booleans()):
        request.prompt = draw(st.sampled_from(["Hi", "Say hi."]) | st.text(min_size=1, max_size=40))
    else:
        for message in draw(st.lists(messages(coordinator_pb2.ChatMessage), min_size=1, max_size=3)):
            request.messages.add().CopyFrom(message)
    # Mostly a few tokens, so examples are served quickly; sometimes the extremes.
    tokens = draw(st.one_of(st.integers(1, 6), st.sampled_from([0, -1, 2**31 - 1])))
    request.params.max_tokens = tokens
    request.speculative = draw(st.sampled_from(["", "none", "ngram", "self", "nowhere", "/etc"]))
    request.k = draw(st.integers(-2, 40))
    request.tree = draw(st.sampled_from(["", "auto", "chain", "2x2", "x" * 17]))
    request.request_id = draw(st.text(max_size=8) | st.just("r" * 300))
    return request


def test_fuzz_generate_fields(fuzz_fleet):
    """Generate with random fields on a servable request: a named refusal or an answer, never
    INTERNAL or UNKNOWN; every process's peak RSS under its peak before + RSS_MARGIN."""
    before = {p.name: peak_rss_bytes(p.popen.pid) for p in fuzz_fleet.processes}
    with grpc.insecure_channel(fuzz_fleet.coordinator) as channel:

        @settings(max_examples=GENERATE_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
        @given(request=generate_requests())
        def run(request: coordinator_pb2.GenerateRequest) -> None:
            payload = request.SerializeToString()
            _call(channel, "/pipeshard.v1.CoordinatorService/Generate", "server_stream", payload, 10.0)

        run()
    _still_serves(fuzz_fleet)
    grown = {p.name: peak_rss_bytes(p.popen.pid) - before[p.name] for p in fuzz_fleet.processes}
    assert all(g <= RSS_MARGIN for g in grown.values()), {n: g >> 20 for n, g in grown.items()}


FIELD_SECRET = "fuzz-fields-owner-secret-0123456789"
# Ids the drawn messages name: a session this owner opened, another owner's, none, and the extremes.
_SESSION_IDS = st.sampled_from(["mine", "theirs", "", "x" * 257]) | st.text(max_size=12)


@st.composite
def owned_messages(draw, cls: type[Message]) -> Message:
    """A drawn ``cls`` whose session ids mostly name a session of the fuzzing owner ("mine"), so the
    calls reach the session code behind the id checks, not only the first refusal."""
    message = draw(messages(cls))
    for holder in (message, getattr(message, "capture", None)):
        if holder is not None and "session_id" in holder.DESCRIPTOR.fields_by_name:
            holder.session_id = draw(_SESSION_IDS)
    return message


@pytest.mark.parametrize(("method", "kind", "cls"), _STAGE_RPCS, ids=[r[0] for r in _STAGE_RPCS])
def test_fuzz_stage_fields_as_an_owner(fuzz_fleet, method, kind, cls):
    """Every stage RPC with drawn fields under an owner secret (the raw fuzz above mostly meets the
    owner check): a named refusal or an answer, never INTERNAL or UNKNOWN, on both stages; each
    stage's peak RSS within RSS_MARGIN of its peak before; a normal request answered after."""
    metadata = owner_metadata(FIELD_SECRET)
    before = {p.name: peak_rss_bytes(p.popen.pid) for p in fuzz_fleet.processes}
    with (
        grpc.insecure_channel(fuzz_fleet.stages[0]) as first,
        grpc.insecure_channel(fuzz_fleet.stages[1]) as last,
    ):
        for channel in (first, last):
            stub = stage_pb2_grpc.StageServiceStub(channel)
            stub.OpenSession(stage_pb2.OpenSessionRequest(session_id="mine", capacity=64), metadata=metadata)

        @settings(max_examples=GENERATE_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
        @given(message=owned_messages(cls), final=st.booleans())
        def run(message: Message, final: bool) -> None:
            timeout = 0.5 if method == "Results" else 5.0
            payload = message.SerializeToString()
            path = f"/pipeshard.v1.StageService/{method}"
            _call(last if final else first, path, kind, payload, timeout, metadata)

        run()
        for channel in (first, last):
            stub = stage_pb2_grpc.StageServiceStub(channel)
            stub.ReleaseSession(stage_pb2.ReleaseSessionRequest(session_id="mine"), metadata=metadata)
    _still_serves(fuzz_fleet)
    grown = {p.name: peak_rss_bytes(p.popen.pid) - before[p.name] for p in fuzz_fleet.processes}
    assert all(g <= RSS_MARGIN for g in grown.values()), {n: g >> 20 for n, g in grown.items()}


@st.composite
def batch_requests(draw) -> coordinator_pb2.RunBatchRequest:
    """A RunBatch job of drawn items (servable Generate requests with drawn fields, drawn ids that
    may repeat, be empty or be too long), micro-batch setting and codec."""
    request = coordinator_pb2.RunBatchRequest(
        micro_batches=draw(st.sampled_from(["", "auto", "off", "1", "2", "0", "-1", "x", "9" * 20])),
        codec=draw(st.sampled_from(["", "none", "zstd", "quantum_zstd", "auto", "bogus"])),
    )
    ids = st.sampled_from(["a", "b", "", "i" * 257]) | st.text(min_size=1, max_size=8)
    for request_ in draw(st.lists(generate_requests(), min_size=0, max_size=3)):
        request.items.add(custom_id=draw(ids)).request.CopyFrom(request_)
    return request


def test_fuzz_run_batch_fields(fuzz_fleet):
    """RunBatch with drawn jobs: the call and every item's outcome a named refusal or an answer,
    never INTERNAL or UNKNOWN; every process's peak RSS under its peak before + RSS_MARGIN; a
    normal request answered after."""
    before = {p.name: peak_rss_bytes(p.popen.pid) for p in fuzz_fleet.processes}
    with grpc.insecure_channel(fuzz_fleet.coordinator) as channel:

        @settings(max_examples=GENERATE_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
        @given(job=batch_requests())
        def run(job: coordinator_pb2.RunBatchRequest) -> None:
            path = "/pipeshard.v1.CoordinatorService/RunBatch"
            for raw in _call(channel, path, "server_stream", job.SerializeToString(), 30.0):
                result = coordinator_pb2.RunBatchResponse.FromString(raw)
                assert result.error.code not in ("INTERNAL", "UNKNOWN"), result.error.message

        run()
    _still_serves(fuzz_fleet)
    grown = {p.name: peak_rss_bytes(p.popen.pid) - before[p.name] for p in fuzz_fleet.processes}
    assert all(g <= RSS_MARGIN for g in grown.values()), {n: g >> 20 for n, g in grown.items()}


def test_a_run_batch_flood_is_refused_by_name_before_it_queues(fuzz_fleet):
    """A job of 50,001 one-byte items (about 400 KB on the wire) and a 300-character custom_id:
    INVALID_ARGUMENT naming `items` / the item's custom_id; the coordinator serves on."""
    stub = coordinator_pb2_grpc.CoordinatorServiceStub(grpc.insecure_channel(fuzz_fleet.coordinator))
    flood = coordinator_pb2.RunBatchRequest()
    for i in range(50_001):
        flood.items.add(custom_id=str(i)).request.prompt = "Hi"
    with pytest.raises(grpc.RpcError) as refused:
        list(stub.RunBatch(flood, timeout=60))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "`items` holds 50001 requests, over the limit of 50000" in refused.value.details()
    long_id = coordinator_pb2.RunBatchRequest()
    long_id.items.add(custom_id="i" * 300).request.prompt = "Hi"
    with pytest.raises(grpc.RpcError) as refused:
        list(stub.RunBatch(long_id, timeout=60))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "`items[0].custom_id` is 300 characters" in refused.value.details()
    _still_serves(fuzz_fleet)


_EXPORT_MODELS = st.sampled_from(["", "nope", "../models", "/etc", "/", ".", "..", "a/../../b"]) | st.text(
    max_size=16
)


@st.composite
def export_requests(draw) -> exporter_pb2.ExportRequest:
    """Export requests naming no model of the models folder (a path, a traversal, a made-up name)
    with drawn other fields: all refused before any export starts."""
    request = draw(messages(exporter_pb2.ExportRequest))
    request.model = draw(_EXPORT_MODELS.filter(lambda name: name != "smollm2-135m-instruct"))
    return request


@st.composite
def fetch_requests(draw) -> exporter_pb2.FetchShardRequest:
    """FetchShard of drawn export names (the real one, traversals, paths) and stage indexes."""
    request = draw(messages(exporter_pb2.FetchShardRequest))
    request.export_name = draw(
        st.sampled_from(["smollm2-135m-instruct-2s-int4", "..", "../..", "/etc", "", "a/../b"])
        | st.text(max_size=16)
    )
    return request


@pytest.mark.parametrize(
    ("method", "strategy"),
    [("Export", export_requests), ("FetchShard", fetch_requests)],
    ids=["Export", "FetchShard"],
)
def test_fuzz_exporter_fields(fuzz_fleet, method, strategy):
    """The exporter's RPCs with drawn fields: named refusals or served files, never INTERNAL or
    UNKNOWN, never a file from outside the export asked for; its peak RSS within RSS_MARGIN."""
    exporter = fuzz_fleet.process("exporter")
    before = peak_rss_bytes(exporter.popen.pid)
    with grpc.insecure_channel(exporter.address) as channel:

        @settings(max_examples=GENERATE_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
        @given(request=strategy())
        def run(request) -> None:
            path = f"/pipeshard.v1.ExporterService/{method}"
            for raw in _call(channel, path, "server_stream", request.SerializeToString(), 10.0):
                if method == "FetchShard":
                    chunk = exporter_pb2.FetchShardResponse.FromString(raw)
                    assert ".." not in Path(chunk.path).parts and not Path(chunk.path).is_absolute()

        run()
    _still_serves(fuzz_fleet)
    assert peak_rss_bytes(exporter.popen.pid) - before <= RSS_MARGIN


def _still_serves(fleet) -> None:
    for proc in fleet.processes:
        assert proc.popen.poll() is None, f"{proc.name} exited with {proc.popen.returncode}"
    assert sessions_after_release(fleet.stages, timeout_s=30) == [0, 0]
    with PipeshardClient(fleet.coordinator, timeout_s=60) as client:
        assert client.generate("Say hi.", max_tokens=4).completion_tokens == 4
