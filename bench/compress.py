"""`make bench-compress`: size and speed of every tensor codec on real SmolLM2 hidden states.

Captures the hidden states that cross each stage boundary of a 3-stage export (after layers 10
and 20) while a chain prefills chat prompts and decodes greedily, then encodes them as the wire
does. Kinds: wire dtype (fp32, and fp16 as the lossy opt-in would send it) x phase (prefill,
decode) x batch (1 session per frame, or 32 sessions' rows in one frame). For each codec: size
in % of raw, and compress / decompress MB/s of raw bytes (median of interleaved repeats).

Ratio keys (the worst kind decides): ``lane_over_zstd`` = max over kinds of size(byte lanes +
zstd) / size(zstd), ``best_over_lane`` = max over kinds of size(best codec) / size(byte lanes +
zstd); ``lane_blocks_over_zstd`` the same for the shipped lane codec (CODEC_LANE_BLOCKS_ZSTD).
``quantum_zstd`` (CODEC_QUANTUM_ZSTD, fp32 only) cuts each mantissa to the bits above a per-frame
quantum (these activations are sums of bf16-computed terms). Analysis rows (measured and
round-tripped, not shipped): ``xor_prev_step`` (decode, batch 1) XORs each step's bits with the
same session's previous step before lane blocks; ``lane_dicts`` codes each byte lane with a zstd
dictionary trained on held-out sessions' decode frames (the tables a small frame otherwise pays
for); ``quantum_dict`` (fp32) is the quantum codec with such a dictionary for its exponent bytes.
``analysis_minus_lane_blocks_points``: what the best analysis row saves over lane blocks, per kind.
Also measured: greedy token agreement when hidden states cross the wire as fp16 or bf16.

Env: BENCH_EXPORTS (comma-separated export folders; default the 3-stage INT4 export),
BENCH_PROMPTS (prompts captured, default 32), BENCH_DECODE (decode steps, default 16),
BENCH_REPS (timing repeats, default 10).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import zstandard

from bench.stats import interleaved, median, write_result
from pipeshard import tensor_codec_quantum as quantum
from pipeshard.offline import set_offline_defaults
from pipeshard.shard.chain import LocalChain
from pipeshard.shard.prompting import Prompter
from pipeshard.tensor_codec import Codec, decode, encode

CODECS = {
    "none": Codec.CODEC_NONE,
    "zstd": Codec.CODEC_ZSTD,
    "lane_zstd": Codec.CODEC_BYTE_SPLIT_ZSTD,
    "lane_blocks_zstd": Codec.CODEC_LANE_BLOCKS_ZSTD,
    "quantum_zstd": Codec.CODEC_QUANTUM_ZSTD,  # fp32 frames only
}


def codecs_for(frames: list[np.ndarray]) -> dict[str, int]:
    """The codecs that take these frames (CODEC_QUANTUM_ZSTD takes float32 only)."""
    if frames[0].dtype == np.float32:
        return CODECS
    return {n: c for n, c in CODECS.items() if c != Codec.CODEC_QUANTUM_ZSTD}


TOPICS = (
    "a refrigerator",
    "a bicycle",
    "the moon's phases",
    "a rainbow",
    "bread rising",
    "a compass",
    "tides",
    "a vaccine",
)
ASKS = (
    "Explain how {} works.",
    "Write a short poem about {}.",
    "List three facts about {}.",
    "Why does {} matter?",
)
PROMPTS = tuple(a.format(t) for t in TOPICS for a in ASKS)
SAGREE_TOKENS = 64


@dataclass
class Captured:
    """Per boundary (stage output k): each prompt's prefill [1, T, H] and decode steps [1, 1, H]."""

    prefill: dict[int, list[np.ndarray]]
    decode: dict[int, list[list[np.ndarray]]]


def capture(export: Path, prompts: list[list[int]], decode_steps: int, precision: str = "fast") -> Captured:
    """Run each prompt through a chain, keeping every non-final stage's output (a copy); at
    ``fast`` by default, whose bf16-computed activations the codecs were designed on."""
    chain = LocalChain(export, precision, verify=False)
    bounds = range(len(chain.sessions) - 1)
    prefill: dict[int, list[np.ndarray]] = {b: [] for b in bounds}
    decode_: dict[int, list[list[np.ndarray]]] = {b: [] for b in bounds}
    for ids in prompts:
        chain.reset()
        x = np.asarray([ids], dtype=np.int64)
        outs = _run(chain, x)
        for b in bounds:
            prefill[b].append(outs[b])
            decode_[b].append([])
        token = int(outs[-1][0, -1].argmax())
        for _ in range(decode_steps):
            outs = _run(chain, np.asarray([[token]], dtype=np.int64))
            for b in bounds:
                decode_[b][-1].append(outs[b])
            token = int(outs[-1][0, -1].argmax())
    return Captured(prefill, decode_)


