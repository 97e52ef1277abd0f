"""A stage's device: absent devices are refused naming the present ones, virtual devices are
checked device by device, and the CPU-written compile properties reach other devices only as
their plugins take them (pipeshard/shard/device.py)."""

from __future__ import annotations

from typing import ClassVar

import openvino as ov
import pytest

from pipeshard.errors import InvalidArgument
from pipeshard.shard.device import check_device, device_properties, listed_devices
from pipeshard.shard.runtime import compile_properties

CPU_PROPS = {
    "PERFORMANCE_HINT",
    "INFERENCE_PRECISION_HINT",
    "KV_CACHE_PRECISION",
    "DYNAMIC_QUANTIZATION_GROUP_SIZE",
    "INFERENCE_NUM_THREADS",
    "NUM_STREAMS",
}


class FakeCore:
    """A machine with a CPU, two GPUs and an NPU whose plugin takes only the latency hint."""

    available_devices: ClassVar[list[str]] = ["CPU", "GPU.0", "GPU.1", "NPU"]
    supported: ClassVar[dict[str, set[str]]] = {
        "CPU": CPU_PROPS,
        "GPU": CPU_PROPS - {"INFERENCE_NUM_THREADS"},
        "GPU.0": CPU_PROPS - {"INFERENCE_NUM_THREADS"},
        "GPU.1": CPU_PROPS - {"INFERENCE_NUM_THREADS"},
        "NPU": {"PERFORMANCE_HINT"},
    }

    def get_property(self, device: str, name: str):
        assert name == "SUPPORTED_PROPERTIES"
        return {key: "RW" for key in self.supported[device]}


@pytest.mark.parametrize(
    ("device", "absent"),
    [("GPU.2", "GPU.2"), ("FPGA", "FPGA"), ("AUTO:GPU.1,VPU", "VPU"), ("HETERO:XPU,CPU", "XPU")],
)
def test_an_absent_device_is_refused_naming_it_and_the_present_ones(device, absent):
    with pytest.raises(InvalidArgument) as err:
        check_device(device, FakeCore())
    assert err.value.field == "device"
    assert f"{absent}" in str(err.value) and "available: CPU, GPU.0, GPU.1, NPU" in str(err.value)


def test_the_real_core_refuses_a_device_it_lacks():
    core = ov.Core()
    present = ", ".join(core.available_devices)
    with pytest.raises(InvalidArgument, match=f"GPU.9 is not present on this machine; available: {present}"):
        check_device("GPU.9", core)
    assert check_device("CPU", core) == ["CPU"]


def test_present_devices_and_lists():
    core = FakeCore()
    assert check_device("GPU", core) == ["GPU"]  # any GPU.k
    assert check_device("MULTI:GPU.1(4),CPU(2)", core) == ["GPU.1", "CPU"]
    assert check_device("AUTO", core) == core.available_devices  # picks among all
    assert listed_devices("HETERO:GPU.0, CPU") == ["GPU.0", "CPU"]
    with pytest.raises(InvalidArgument, match="HETERO needs a device list"):
        listed_devices("HETERO")


def test_properties_follow_what_each_plugin_takes():
    core = FakeCore()
    props = compile_properties("f32", num_threads=2)
    assert device_properties("CPU", props, core, "f32") == props  # the CPU gets everything
    on_gpu = device_properties("GPU.1", props, core, "f32")
    assert "INFERENCE_NUM_THREADS" not in on_gpu and on_gpu["KV_CACHE_PRECISION"] == "f32"
    virtual = device_properties("AUTO:GPU.1,CPU", props, core, "f32")
    assert set(virtual) == {"DEVICE_PROPERTIES"}
    assert virtual["DEVICE_PROPERTIES"]["CPU"] == props
    assert virtual["DEVICE_PROPERTIES"]["GPU.1"] == on_gpu
    # the NPU takes no precision property: f32 is refused there, the default precision is not
    with pytest.raises(InvalidArgument, match="INFERENCE_PRECISION_HINT, which NPU does not support") as err:
        device_properties("NPU", props, core, "f32")
    assert err.value.field == "precision"
    tuning = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": 2}
    assert device_properties("NPU", tuning, core, "default") == {"PERFORMANCE_HINT": "LATENCY"}
