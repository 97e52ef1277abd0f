"""``pipeshard stage --device``: the topology names a device per stage, an absent one is refused
before the stage serves, and GetStageInfo reports the device the shard was compiled for."""

from __future__ import annotations

import pytest

from pipeshard.errors import InvalidArgument
from pipeshard.services.stage.main import StageSettings, build_node, resolve
from pipeshard.settings import load_settings
from pipeshard.topology import Topology
from tests.exporter.tiny_models import tiny_export, tiny_model  # noqa: F401  (fixtures)


def test_topology_names_a_device_per_stage(tmp_path):
    path = tmp_path / "topology.yaml"
    topo = Topology.loopback("shards/x", 3, device="GPU.1")
    topo.stages[2].device = "AUTO:NPU,CPU"
    topo.save(path)
    loaded = Topology.load(path)
    assert [s.device for s in loaded.stages] == ["GPU.1", "GPU.1", "AUTO:NPU,CPU"]
    old = path.read_text().replace("  device: GPU.1\n", "")  # a topology written before devices
    path.write_text(old)
    assert [s.device for s in Topology.load(path).stages] == ["CPU", "CPU", "AUTO:NPU,CPU"]
    settings = resolve(load_settings(StageSettings, ["--topology", str(path), "--stage", "2"], env={}))
    assert settings.device == "AUTO:NPU,CPU"
    flagged = ["--topology", str(path), "--stage", "2", "--device", "GPU.0"]
    assert resolve(load_settings(StageSettings, flagged, env={})).device == "GPU.0"
    from_env = load_settings(StageSettings, ["--shards", "x"], env={"PIPESHARD_DEVICE": "NPU"})
    assert from_env.device == "NPU"


@pytest.mark.parametrize("kv", ["paged", "stateful"])
def test_stage_reports_its_device_and_refuses_an_absent_one(tiny_export, kv):  # noqa: F811
    import openvino as ov

    export = tiny_export("llama", 1)
    argv = ["--shards", str(export), "--kv", kv, "--compile-cache-dir", "off", "--prefix-cache-bytes", "0"]
    _, info = build_node(load_settings(StageSettings, argv, env={}))
    assert info.device == "CPU"
    with pytest.raises(InvalidArgument) as err:
        build_node(load_settings(StageSettings, [*argv, "--device", "NPU.7"], env={}))
    assert err.value.field == "device"
    present = ", ".join(ov.Core().available_devices)
    assert f"NPU.7 is not present on this machine; available: {present}" in str(err.value)


@pytest.mark.slow
def test_stage_process_exits_naming_the_absent_device(tiny_export):  # noqa: F811
    import subprocess
    import sys

    import openvino as ov

    argv = [sys.executable, "-m", "pipeshard.cli", "stage", "--shards", str(tiny_export("llama", 1))]
    argv += ["--port", "0", "--device", "NPU.7"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    present = ", ".join(ov.Core().available_devices)
    assert done.returncode == 1
    assert f"stage 0: `device` NPU.7 is not present on this machine; available: {present}" in done.stderr
    assert "Traceback" not in done.stderr