def _run(chain: LocalChain, x: np.ndarray) -> list[np.ndarray]:
    outs = []
    for s in chain.sessions:
        x = s.run(x, copy=True)
        outs.append(x)
    return outs


def frames_by_kind(cap: Captured, batch: int) -> dict[str, list[np.ndarray]]:
    """fp32 frames per kind: prefill/decode at batch 1 and ``batch`` sessions per frame."""
    kinds: dict[str, list[np.ndarray]] = {"prefill_b1": [], f"prefill_b{batch}": [], "decode_b1": []}
    kinds[f"decode_b{batch}"] = []
    for b, prompts in cap.prefill.items():
        kinds["prefill_b1"].extend(prompts[:4])
        if len(prompts) >= batch:
            # Each prompt's last positions, after the chat template's shared head: positions whose
            # tokens and context are the same in several prompts are bit-identical there, which
            # would flatter zstd's long matches (and a prefix cache would not send them anyway).
            group = prompts[:batch]
            t = min(p.shape[1] for p in group) - _shared_head(group)
            kinds[f"prefill_b{batch}"].append(np.concatenate([p[:, -t:] for p in group]))
        steps = cap.decode[b]
        kinds["decode_b1"].extend(s for session in steps[:4] for s in session)
        if len(steps) >= batch:
            for i in range(len(steps[0])):
                kinds[f"decode_b{batch}"].append(np.concatenate([session[i] for session in steps[:batch]]))
    return {k: v for k, v in kinds.items() if v}


def _shared_head(prompts: list[np.ndarray]) -> int:
    """Leading positions whose hidden states are the same bits in every prompt."""
    t = min(p.shape[1] for p in prompts) - 1  # keep at least one position
    head = 0
    while head < t and all(np.array_equal(p[0, head], prompts[0][0, head]) for p in prompts):
        head += 1
    return head


def wire_array(frame: np.ndarray, dtype: str) -> np.ndarray:
    return frame if dtype == "fp32" else frame.astype(np.float16)


def sizes(frames: list[np.ndarray]) -> dict[str, float]:
    raw = sum(f.nbytes for f in frames)
    out = {}
    for name, codec in codecs_for(frames).items():
        total = 0
        for f in frames:
            wire = encode(f, codec)
            back = decode(type(wire).FromString(wire.SerializeToString()))
            if back.tobytes() != f.tobytes():
                raise AssertionError(f"{name} is not lossless")
            total += len(wire.data)
        out[name] = 100.0 * total / raw
    return out


def xor_prev_step(sessions: list[list[np.ndarray]]) -> float:
    """% of raw for decode frames XORed with the previous step of the same session, lane blocks."""
    raw = total = 0
    for steps in sessions:
        prev = None
        for f in steps:
            bits = f.view(np.uint32 if f.itemsize == 4 else np.uint16)
            x = bits if prev is None else bits ^ prev
            total += len(encode(x.view(f.dtype), Codec.CODEC_LANE_BLOCKS_ZSTD).data)
            raw += f.nbytes
            prev = bits
    return 100.0 * total / raw


def lane_dicts(train: list[np.ndarray], test: list[np.ndarray], dict_bytes: int = 1024) -> float:
    """% of raw for ``test`` frames with each byte lane its own zstd frame coded with a dictionary
    trained on that lane of ``train`` (other sessions' frames): the entropy tables a small frame
    otherwise spends its own bytes on come from the dictionary, which the receiver must already
    hold (shipped with the shard, or sent once per link). Measured, not shipped."""
    itemsize = test[0].itemsize
    dicts = [
        zstandard.train_dictionary(dict_bytes, [_byte_lanes(f)[k].tobytes() for f in train], level=1)
        for k in range(itemsize)
    ]
    coders = [
        zstandard.ZstdCompressor(level=1, dict_data=d, write_content_size=False, write_dict_id=False)
        for d in dicts
    ]
    decoders = [zstandard.ZstdDecompressor(dict_data=d) for d in dicts]
    total = raw = 0
    for f in test:
        for k, lane in enumerate(_byte_lanes(f)):
            packed = coders[k].compress(lane.tobytes())
            if decoders[k].decompress(packed, max_output_size=lane.size) != lane.tobytes():
                raise AssertionError("lane dictionaries are not lossless")
            total += min(len(packed), lane.size + 3)  # + 3: a raw zstd block when it does not compress
        raw += f.nbytes
    return 100.0 * total / raw


