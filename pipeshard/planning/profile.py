"""``pipeshard profile``: measure this machine into a node description for ``pipeshard plan``.

Per-layer time cannot be read off one shard, so four small probe stages of the model are
exported in this process (a model cut to 5 layers: layers [1,2) and [1,4) as middle stages, [0,1)
with the embedding, [4,5) with the final norm and LM head) and timed with the thread count and
precision a stage process would use. Differences give the per-layer time, the fixed cost of a
step, and the embedding's and head's extra cost; .bin sizes give the bytes per layer, of the
embedding and of the head. Decode is timed at a few batch sizes (rows per step) and context
lengths, prefill at a few prompt lengths. ``--peer`` adds the link to a running pipeshard
service (any: every one serves grpc.health.v1): round trip of an empty health check, and
bandwidth from the same check carrying 1 MiB (an unknown service name: whatever the answer, the
request arrived whole; loopback figures include Python's time to build and parse it).
"""

from __future__ import annotations

import os
import platform
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pipeshard.errors import InvalidArgument
from pipeshard.precision import DEFAULT_PRECISION

# Probe stages of a model cut to 5 layers: name -> (layer_start, layer_end).
PROBES = {"first": (0, 1), "mid1": (1, 2), "mid3": (1, 4), "last": (4, 5)}
PROBE_LAYERS = 5


@dataclass(frozen=True)
class ProfileOptions:
    rows: tuple[int, ...] = (1, 4)
    contexts: tuple[int, ...] = (128, 1024)
    prefill: tuple[int, ...] = (128, 512)
    steps: int = 16  # timed decode steps per point (median)
    threads: int | None = None
    precision: str = DEFAULT_PRECISION
    weights: str = "int4"
    device: str = "CPU"  # OpenVINO device to time the probes on (as the stage's --device)


@dataclass
class Probe:
    """One compiled probe stage and an InferRequest to time it."""

    path: Path
    is_first: bool
    is_last: bool
    hidden: int
    request: Any = field(repr=False, default=None)

    def step(self, rows: int, past: int, tokens: int) -> float:
        """Run one step of ``tokens`` new positions for ``rows`` sequences at cache length ``past``;
        returns its milliseconds."""
        import openvino as ov

        req = self.request
        if self.is_first:
            x = np.ones((rows, tokens), dtype=np.int64)
            req.set_tensor("input_ids", ov.Tensor(x))
        else:
            x = np.ones((rows, tokens, self.hidden), dtype=np.float32)
            req.set_tensor("hidden_states", ov.Tensor(x))
        req.set_tensor("attention_mask", ov.Tensor(np.ones((rows, past + tokens), dtype=np.int64)))
        pos = np.broadcast_to(np.arange(past, past + tokens, dtype=np.int64), (rows, tokens)).copy()
        req.set_tensor("position_ids", ov.Tensor(pos))
        req.set_tensor("beam_idx", ov.Tensor(np.arange(rows, dtype=np.int32)))
        if self.is_last:
            req.set_tensor("logits_to_keep", ov.Tensor(np.array(1, dtype=np.int64)))
        t0 = time.perf_counter()
        req.infer()
        return (time.perf_counter() - t0) * 1000.0

    def decode_ms(self, rows: int, context: int, steps: int) -> float:
        self.request.reset_state()
        self.step(rows, 0, context)
        times = [self.step(rows, context + k, 1) for k in range(steps)]
        return statistics.median(times)

    def prefill_ms(self, tokens: int, reps: int = 3) -> float:
        times = []
        for _ in range(reps):
            self.request.reset_state()
            times.append(self.step(1, 0, tokens))
        return statistics.median(times)


def export_probes(model_dir: Path, weights: str, out: Path) -> dict[str, Path]:
    """The four probe stages as OpenVINO IR under ``out`` (in this process; a few seconds each)."""
    from pipeshard.exporter.compress import make_plan
    from pipeshard.exporter.export import StageJob, export_stage
    from pipeshard.exporter.families import cut_config, load_config, resolve_spec

    config = load_config(model_dir)
    spec = resolve_spec(config)
    if spec.num_layers < PROBE_LAYERS:
        raise InvalidArgument(
            "model", f"has {spec.num_layers} layers; profiling needs at least {PROBE_LAYERS}"
        )
    cut = cut_config(config, PROBE_LAYERS)
    plan = make_plan(resolve_spec(cut), weights)
    paths = {}
    for index, (name, (a, b)) in enumerate(PROBES.items()):
        folder = out / name
        job = StageJob(str(model_dir), cut, index, a, b, str(folder), plan, True)
        entry = export_stage(job, lambda event: None)
        paths[name] = folder / entry.model
    return paths


def free_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def _bin_bytes(xml: Path) -> int:
    return xml.with_suffix(".bin").stat().st_size


