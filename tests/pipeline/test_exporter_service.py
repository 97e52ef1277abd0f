"""ExporterService in a real process: export over gRPC with progress, bad requests, shard pulls."""

from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import grpc
import pytest

from pipeshard.errors import FailedPrecondition
from pipeshard.services.launcher import spawn
from pipeshard.shard.manifest import file_sha256, load_manifest, verify_shard
from pipeshard.shard.pull import pull_shard
from pipeshard.v1 import exporter_pb2, exporter_pb2_grpc, stage_pb2, stage_pb2_grpc
from tests.exporter.tiny_models import build_tiny

# The fleet token of the TLS exporters below: an exporter over TLS refuses to start without one.
TOKEN = "exporter-test-token"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def int4_export(smollm2_export):
    return smollm2_export(2, "int4")


@pytest.fixture(scope="module")
def models_dir(smollm2_dir, tmp_path_factory):
    """The exporter's models folder: the default model (linked) and what a test builds there."""
    root = tmp_path_factory.mktemp("models")
    (root / smollm2_dir.name).symlink_to(smollm2_dir.resolve())
    return root


@pytest.fixture(scope="module")
def exporter(int4_export, models_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("exporter")
    proc = spawn(
        "exporter",
        [
            "exporter-service",
            "--shards-dir",
            str(int4_export.parent),
            "--models-dir",
            str(models_dir),
            "--port",
            "0",
        ],
        run_dir,
        dict(os.environ),
        120,
    )
    yield proc
    proc.popen.terminate()
    proc.popen.wait(15)


@pytest.fixture(scope="module")
def stub(exporter):
    with grpc.insecure_channel(exporter.address) as channel:
        yield exporter_pb2_grpc.ExporterServiceStub(channel)


@pytest.mark.parametrize(
    ("request_fields", "field"),
    [
        ({"model": "", "stages": 2}, "`model`"),
        ({"model": "/nonexistent/model", "stages": 2}, "`model`"),
        ({"model": "../smollm2-135m-instruct", "stages": 2}, "`model`"),
        ({"model": "nonexistent-model", "stages": 2}, "`model`"),
        ({"model": "smollm2-135m-instruct", "stages": 31}, "`stages`"),
        ({"model": "smollm2-135m-instruct", "split": [10, 10]}, "`split`"),
        (
            {"model": "smollm2-135m-instruct", "stages": 1, "weights": "int4", "group_size": 100},
            "`group_size`",
        ),
        ({"model": "smollm2-135m-instruct", "stages": 1, "weights": "int3"}, "`weights`"),
        ({"model": "smollm2-135m-instruct", "stages": 1, "out": "../escape"}, "`out`"),
    ],
)
def test_bad_export_requests_name_the_field(stub, smollm2_dir, request_fields, field):
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Export(exporter_pb2.ExportRequest(**request_fields), timeout=60))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert field in info.value.details()


def test_a_model_outside_the_models_folder_is_refused_by_name(stub, smollm2_dir):
    for model in (str(smollm2_dir.resolve()), f"{smollm2_dir.name}/../{smollm2_dir.name}"):
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Export(exporter_pb2.ExportRequest(model=model, stages=1), timeout=60))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "`model`" in info.value.details() and "no path" in info.value.details()


def test_export_streams_progress_then_manifest(stub, models_dir):
    import json

    model_dir = models_dir / "tiny-llama"
    build_tiny("llama", model_dir)
    events = list(
        stub.Export(
            exporter_pb2.ExportRequest(
                model=model_dir.name, stages=2, weights="fp32", out="tiny-service-test", force=True
            ),
            timeout=300,
        )
    )
    phases = {(e.progress.stage_index, e.progress.phase) for e in events if e.HasField("progress")}
    assert {(0, "convert"), (1, "convert"), (0, "save"), (1, "save")} <= phases
    assert events[-1].HasField("done")
    manifest = json.loads(events[-1].done.manifest_json)
    assert manifest["num_stages"] == 2 and manifest["split"] == [2, 2]
    shutil.rmtree(events[-1].done.out_dir)


def test_pulled_shard_is_verified_and_served(exporter, int4_export, tmp_path):
    target = tmp_path / int4_export.name
    pull_shard(exporter.address, target, 1)
    verify_shard(target, 1)
    for rel in ("manifest.json", "stage_1/openvino_model.bin"):
        assert (target / rel).read_bytes() == (int4_export / rel).read_bytes()
    assert not (target / "stage_0").exists()
    empty = tmp_path / "empty" / int4_export.name
    stage = spawn(
        "stage1",
        ["stage", "--stage", "1", "--shards", str(empty), "--port", "0", "--exporter", exporter.address],
        tmp_path,
        dict(os.environ),
        180,
    )
    try:
        with grpc.insecure_channel(stage.address) as channel:
            info = stage_pb2_grpc.StageServiceStub(channel).GetStageInfo(
                stage_pb2.GetStageInfoRequest(), timeout=10
            )
        assert info.stage_index == 1 and info.layer_end == 30
        verify_shard(empty, 1)
    finally:
        stage.popen.terminate()
        stage.popen.wait(15)