def _byte_lanes(f: np.ndarray) -> np.ndarray:
    return f.reshape(-1).view(np.uint8).reshape(-1, f.itemsize).T


def quantum_dict(train: list[np.ndarray], test: list[np.ndarray]) -> float:
    """% of raw for fp32 ``test`` frames coded as CODEC_QUANTUM_ZSTD but with the exponent bytes
    coded with a zstd dictionary trained on ``train``'s (as :func:`lane_dicts`). Measured, not
    shipped."""
    exponents = [(_fp32_bits(f) >> 23).astype(np.uint8).tobytes() for f in train]
    book = zstandard.train_dictionary(1024, exponents, level=1)
    total = raw = 0
    for f in test:
        packed = quantum.encode_fp32(f, book)
        if not np.array_equal(quantum.decode_fp32(packed, f.size, book), _fp32_bits(f)):
            raise AssertionError("quantum packing with a dictionary is not lossless")
        total += len(packed)
        raw += f.nbytes
    return 100.0 * total / raw


def _fp32_bits(f: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(f, dtype="<f4").reshape(-1).view(np.uint32)


def _per_boundary(
    pct: Callable[[list[np.ndarray], list[np.ndarray]], float],
    train: dict[int, list[np.ndarray]],
    test: dict[int, list[np.ndarray]],
) -> float:
    """% of raw over every boundary's test frames, each coded with tables trained on its own
    boundary's ``train`` frames (weighted by bytes)."""
    sizes = {b: sum(f.nbytes for f in frames) for b, frames in test.items()}
    return sum(pct(train[b], test[b]) * n for b, n in sizes.items()) / sum(sizes.values())


def speeds(frames: list[np.ndarray], reps: int) -> dict[str, dict[str, float]]:
    """Compress and decompress MB/s of raw bytes per codec, interleaved repeats."""
    raw = sum(f.nbytes for f in frames)
    codecs = codecs_for(frames)
    wires = {n: [encode(f, c) for f in frames] for n, c in codecs.items()}

    def enc(codec: int) -> Callable[[], float]:
        def run() -> float:
            t = time.perf_counter()
            for f in frames:
                encode(f, codec)
            return raw / (time.perf_counter() - t) / 1e6

        return run

    def dec(name: str) -> Callable[[], float]:
        def run() -> float:
            t = time.perf_counter()
            for w in wires[name]:
                decode(w)
            return raw / (time.perf_counter() - t) / 1e6

        return run

    configs = {f"{n}.compress": enc(c) for n, c in codecs.items()}
    configs |= {f"{n}.decompress": dec(n) for n in codecs}
    samples = interleaved(configs, reps, warmup=1)
    return {n: {op: median(samples[f"{n}.{op}"]) for op in ("compress", "decompress")} for n in codecs}


def token_agreement(export: Path, prompts: list[list[int]], new_tokens: int) -> dict[str, dict]:
    """Greedy tokens with hidden states narrowed to fp16 / bf16 at every boundary vs fp32."""
    chain = LocalChain(export, "fast", verify=False)
    narrow = {
        "fp32": lambda h: h,
        "fp16": lambda h: decode(encode(h, as_fp16=True)).astype(np.float32),
        "bf16": lambda h: decode(encode(h, as_bf16=True)),
    }
    runs = {name: [_greedy(chain, ids, new_tokens, fn) for ids in prompts] for name, fn in narrow.items()}
    out = {}
    for name in ("fp16", "bf16"):
        same = [_common_prefix(a, b) for a, b in zip(runs[name], runs["fp32"], strict=True)]
        equal = sum(a == b for a, b in zip(runs[name], runs["fp32"], strict=True))
        out[name] = {
            "identical_sequences": equal,
            "sequences": len(prompts),
            "mean_tokens_before_divergence": float(np.mean(same)),
            "token_agreement": float(
                np.mean([_agreement(a, b) for a, b in zip(runs[name], runs["fp32"], strict=True)])
            ),
        }
    return out


def _greedy(chain: LocalChain, ids: list[int], n: int, narrow) -> list[int]:
    chain.reset()
    x = np.asarray([ids], dtype=np.int64)
    tokens = []
    for _ in range(n):
        for i, s in enumerate(chain.sessions):
            x = s.run(x, copy=True)
            if i < len(chain.sessions) - 1:
                x = narrow(x)
        tokens.append(int(x[0, -1].argmax()))
        x = np.asarray([[tokens[-1]]], dtype=np.int64)
    return tokens


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < len(a) and a[n] == b[n]:
        n += 1
    return n


def _agreement(a: list[int], b: list[int]) -> float:
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a)


