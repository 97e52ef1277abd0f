"""Issue #14: Export is an operator action. A real exporter process with a token refuses callers
without it, stops an export whose caller went away (leaving nothing behind), and never replaces
an export that a running fleet holds."""

from __future__ import annotations

import os
import time

import grpc
import pytest

from pipeshard.auth import token_metadata
from pipeshard.services.launcher import spawn
from pipeshard.shard.serving import hold_serving_lock
from pipeshard.v1 import exporter_pb2, exporter_pb2_grpc
from tests.exporter.tiny_models import build_tiny

pytestmark = pytest.mark.slow

TOKEN = "operator-token-for-the-export-tests"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("models") / "tiny-llama"
    build_tiny("llama", model_dir)
    return model_dir


@pytest.fixture(scope="module")
def shards_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("shards")


@pytest.fixture(scope="module")
def stub(shards_dir, tiny_model, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("exporter")
    proc = spawn(
        "exporter",
        [
            "exporter-service",
            "--shards-dir",
            str(shards_dir),
            "--models-dir",
            str(tiny_model.parent),
            "--port",
            "0",
            "--token",
            TOKEN,
        ],
        run_dir,
        dict(os.environ),
        120,
    )
    with grpc.insecure_channel(proc.address) as channel:
        yield exporter_pb2_grpc.ExporterServiceStub(channel)
    proc.popen.terminate()
    proc.popen.wait(15)


def export_request(model, out: str, force: bool = False) -> exporter_pb2.ExportRequest:
    return exporter_pb2.ExportRequest(model=model.name, stages=2, weights="fp32", out=out, force=force)


def test_export_and_fetch_need_the_token(stub, tiny_model):
    for call in (
        lambda md: list(stub.Export(export_request(tiny_model, "x"), timeout=30, metadata=md)),
        lambda md: list(
            stub.FetchShard(exporter_pb2.FetchShardRequest(export_name="x"), timeout=30, metadata=md)
        ),
    ):
        for metadata in ((), token_metadata("wrong-token"), (("authorization", TOKEN),)):
            with pytest.raises(grpc.RpcError) as info:
                call(metadata)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, info.value.details()
    with pytest.raises(grpc.RpcError) as info:  # with the token the call goes through to the service
        list(
            stub.FetchShard(
                exporter_pb2.FetchShardRequest(export_name="x"), timeout=30, metadata=token_metadata(TOKEN)
            )
        )
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_an_export_whose_caller_goes_away_stops_and_leaves_nothing(stub, tiny_model, shards_dir):
    call = stub.Export(export_request(tiny_model, "abandoned"), timeout=300, metadata=token_metadata(TOKEN))
    first = next(call)
    assert first.HasField("progress")
    call.cancel()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and any(
        p.name.startswith(".abandoned.partial") for p in shards_dir.iterdir()
    ):
        time.sleep(0.5)
    left = sorted(p.name for p in shards_dir.iterdir() if "abandoned" in p.name)
    assert left == [], f"a cancelled export left {left}"
    # The exporter is free again: the next export runs to the end.
    events = list(
        stub.Export(export_request(tiny_model, "after"), timeout=300, metadata=token_metadata(TOKEN))
    )
    assert events[-1].HasField("done") and (shards_dir / "after" / "manifest.json").is_file()
    assert not (shards_dir / "abandoned").exists()


def test_a_forced_export_never_replaces_a_served_export(stub, tiny_model, shards_dir):
    served = shards_dir / "served"
    served.mkdir()
    (served / "manifest.json").write_text('{"served": true}')
    lock = hold_serving_lock(served)  # what every stage and coordinator serving it holds
    try:
        with pytest.raises(grpc.RpcError) as info:
            list(
                stub.Export(
                    export_request(tiny_model, "served", force=True),
                    timeout=300,
                    metadata=token_metadata(TOKEN),
                )
            )
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "served by a running fleet" in info.value.details()
        assert (served / "manifest.json").read_text() == '{"served": true}'
    finally:
        lock.close()
    # Once nothing serves it, the operator may replace it.
    events = list(
        stub.Export(
            export_request(tiny_model, "served", force=True), timeout=300, metadata=token_metadata(TOKEN)
        )
    )
    assert events[-1].HasField("done") and '"served": true' not in (served / "manifest.json").read_text()
