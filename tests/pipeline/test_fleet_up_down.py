"""`pipeshard up` / `pipeshard down` (behind `make up` / `make down`) on the default ports."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx2 as httpx
import pytest
import yaml

from pipeshard.clients.client import PipeshardClient

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_up_serves_on_default_ports_and_down_stops_exactly_those(smollm2_export, smollm2_dir, tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "smollm2-135m-instruct-2s-int4").symlink_to(smollm2_export(2, "int4"))
    env = {
        **os.environ,
        "PIPESHARD_SHARDS_DIR": str(shards),
        "PIPESHARD_MODELS_DIR": str(smollm2_dir.parent),
        "PYTHONPATH": str(REPO),
    }
    cli = [sys.executable, "-m", "pipeshard.cli"]
    up = subprocess.run(
        [*cli, "up", "--stages", "2"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    pids = [int(line.split()[0]) for line in (tmp_path / "run" / "pids").read_text().splitlines()]
    try:
        assert up.returncode == 0, up.stderr
        assert "coordinator listening on 127.0.0.1:50051" in up.stdout
        topology = yaml.safe_load((tmp_path / "config" / "topology.yaml").read_text())
        assert [s["port"] for s in topology["stages"]] == [50061, 50062]
        assert topology["exporter"]["port"] == 50071 and topology["coordinator"]["metrics_port"] == 9151
        assert "openai gateway listening on 127.0.0.1:8080" in up.stdout
        assert len(pids) == 5 and all(_alive(p) for p in pids)
        with PipeshardClient("127.0.0.1:50051", timeout_s=60) as client:
            assert "Paris" in client.generate("What is the capital of France?", max_tokens=24).text
        models = httpx.get("http://127.0.0.1:8080/v1/models", timeout=30).json()
        assert [m["id"] for m in models["data"]] == ["smollm2-135m-instruct"]
        for port in (9171, 9161, 9162, 9151, 9180):  # every process serves /metrics
            assert "pipeshard_" in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    finally:
        down = subprocess.run(
            [*cli, "down"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
        )
    assert down.returncode == 0 and "coordinator" in down.stdout
    assert not any(_alive(p) for p in pids)
    assert not (tmp_path / "run" / "pids").exists()