def main() -> int:
    set_offline_defaults()
    from bench.parity import ensure_export

    exports = [Path(p) for p in os.environ.get("BENCH_EXPORTS", "").split(",") if p] or [ensure_export(3)]
    n_prompts = int(os.environ.get("BENCH_PROMPTS", "32"))
    steps = int(os.environ.get("BENCH_DECODE", "16"))
    reps = int(os.environ.get("BENCH_REPS", "10"))
    batch = min(32, n_prompts)
    results: dict[str, dict] = {}
    lane_over_zstd = best_over_lane = lane_blocks_over_zstd = 0.0
    analysis_gain: dict[str, float] = {}
    worst_gap_points = float("inf")
    agreement = {}
    for export in exports:
        prompter = Prompter.from_dir(export)
        prompts = [prompter.encode("", [("user", p)]) for p in PROMPTS[:n_prompts]]
        cap = capture(export, prompts, steps)
        for wire in ("fp32", "fp16"):
            for kind, frames in frames_by_kind(cap, batch).items():
                frames = [wire_array(f, wire) for f in frames]
                row = {"frames": len(frames), "frame_bytes": frames[0].nbytes, "size_pct": sizes(frames)}
                analysis = {}
                if kind == "decode_b1":
                    sessions = [
                        [wire_array(s, wire) for s in sess] for b in cap.decode for sess in cap.decode[b][:4]
                    ]
                    analysis["xor_prev_step"] = xor_prev_step(sessions)
                    # Tables trained per boundary on the other sessions' decode frames (held out).
                    train = {
                        b: [wire_array(s, wire) for sess in cap.decode[b][4:] for s in sess]
                        for b in cap.decode
                    }
                    test = {
                        b: [wire_array(s, wire) for sess in cap.decode[b][:4] for s in sess]
                        for b in cap.decode
                    }
                    analysis["lane_dicts"] = _per_boundary(lane_dicts, train, test)
                    if wire == "fp32":
                        analysis["quantum_dict"] = _per_boundary(quantum_dict, train, test)
                row["size_pct"] |= analysis
                row["mb_s"] = speeds(frames, reps)
                pct = row["size_pct"]
                best = min(pct[n] for n in codecs_for(frames) if n != "none")
                lane_over_zstd = max(lane_over_zstd, pct["lane_zstd"] / pct["zstd"])
                lane_blocks_over_zstd = max(lane_blocks_over_zstd, pct["lane_blocks_zstd"] / pct["zstd"])
                if analysis:
                    best_analysis = min(analysis.values())
                    analysis_gain[f"{wire}/{kind}"] = pct["lane_blocks_zstd"] - best_analysis
                best_over_lane = max(best_over_lane, best / pct["lane_zstd"])
                worst_gap_points = min(worst_gap_points, pct["lane_zstd"] - best)
                results[f"{export.name}/{wire}/{kind}"] = row
                print(f"{export.name} {wire} {kind}: " + " ".join(f"{k}={v:.1f}%" for k, v in pct.items()))
        agreement[export.name] = token_agreement(export, prompts[:8], SAGREE_TOKENS)
    write_result(
        "compress",
        {
            "runs": reps,
            "exports": [str(e) for e in exports],
            "prompts": n_prompts,
            "decode_steps": steps,
            "kinds": results,
            "lane_over_zstd": lane_over_zstd,
            "best_over_lane": best_over_lane,
            "best_minus_lane_points_worst_kind": worst_gap_points,
            "lane_blocks_over_zstd": lane_blocks_over_zstd,
            # Points of raw the best analysis transform (not shipped) saves over lane blocks.
            "analysis_minus_lane_blocks_points": analysis_gain,
            "baselines": {"lane_over_zstd": "zstd", "best_over_lane": "lane_zstd"},
            "wire_precision_agreement": agreement,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