def measure_link(
    peer: str, reps: int = 20, payload: int = 1 << 20, connect_timeout_s: float = 10.0
) -> dict[str, float]:
    """Round trip and bandwidth to ``peer`` over gRPC health checks (an unknown service name of
    ``payload`` bytes: the server answers NOT_FOUND after receiving it all)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    channel = grpc.insecure_channel(peer, options=[("grpc.max_send_message_length", 2 * payload)])
    try:
        grpc.channel_ready_future(channel).result(timeout=connect_timeout_s)
    except grpc.FutureTimeoutError:
        raise InvalidArgument("peer", f"nothing answers at {peer}") from None
    stub = health_pb2_grpc.HealthStub(channel)

    def call(service: str) -> float:
        t0 = time.perf_counter()
        try:
            stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=30)
        except grpc.RpcError as exc:  # any answer means the request arrived whole
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise InvalidArgument("peer", f"{peer} did not answer ({exc.code().name})") from None
        return (time.perf_counter() - t0) * 1000.0

    for _ in range(3):
        call("")
    rtt = statistics.median(call("") for _ in range(reps))
    big = "x" * payload
    heavy = statistics.median(call(big) for _ in range(max(3, reps // 4)))
    channel.close()
    seconds = max(heavy - rtt, 1e-3) / 1000.0
    return {"mbit": round(payload * 8 / seconds / 1e6, 1), "rtt_ms": round(rtt, 3)}


def profile_node(
    model_dir: Path,
    options: ProfileOptions,
    *,
    name: str,
    address: str = "",
    peer: str | None = None,
    probes_dir: Path | None = None,
) -> dict[str, Any]:
    """Measure this machine; returns the node description (plain data for YAML). ``probes_dir``
    keeps the probe stages for another run (benchmarks profile several thread counts)."""
    import openvino as ov

    from pipeshard.shard.device import device_properties
    from pipeshard.shard.runtime import compile_properties

    started = time.perf_counter()
    work = probes_dir or Path(tempfile.mkdtemp(prefix="pipeshard-profile-"))
    try:
        xmls = {key: work / key / f"stage_{i}" / "openvino_model.xml" for i, key in enumerate(PROBES)}
        if not all(x.is_file() for x in xmls.values()):
            xmls = export_probes(model_dir, options.weights, work)
        core = ov.Core()
        props = device_properties(
            options.device, compile_properties(options.precision, options.threads), core, options.precision
        )
        probes = {}
        for key, xml in xmls.items():
            model = core.read_model(str(xml))
            hidden = int(model.output(0).get_partial_shape()[-1].get_length()) if key != "last" else 0
            compiled = core.compile_model(model, options.device, props)
            probes[key] = Probe(xml, key == "first", key == "last", hidden, compiled.create_infer_request())
        hidden = probes["first"].hidden
        for probe in probes.values():
            probe.hidden = hidden
            probe.decode_ms(1, 16, 2)  # warm-up: the first inferences of new shapes prepare kernels
        decode = []
        for rows in options.rows:
            for context in options.contexts:
                t = {k: p.decode_ms(rows, context, options.steps) for k, p in probes.items()}
                decode.append({"rows": rows, "context": context, **_split(t)})
        prefill = []
        for tokens in options.prefill:
            t = {k: p.prefill_ms(tokens) for k, p in probes.items()}
            prefill.append({"tokens": tokens, **_split(t)})
        sizes = {k: _bin_bytes(x) for k, x in xmls.items()}
    finally:
        if probes_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    layer_bytes = (sizes["mid3"] - sizes["mid1"]) // 2
    short = min(options.contexts)
    at_short = [d for d in decode if d["context"] == short]
    node: dict[str, Any] = {
        "name": name,
        "address": address,
        "device": options.device,
        # what `pipeshard plan` reads: decode at the shortest context, by rows per step
        "per_layer_ms": {d["rows"]: d["per_layer_ms"] for d in at_short},
        "overhead_ms": {d["rows"]: d["overhead_ms"] for d in at_short},
        "embed_ms": {d["rows"]: d["embed_ms"] for d in at_short},
        "head_ms": {d["rows"]: d["head_ms"] for d in at_short},
        "memory_bytes": free_memory_bytes(),
    }
    if peer:
        node["link_to_next"] = measure_link(peer)
    node["measured"] = {
        "model": str(model_dir),
        "weights": options.weights,
        "precision": options.precision,
        "threads": options.threads or 0,
        "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "layer_bytes": layer_bytes,
        "embed_bytes": sizes["first"] - sizes["mid1"],
        "head_bytes": sizes["last"] - sizes["mid1"],
        "decode": decode,
        "prefill": prefill,
        "seconds": round(time.perf_counter() - started, 1),
    }
    return node


def _split(t: dict[str, float]) -> dict[str, float]:
    """Probe times -> per layer, fixed per step, embedding and head extra (ms, >= 0: noise can
    make a difference slightly negative)."""
    per_layer = max(0.0, (t["mid3"] - t["mid1"]) / 2)
    fixed = max(0.0, t["mid1"] - per_layer)
    return {
        "per_layer_ms": round(per_layer, 4),
        "overhead_ms": round(fixed, 4),
        "embed_ms": round(max(0.0, t["first"] - t["mid1"]), 4),
        "head_ms": round(max(0.0, t["last"] - t["mid1"]), 4),
    }