def test_damaged_source_file_fails_the_pull(exporter, int4_export, tmp_path_factory):
    source = tmp_path_factory.mktemp("damaged") / int4_export.name
    shutil.copytree(int4_export, source)
    with (source / "stage_0" / "openvino_model.bin").open("r+b") as f:
        f.seek(100)
        f.write(b"\x00\x01\x02\x03")
    proc = spawn(
        "exporter-damaged",
        ["exporter-service", "--shards-dir", str(source.parent), "--port", "0"],
        source.parent,
        dict(os.environ),
        120,
    )
    try:
        with pytest.raises(FailedPrecondition, match="sha256"):
            pull_shard(proc.address, tmp_path_factory.mktemp("dest") / int4_export.name, 0)
        # Served with the manifest's checksum, not one hashed again per pull (a read of the whole
        # shard per call): the damaged file's own hash is never what the puller is told.
        rel = "stage_0/openvino_model.bin"
        with grpc.insecure_channel(proc.address) as channel:
            request = exporter_pb2.FetchShardRequest(export_name=int4_export.name, stage_index=0)
            chunks = exporter_pb2_grpc.ExporterServiceStub(channel).FetchShard(request, timeout=60)
            served = next(c.file_sha256 for c in chunks if c.path == rel)
        assert served == load_manifest(source).files[rel].sha256 != file_sha256(source / rel)
    finally:
        proc.popen.terminate()
        proc.popen.wait(15)


def test_a_forced_export_never_replaces_what_stages_pulled(exporter, stub, int4_export, tmp_path):
    pull_shard(exporter.address, tmp_path / int4_export.name, 1)
    request = exporter_pb2.ExportRequest(
        model="smollm2-135m-instruct", stages=2, weights="int4", out=int4_export.name, force=True
    )
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Export(request, timeout=60))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "pulled" in info.value.details()


def test_fetch_shard_serves_a_few_pulls_at_a_time(exporter, int4_export):
    """MAX_CONCURRENT_FETCHES pulls that stop reading hold the exporter's pull slots (a 57 MB shard
    does not fit gRPC's buffers); one more waits, unserved, until one of them goes."""
    from pipeshard.exporter.service import MAX_CONCURRENT_FETCHES

    request = exporter_pb2.FetchShardRequest(export_name=int4_export.name, stage_index=0)
    with grpc.insecure_channel(exporter.address) as channel:
        stub = exporter_pb2_grpc.ExporterServiceStub(channel)
        held = [stub.FetchShard(request, timeout=120) for _ in range(MAX_CONCURRENT_FETCHES)]
        for call in held:
            next(call)  # in its slot; then never read again
        extra = stub.FetchShard(request, timeout=120)
        first = ThreadPoolExecutor(1).submit(next, extra)
        with pytest.raises(FutureTimeout):
            first.result(timeout=3)  # a wait, not a speed: it may not be served while the slots are held
        held[0].cancel()
        assert first.result(timeout=60).path  # the freed slot serves it
        for call in [*held[1:], extra]:
            call.cancel()


def test_root_files_pull_brings_the_manifest_and_tokenizer_only(exporter, int4_export, tmp_path):
    from pipeshard.shard.pull import pull_root_files

    target = tmp_path / int4_export.name
    pull_root_files(exporter.address, target)
    expected = load_manifest(int4_export).root_files()
    assert "tokenizer.json" in expected
    pulled = sorted(str(p.relative_to(target)) for p in target.rglob("*") if p.is_file())
    assert pulled == sorted(expected)
    for rel in expected:
        assert (target / rel).read_bytes() == (int4_export / rel).read_bytes()
    assert not any(target.glob("stage_*"))


