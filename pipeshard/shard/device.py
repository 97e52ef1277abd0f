"""Which OpenVINO device a stage compiles for, and the properties that device is given.

A device string is one of OpenVINO's: ``CPU``, ``GPU``, ``GPU.1``, ``NPU``, or a virtual device
over a list (``AUTO:GPU,CPU``, ``HETERO:GPU,CPU``, ``MULTI:GPU,CPU``, ``BATCH:GPU``). A device
that is not on this machine is refused before anything compiles, naming it and the devices that
are there (``Core().available_devices``); a virtual device is checked device by device.

Properties (``compile_properties`` in runtime.py) are written for the CPU plugin. They are given
to the device that runs the stage according to what its plugin lists in SUPPORTED_PROPERTIES:
a precision property (INFERENCE_PRECISION_HINT, KV_CACHE_PRECISION,
DYNAMIC_QUANTIZATION_GROUP_SIZE) is what ``--precision`` promises, so a device that does not
take it is refused; a tuning property (PERFORMANCE_HINT, INFERENCE_NUM_THREADS, NUM_STREAMS) the
plugin does not take is left out, with a warning. For a virtual device every listed device gets
its own filtered set through DEVICE_PROPERTIES.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Protocol

import structlog

from pipeshard.errors import InvalidArgument

log = structlog.get_logger(__name__)

DEFAULT_DEVICE = "CPU"
VIRTUAL = ("AUTO", "HETERO", "MULTI", "BATCH")
PRECISION_KEYS = (
    "INFERENCE_PRECISION_HINT",
    "KV_CACHE_PRECISION",
    "KEY_CACHE_PRECISION",
    "VALUE_CACHE_PRECISION",
    "DYNAMIC_QUANTIZATION_GROUP_SIZE",
)
_PRIORITY = re.compile(r"\(\d+\)$")  # MULTI:GPU(4),CPU(2): requests per device


class DeviceCore(Protocol):
    """The part of ``openvino.Core`` this module reads (tests pass a fake)."""

    available_devices: list[str]

    def get_property(self, device: str, name: str) -> Any: ...


def listed_devices(device: str) -> list[str]:
    """The physical devices a device string names: itself, or a virtual device's list ([] for a
    bare ``AUTO``, which picks among all)."""
    if not isinstance(device, str) or not device.strip():
        raise InvalidArgument(
            "device", f"must be an OpenVINO device such as CPU, GPU.1 or AUTO:GPU,CPU, got {device!r}"
        )
    head, _, rest = device.partition(":")
    if head not in VIRTUAL:
        return [device]
    names = [_PRIORITY.sub("", d.strip()) for d in rest.split(",") if d.strip()]
    if head != "AUTO" and not names:
        raise InvalidArgument("device", f"{head} needs a device list ({head}:GPU,CPU), got {device!r}")
    return names


def _present(name: str, available: list[str]) -> bool:
    """``GPU`` is present when ``GPU`` or any ``GPU.k`` is; ``GPU.1`` only when listed."""
    return name in available or ("." not in name and any(a.startswith(name + ".") for a in available))


def check_device(device: str, core: DeviceCore) -> list[str]:
    """Refuse a device (or a listed device of a virtual one) this machine does not have; returns
    the physical devices the stage may run on."""
    available = list(core.available_devices)
    names = listed_devices(device)
    for name in names:
        if not _present(name, available):
            where = "" if name == device else f" (named in {device})"
            raise InvalidArgument(
                "device",
                f"{name}{where} is not present on this machine; available: {', '.join(available) or 'none'}",
            )
    return names or available


def _supported(core: DeviceCore, device: str) -> set[str]:
    return {str(p) for p in core.get_property(device, "SUPPORTED_PROPERTIES")}


def _for_device(core: DeviceCore, device: str, props: Mapping[str, Any], precision: str) -> dict[str, Any]:
    supported = _supported(core, device)
    out, dropped = {}, []
    for key, value in props.items():
        if key in supported:
            out[key] = value
        elif key in PRECISION_KEYS:
            raise InvalidArgument(
                "precision",
                f"{precision!r} needs {key}, which {device} does not support (try --precision default)",
            )
        else:
            dropped.append(key)
    if dropped:
        log.warning("device_properties_dropped", device=device, properties=dropped)
    return out


def device_properties(
    device: str, props: Mapping[str, Any], core: DeviceCore, precision: str
) -> dict[str, Any]:
    """The compile config for ``device``: ``props`` as the device's plugin takes them (module doc)."""
    names = check_device(device, core)
    if device.partition(":")[0] not in VIRTUAL:
        return _for_device(core, device, props, precision)
    return {"DEVICE_PROPERTIES": {name: _for_device(core, name, props, precision) for name in names}}
