"""The Node.js client (clients/node) against a real 2-stage fleet: same tokens as the Python client."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from pipeshard.clients.client import PipeshardClient

pytestmark = pytest.mark.slow

NODE_DIR = Path(__file__).resolve().parents[2] / "clients" / "node"
PROMPT = "What is the capital of France?"
KEYS = {"text", "token_ids", "finish_reason", "prompt_tokens", "completion_tokens", "ttft_ms", "tok_s"}


@pytest.fixture(scope="module")
def node() -> str:
    """The node binary, with clients/node's dependencies installed (npm ci from the lock file)."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("node and npm are needed for the Node.js client")
    if not (NODE_DIR / "node_modules").is_dir():
        cmd = ["ci"] if (NODE_DIR / "package-lock.json").exists() else ["install"]
        subprocess.run([npm, *cmd, "--no-audit", "--no-fund"], cwd=NODE_DIR, check=True, timeout=300)
    return node


@pytest.fixture(scope="module")
def fleet(default_fleet):
    return default_fleet


def _generate(node: str, coordinator: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [node, "generate.js", "--coordinator", coordinator, *args],
        cwd=NODE_DIR,
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_node_client_streams_the_same_tokens_as_the_python_client(node, fleet):
    proc = _generate(node, fleet.coordinator, "--json", "--max-tokens", "24", PROMPT)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert set(result) == KEYS
    assert "Paris" in result["text"]
    assert result["finish_reason"] == "stop"
    assert result["token_ids"]
    assert result["completion_tokens"] == len(result["token_ids"])
    assert result["prompt_tokens"] > 0 and result["ttft_ms"] > 0
    with PipeshardClient(fleet.coordinator, timeout_s=120) as client:
        expected = client.generate(PROMPT, max_tokens=24)
    assert result["token_ids"] == expected.token_ids
    assert result["text"] == expected.text


def test_node_client_streams_text_without_json(node, fleet):
    proc = _generate(node, fleet.coordinator, "--max-tokens", "24", PROMPT)
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def test_node_client_exits_non_zero_on_a_bad_request(node, fleet):
    proc = _generate(node, fleet.coordinator, "--json", "--max-tokens", "0", PROMPT)
    assert proc.returncode != 0
    assert proc.stdout == ""
    assert "INVALID_ARGUMENT" in proc.stderr
    assert "max_tokens" in proc.stderr