def test_coordinator_pulls_its_export_files_and_generates_like_the_in_process_ring(
    exporter, int4_export, tmp_path, greedy_in_process
):
    from pipeshard.clients.client import PipeshardClient
    from pipeshard.shard.prompting import Prompter

    env = dict(os.environ)
    stage1 = spawn(
        "stage1", ["stage", "--stage", "1", "--shards", str(int4_export), "--port", "0"], tmp_path, env, 300
    )
    stage0 = spawn(
        "stage0",
        ["stage", "--stage", "0", "--shards", str(int4_export), "--port", "0", "--next-hop", stage1.address],
        tmp_path,
        env,
        300,
    )
    empty = tmp_path / "coordinator-host" / int4_export.name
    args = ["coordinator", "--shards", str(empty), "--exporter", exporter.address, "--port", "0"]
    coordinator = spawn(
        "coordinator", [*args, "--stages", f"{stage0.address},{stage1.address}"], tmp_path, env, 300
    )
    try:
        assert (empty / "manifest.json").is_file() and not any(empty.glob("stage_*"))
        with PipeshardClient(coordinator.address, timeout_s=120) as client:
            remote = client.generate("What is the capital of France?", max_tokens=16, ignore_eos=True)
        ids = Prompter.from_dir(int4_export).encode("", [("user", "What is the capital of France?")])
        assert remote.token_ids == greedy_in_process(int4_export, [ids], 16)[0]
    finally:
        for proc in (coordinator, stage0, stage1):
            proc.popen.terminate()
            proc.popen.wait(15)


def test_a_stage_index_past_the_exports_stages_is_refused_naming_the_range(exporter, int4_export, tmp_path):
    from pipeshard.errors import InvalidArgument

    with pytest.raises(InvalidArgument) as info:
        pull_shard(exporter.address, tmp_path / int4_export.name, 5)
    assert "[0, 2)" in str(info.value) and exporter.address in str(info.value)


def test_an_exporter_certificate_for_another_host_is_refused_naming_the_fix(int4_export, tmp_path):
    from pipeshard.errors import Unavailable
    from pipeshard.tls import HostCert, TlsConfig, make_host_bundles

    certs = [HostCert("exporter", "exporter", "10.99.0.1"), HostCert("stage0", "stage", "127.0.0.1")]
    bundles = make_host_bundles(tmp_path / "certs", certs)
    args = ["exporter-service", "--shards-dir", str(int4_export.parent), "--port", "0", "--token", TOKEN]
    proc = spawn(
        "exporter-tls",
        [*args, "--tls-dir", str(bundles["10.99.0.1"])],
        tmp_path,
        dict(os.environ),
        120,
    )
    try:
        with pytest.raises(Unavailable) as info:
            stage_tls = TlsConfig.from_dir(bundles["127.0.0.1"], "stage0")
            pull_shard(
                proc.address, tmp_path / int4_export.name, 0, tls=stage_tls, token=TOKEN, connect_timeout_s=10
            )
        assert "certificate is not made for 127.0.0.1" in str(info.value)
    finally:
        proc.popen.terminate()
        proc.popen.wait(15)


def test_a_stage_certificate_cannot_act_as_the_exporter(int4_export, tmp_path):
    from pipeshard.errors import PermissionDenied
    from pipeshard.revocation import revoke
    from pipeshard.shard.pull import pull_root_files
    from pipeshard.tls import HostCert, TlsConfig, make_host_bundles

    roles = [("stage0", "stage"), ("exporter", "exporter"), ("coordinator", "coordinator")]
    (bundle,) = make_host_bundles(
        tmp_path / "certs", [HostCert(n, r, "127.0.0.1") for n, r in roles]
    ).values()
    coordinator = TlsConfig.from_dir(bundle, "coordinator")
    base = [
        "exporter-service",
        "--shards-dir",
        str(int4_export.parent),
        "--port",
        "0",
        "--tls-dir",
        str(bundle),
        "--token",
        TOKEN,
    ]
    for name, expect_refusal in (("stage0", True), ("exporter", False)):
        proc = spawn(f"exporter-as-{name}", [*base, "--tls-name", name], tmp_path, dict(os.environ), 120)
        try:
            target = tmp_path / name / int4_export.name
            if expect_refusal:
                with pytest.raises(
                    PermissionDenied, match="is not an exporter: its certificate is a stage's"
                ):
                    pull_root_files(proc.address, target, tls=coordinator, token=TOKEN, connect_timeout_s=10)
                assert not target.exists()
            else:
                pull_root_files(proc.address, target, tls=coordinator, token=TOKEN, connect_timeout_s=10)
                assert (target / "manifest.json").is_file()
                # `pipeshard certs revoke exporter`: the list beside the puller's certificates
                # makes the same exporter refused (its process still holds the old key).
                revoke(tmp_path / "certs", "exporter")
                with pytest.raises(PermissionDenied, match=r"the exporter at .* certificate is revoked"):
                    pull_root_files(
                        proc.address, tmp_path / "again", tls=coordinator, token=TOKEN, connect_timeout_s=10
                    )
        finally:
            proc.popen.terminate()
            proc.popen.wait(15)
