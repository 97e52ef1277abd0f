"""Doors a fleet must not leave open, in real processes: a coordinator or exporter given TLS but
no token or keys refuses to start (TLS would admit every caller), unless told --allow-anonymous;
the gateway serves HTTPS and refuses plain HTTP beyond loopback unless told --allow-plaintext."""

from __future__ import annotations

import os
import ssl
import subprocess
import sys

import httpx2 as httpx
import pytest

from pipeshard.certs_cli import node_names
from pipeshard.services.launcher import spawn
from pipeshard.tls import make_certs

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("certs")
    make_certs(folder, node_names(1, "gateway"))
    return folder


def _run(args: list[str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PIPESHARD_TOKEN", "PIPESHARD_API_KEYS")}
    return subprocess.run(
        [sys.executable, "-m", "pipeshard.cli", *args], env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    "args",
    [
        ["exporter-service", "--port", "0"],
        ["coordinator", "--port", "0", "--stages", "127.0.0.1:9", "--shards", "unused"],
    ],
    ids=["exporter", "coordinator"],
)
def test_tls_without_a_token_is_refused_at_start(certs, args):
    done = _run([*args, "--tls-dir", str(certs)])
    assert done.returncode == 1, done.stdout + done.stderr
    assert "without --token or --api-keys" in done.stderr and "--allow-anonymous" in done.stderr


def test_allow_anonymous_serves_tls_without_a_token(certs, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PIPESHARD_TOKEN", "PIPESHARD_API_KEYS")}
    args = ["exporter-service", "--port", "0", "--tls-dir", str(certs), "--allow-anonymous"]
    proc = spawn("exporter", args, tmp_path, env, 120)
    try:
        assert "serving_without_token" in proc.log.read_text()
    finally:
        proc.popen.terminate()
        proc.popen.wait(15)


def test_the_gateway_refuses_plain_http_beyond_loopback():
    done = _run(["serve-openai", "--host", "0.0.0.0", "--port", "0", "--coordinator", "127.0.0.1:9"])
    assert done.returncode == 1, done.stdout + done.stderr
    assert "refusing to serve plain HTTP on 0.0.0.0" in done.stderr and "--allow-plaintext" in done.stderr


def test_the_gateway_serves_https(certs, tmp_path):
    args = ["serve-openai", "--port", "0", "--coordinator", "127.0.0.1:9"]
    args += ["--tls-cert", str(certs / "gateway.pem"), "--tls-key", str(certs / "gateway.key")]
    proc = spawn("gateway", args, tmp_path, dict(os.environ), 120)
    try:
        reply = httpx.get(
            f"https://{proc.address}/v1/models",
            verify=ssl.create_default_context(cafile=str(certs / "ca.pem")),
            timeout=30,
        )
        assert reply.status_code == 200 and reply.json()["object"] == "list"
        with pytest.raises(httpx.HTTPError):  # plain HTTP is not spoken there
            httpx.get(f"http://{proc.address}/v1/models", timeout=30)
    finally:
        proc.popen.terminate()
        proc.popen.wait(15)
