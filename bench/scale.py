"""bench-scale: real-size synthetic models (Llama 3.2 3B and Llama 3.1 8B shapes) across stages.

Phases (each reuses what an earlier run left under SCALE_DIR, default <models folder>/synthetic):

1. models: ``pipeshard model synth`` of both shapes (bf16, seeded), unless present;
2. exports: 4 (and 2) INT4 stages of each, every one checked first against ``--max-stage-memory``
   (SCALE_EXPORT_BUDGET, default 13G): a split with a stage over it is recorded as refused with
   the estimate, not run; per stage: layers, parameters, seconds, peak RSS (from the manifest),
   .bin bytes, and the estimate beside the measurement;
3. bandwidth: the machine's memory copy bandwidth (best of several 256 MiB copies), and from it
   the single-stream ceiling of the 3B shape (bytes read per decode token: every stage's
   weights but the embedding table, of which a token reads one row);
4. fleets: decode tok/s at 1 and 8 users of every export present, 8B stages each under a memory
   cgroup cap (SCALE_STAGE_CAP, default 0.9 of the whole INT4 model's bytes: at 0.75 a stage holding
   the embedding sat near its cap, the kernel reclaimed its mapped weights and it stopped answering
   health checks), paired with
   openvino_genai.LLMPipeline on an unsplit INT4 export of the 3B shape when one exists
   (SCALE_MONO=1 makes it with optimum-cli: a 3B bf16 conversion, ~14 GB peak); the stage
   processes' peak RSS; the whole 8B model (every stage in one process) under the same cap;
5. plan: ``pipeshard profile`` with the 8B shape and ``pipeshard plan`` on four such nodes
   within the cap (SCALE_PLAN=0 skips).

SCALE_WHOLE=0 skips loading the whole 8B under the cap.
Keys: stage_rss_over_model_max, fleet_over_mono_3b_1user, fleet_8b_decodes, ceiling_fraction_3b.
Loaded machine (2 shared cores): figures are "loaded, reduced" (SCALE_ROUNDS rounds, default 3).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench.stats import median, ratio_ci, summary, write_result
from pipeshard.clients.client import AsyncPipeshardClient
from pipeshard.errors import InvalidArgument
from pipeshard.offline import set_offline_defaults
from pipeshard.paths import models_dir
from pipeshard.services.launcher import Fleet, start_fleet
from pipeshard.services.memcap import MemoryCap
from pipeshard.shard.paged import DEFAULT_CACHE_BYTES
from pipeshard.sizes import gib, parse_bytes

SCALE_DIR = Path(os.environ.get("SCALE_DIR", models_dir() / "synthetic"))
# SCALE_SHAPES=3b=test-llama3,8b=test-llama3 runs every phase on a tiny shape (a dry run).
SHAPES = dict(
    part.split("=", 1)
    for part in os.environ.get("SCALE_SHAPES", "3b=llama-3.2-3b,8b=llama-3.1-8b").split(",")
)
# SCALE_SHAPES=8b=llama-3.1-8b runs the 8B phases alone (no 3B model made or read).
RUNS = tuple(run for run in (("3b", 4), ("8b", 4), ("3b", 2), ("8b", 2)) if run[0] in SHAPES)
# The 8B's end stages carry the 525 M-parameter embedding / head: fewer layers there.
SPLITS = {("llama-3.1-8b", 4): "7,9,9,7"}
EXPORT_BUDGET = parse_bytes(os.environ.get("SCALE_EXPORT_BUDGET", "13G"), "SCALE_EXPORT_BUDGET")
ROUNDS = int(os.environ.get("SCALE_ROUNDS", "3"))
NEW_EXPORTS = os.environ.get("SCALE_NEW_EXPORTS", "3b_4s,8b_4s,3b_2s,8b_2s").split(",")
PHASES = os.environ.get("SCALE_PHASES", "fleet8b,fleet3b,plan").split(",")
TOKENS = 64
USERS = 8
PROMPT = "Explain in a few paragraphs how a bicycle works."
BASE_PORT = 52800 + 60 * int(os.environ.get("SCALE_PORT_BLOCK", "0"))  # 2 runs at once: 0 and 1
CLI = [sys.executable, "-m", "pipeshard.cli"]


def log(message: str) -> None:
    print(f"[bench-scale {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def model_dir(shape: str) -> Path:
    return SCALE_DIR / SHAPES[shape]


def export_dir(shape: str, stages: int) -> Path:
    return SCALE_DIR / "exports" / f"{SHAPES[shape]}-{stages}s-int4"


# ----------------------------------------------------------------------------- models, exports


def ensure_model(shape: str) -> dict:
    folder = model_dir(shape)
    if not (folder / "config.json").is_file():
        free = shutil.disk_usage(SCALE_DIR).free
        log(f"synthesizing {SHAPES[shape]} ({gib(free)} free on {SCALE_DIR})")
        t0 = time.perf_counter()
        subprocess.run([*CLI, "model", "synth", "--like", SHAPES[shape], "--out", str(folder)], check=True)
        return {"seconds": round(time.perf_counter() - t0, 1), "reused": False}
    return {"reused": True}


def bin_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.bin"))


def export_record(shape: str, stages: int) -> dict:
    """Export (or reuse) one split; a split over the budget is refused before any stage runs."""
    from pipeshard.exporter.budget import check_export_memory, export_estimates
    from pipeshard.exporter.export import default_split, resolve_split
    from pipeshard.exporter.families import load_config, resolve_spec
    from pipeshard.shard.manifest import load_manifest

    out = export_dir(shape, stages)
    spec = resolve_spec(load_config(model_dir(shape)))
    even = ",".join(map(str, default_split(spec.num_layers, stages)))
    split = SPLITS.get((SHAPES[shape], stages), even)
    layers = resolve_split(spec.num_layers, None, split)
    estimates = export_estimates(spec, layers)
    planned = {"split": split, "estimated_peak_bytes": [e.peak_bytes for e in estimates]}
    try:
        check_export_memory(spec, layers, EXPORT_BUDGET)
    except InvalidArgument as exc:
        log(f"export {out.name} refused: {exc}")
        return {**planned, "refused": str(exc), "budget_bytes": EXPORT_BUDGET}
    if not (out / "manifest.json").is_file() and f"{shape}_{stages}s" not in NEW_EXPORTS:
        return {**planned, "skipped": "not exported in this run (SCALE_NEW_EXPORTS)"}
    if not (out / "manifest.json").is_file():
        cmd = [*CLI, "export", "--model", str(model_dir(shape)), "--split", split]
        cmd += ["--max-stage-memory", str(EXPORT_BUDGET), "--out", str(out), "--no-ov-tokenizer"]
        log(f"export {out.name}: {' '.join(cmd[3:])}")
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            tail = (done.stderr.strip().splitlines() or [""])[-1]
            log(f"export {out.name} not made: {tail}")
            return {"split": split, "refused": tail, "budget_bytes": EXPORT_BUDGET}
    manifest = load_manifest(out)
    stages_out = []
    for entry, est in zip(manifest.stages, estimates, strict=True):
        stages_out.append(
            {
                "index": entry.index,
                "layers": [entry.layer_start, entry.layer_end],
                "params": est.params,
                "export_seconds": entry.export.seconds,
                "peak_rss_bytes": entry.export.peak_rss_bytes,
                "estimated_peak_bytes": est.peak_bytes,
                "peak_over_fp32_weights": round(entry.export.peak_rss_bytes / (est.params * 4), 3),
                "bin_bytes": bin_bytes(out / entry.folder),
            }
        )
    return {
        "split": split,
        "synthetic": manifest.model.synthetic,
        "export_seconds": round(sum(s["export_seconds"] for s in stages_out), 1),
        "model_bin_bytes": sum(s["bin_bytes"] for s in stages_out),
        "stages": stages_out,
    }


# ----------------------------------------------------------------------------- bandwidth


def copy_bandwidth(mib: int = 256, reps: int = 7) -> float:
    """Bytes/s of a large array copy (read + write counted), best of ``reps``."""
    src = np.ones(mib * 2**20 // 8)
    dst = np.empty_like(src)
    best = 0.0
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = max(best, 2 * src.nbytes / (time.perf_counter() - t0))
    return best


def bytes_per_token(record: dict, spec_json: dict) -> int:
    """Weights one decode token reads: every stage's .bin but the embedding table (one row of it)."""
    table = spec_json["vocab_size"] * spec_json["hidden_size"]  # int8 embedding
    return record["model_bin_bytes"] - table


# ----------------------------------------------------------------------------- fleets


async def _user(address: str, user: int) -> dict:
    async with AsyncPipeshardClient(address, timeout_s=900) as client:
        times: list[float] = []
        count = 0
        async for response in client.responses(f"{PROMPT} ({user})", max_tokens=TOKENS, ignore_eos=True):
            if response.HasField("chunk"):
                times.append(time.perf_counter())
                count += len(response.chunk.token_ids)
        return {"tokens": count, "first": times[0], "last": times[-1]}


def decode_round(address: str, users: int) -> dict:
    """One round of ``users`` concurrent streams of TOKENS tokens: decode tok/s (after the first
    token, so prefill is out) per stream and for all together."""
    t0 = time.perf_counter()
    streams = asyncio.run(_gather(address, users))
    wall = time.perf_counter() - t0
    per = [(s["tokens"] - 1) / (s["last"] - s["first"]) for s in streams if s["tokens"] > 1]
    return {
        "tokens": [s["tokens"] for s in streams],
        "tok_s_1stream": median(per) if per else 0.0,
        "tok_s_all": sum(s["tokens"] for s in streams) / wall,
    }


async def _gather(address: str, users: int) -> list[dict]:
    return await asyncio.gather(*(_user(address, u) for u in range(users)))


def proc_memory(pid: int) -> dict[str, int]:
    """VmHWM (the peak RSS), RssAnon and RssFile of a live process, in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


def start(shape: str, stages: int, slot: int, cap: int | None) -> Fleet:
    out = export_dir(shape, stages)
    run_dir = SCALE_DIR / "runs" / out.name
    shutil.rmtree(run_dir, ignore_errors=True)
    ports = [BASE_PORT + 20 * slot + k for k in range(stages)]
    log(f"fleet {out.name} on ports {ports}" + (f", each stage capped at {gib(cap)}" if cap else ""))
    return start_fleet(
        out,
        stages,
        run_dir,
        stage_ports=ports,
        coordinator_port=BASE_PORT + 20 * slot + 19,
        stage_memory_limit=cap,
        timeout_s=1800,
        # an 8B prefill step on two loaded cores takes longer than the default 30 s step deadline,
        # and at load 23 the coordinator's warm-up reached stage 3 after its 300 s idle timeout
        extra_coordinator_args=["--step-timeout-s", "900"],
        extra_stage_args=["--idle-timeout-s", "1800"],
    )


def fleet_stats(fleet: Fleet, stages: int) -> dict:
    names = [f"stage{k}" for k in range(stages)]
    procs = {n: fleet.process(n) for n in names}
    alive = {n: p.popen.poll() is None for n, p in procs.items()}
    memory = {n: proc_memory(p.popen.pid) if alive[n] else {} for n, p in procs.items()}
    stats = {
        "alive": alive,
        "peak_rss_bytes": {n: m.get("VmHWM", 0) for n, m in memory.items()},
        "rss_anon_bytes": {n: m.get("RssAnon", 0) for n, m in memory.items()},
        "rss_file_bytes": {n: m.get("RssFile", 0) for n, m in memory.items()},
        "kv_pool_bytes": DEFAULT_CACHE_BYTES,  # each stage's paged KV pool (--kv-cache-bytes)
    }
    if fleet.caps:
        stats["cgroup_peak_bytes"] = {n: fleet.caps[n].peak_bytes() for n in names}
        stats["oom_kills"] = {n: fleet.caps[n].oom_kills() for n in names}
    return stats


def whole_model_under_cap(shape: str, cap: int) -> dict:
    """Every stage of the 4-stage export in one process (the unsplit model) under ``cap``."""
    out = export_dir(shape, 4)
    code = (
        "import sys; from pipeshard.shard.chain import LocalChain; "
        f"c = LocalChain({str(out)!r}); print('loaded', flush=True); "
        "c.generate_greedy([1, 2, 3], 8, ignore_eos=True); print('decoded', flush=True)"
    )
    memcap = MemoryCap(f"scale-whole-{shape}", cap)
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.readline(); " + code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    memcap.add(proc.pid)
    try:
        out_text, err = proc.communicate("go\n", timeout=1800)
    finally:
        kills = memcap.oom_kills()
        peak = memcap.peak_bytes()
        memcap.close()
    return {
        "cap_bytes": cap,
        "returncode": proc.returncode,
        "oom_kills": kills,
        "cgroup_peak_bytes": peak,
        "loaded": "loaded" in out_text,
        "decoded": "decoded" in out_text,
        "stderr_tail": err.strip().splitlines()[-1:] if err else [],
    }


# ----------------------------------------------------------------------------- mono reference


def mono_folder() -> Path:
    return SCALE_DIR / "exports" / f"{SHAPES['3b']}-optimum-int4"


def ensure_mono() -> Path | None:
    folder = mono_folder()
    if (folder / "openvino_model.xml").is_file():
        return folder
    if os.environ.get("SCALE_MONO") != "1":
        return None
    from bench.reference import optimum_export

    log(f"optimum-cli export of the unsplit 3B shape into {folder}")
    return optimum_export(model_dir("3b"), folder)


def mono_ids() -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir("3b"))(PROMPT)["input_ids"]


# ----------------------------------------------------------------------------- plan


def plan_phase(cap: int) -> dict:
    node = SCALE_DIR / "node-8b.yaml"
    t0 = time.perf_counter()
    if not node.is_file():
        log("pipeshard profile with the 8B shape")
        subprocess.run(
            [*CLI, "profile", "--model", str(model_dir("8b")), "--rows", "1,8", "--contexts", "128",
             "--prefill", "128", "--name", "here", "--out", str(node)],
            check=True,
        )  # fmt: skip
    import yaml

    profile = yaml.safe_load(node.read_text())
    nodes = SCALE_DIR / "nodes-8b.yaml"
    entries = [{**profile, "name": f"node{k}", "memory_bytes": cap} for k in range(4)]
    for entry in entries:
        entry.pop("address", None)
    nodes.write_text(yaml.safe_dump(entries, sort_keys=False))
    runs = {}
    for name, extra in {
        "latency_4x_cap": [],
        "throughput8_4x_cap": ["--objective", "throughput", "--batch", "8"],
        "latency_4x_cap_limit_1g": ["--max-stage-memory", "1G"],
    }.items():
        done = subprocess.run(
            [
                *CLI,
                "plan",
                "--nodes",
                str(nodes),
                "--model",
                str(model_dir("8b")),
                "--context",
                "1024",
                *extra,
            ],
            capture_output=True,
            text=True,
        )
        runs[name] = {"returncode": done.returncode, "out": (done.stdout + done.stderr).strip()[-1500:]}
    return {
        "profile": {
            k: profile[k] for k in ("per_layer_ms", "overhead_ms", "embed_ms", "head_ms") if k in profile
        },
        "seconds": round(time.perf_counter() - t0, 1),
        "plans": runs,
    }


# ----------------------------------------------------------------------------- main


def main() -> int:
    set_offline_defaults()
    os.environ.setdefault("PIPESHARD_PREFIX_CACHE", "off")  # repeated prompts must be computed
    (SCALE_DIR / "exports").mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    previous = Path("bench/results/scale.json")
    result: dict = json.loads(previous.read_text()) if os.environ.get("SCALE_MERGE") == "1" else {}
    for key in ("name", "date", "machine", "command"):
        result.pop(key, None)
    result["disk_free_bytes_at_start"] = shutil.disk_usage(SCALE_DIR).free
    result["models"] = {s: ensure_model(s) for s in SHAPES}
    exports = {}
    for shape, stages in RUNS:
        try:
            exports[f"{shape}_{stages}s"] = export_record(shape, stages)
        except InvalidArgument as exc:
            exports[f"{shape}_{stages}s"] = {"refused": str(exc)}
    result["exports"] = exports
    from pipeshard.exporter.families import load_config, resolve_spec

    bandwidth = copy_bandwidth()
    result["bandwidth_bytes_s"] = bandwidth
    have = {k for k, v in exports.items() if "stages" in v}

    # 8B under per-stage caps
    cap = None
    if "8b_4s" in have and "fleet8b" in PHASES:
        model_bytes = exports["8b_4s"]["model_bin_bytes"]
        cap = parse_bytes(os.environ.get("SCALE_STAGE_CAP", str(int(0.9 * model_bytes))), "SCALE_STAGE_CAP")
        fleet = start("8b", 4, 0, cap)
        try:
            rounds = {"1": [], str(USERS): []}
            for _ in range(ROUNDS):
                rounds["1"].append(decode_round(fleet.coordinator, 1))
                rounds[str(USERS)].append(decode_round(fleet.coordinator, USERS))
            stats = fleet_stats(fleet, 4)
        finally:
            fleet.stop()
        decodes = all(r["tokens"] == [TOKENS] for r in rounds["1"]) and all(stats["alive"].values())
        result["fleet_8b_4s"] = {"cap_bytes": cap, "rounds": rounds, **stats}
        result["fleet_8b_decodes"] = decodes
        result["stage_rss_over_model_max"] = round(max(stats["peak_rss_bytes"].values()) / model_bytes, 3)
        if os.environ.get("SCALE_WHOLE", "1") == "1":
            result["whole_8b_under_cap"] = whole_model_under_cap("8b", cap)

    if "fleet3b" in PHASES and "3b" in SHAPES:
        spec3 = resolve_spec(load_config(model_dir("3b"))).to_json()
        fleet3b_phase(result, exports, have, spec3, bandwidth)
    if "plan" in PHASES and "8b" in SHAPES and (model_dir("8b") / "config.json").is_file():
        result["plan_8b"] = plan_phase(cap or result.get("fleet_8b_4s", {}).get("cap_bytes") or 4 * 2**30)
    result["seconds"] = round(time.perf_counter() - t_start, 1)
    result["rounds"] = ROUNDS
    write_result(os.environ.get("SCALE_RESULT", "scale"), result, "make bench-scale")
    return 0


def fleet3b_phase(result: dict, exports: dict, have: set[str], spec3: dict, bandwidth: float) -> None:
    """3B fleets (4 and 2 stages) at 1 and 8 users, paired with the unsplit LLMPipeline."""
    fleets3 = {}
    samples: dict[str, list[float]] = {}
    try:
        for slot, stages in enumerate((4, 2), start=1):
            if f"3b_{stages}s" in have:
                fleets3[stages] = start("3b", stages, slot, None)
        mono = ensure_mono()
        genai = None
        if mono is not None:
            from bench.reference import GenAIPipeline

            genai, ids = GenAIPipeline(mono), mono_ids()
        for _ in range(ROUNDS):
            for stages, fleet in fleets3.items():
                one = decode_round(fleet.coordinator, 1)
                samples.setdefault(f"fleet_{stages}s_1user", []).append(one["tok_s_1stream"])
                many = decode_round(fleet.coordinator, USERS)
                samples.setdefault(f"fleet_{stages}s_{USERS}users", []).append(many["tok_s_all"])
            if genai is not None:
                samples.setdefault("mono_llmpipeline_1user", []).append(genai.run(ids, TOKENS)["tok_s"])
        stats3 = {s: fleet_stats(f, s) for s, f in fleets3.items()}
    finally:
        for fleet in fleets3.values():
            fleet.stop()
    result["fleet_3b"] = {"tok_s": {k: summary(v) for k, v in samples.items()}, "stages": stats3}
    if "fleet_4s_1user" in samples and "mono_llmpipeline_1user" in samples:
        ratio, ci = ratio_ci(samples["fleet_4s_1user"], samples["mono_llmpipeline_1user"])
        result["fleet_over_mono_3b_1user"] = round(ratio, 3)
        result["fleet_over_mono_3b_1user_ci"] = [round(c, 3) for c in ci]
    if "3b_4s" in have and "fleet_4s_1user" in samples:
        per_token = bytes_per_token(exports["3b_4s"], spec3)
        ceiling = bandwidth / per_token
        result["bytes_per_token_3b"] = per_token
        result["ceiling_tok_s_3b"] = round(ceiling, 2)
        result["ceiling_fraction_3b"] = round(median(samples["fleet_4s_1user"]) / ceiling, 3)
        if "mono_llmpipeline_1user" in samples:
            result["ceiling_fraction_3b_mono"] = round(median(samples["mono_llmpipeline_1user"]) / ceiling, 3)


if __name__ == "__main__":
    sys.exit(main())
