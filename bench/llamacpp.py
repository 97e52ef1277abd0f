"""`make bench-llamacpp`: Gemma 3 270M's greedy continuations from llama.cpp on the GGUF the model is
built from, against transformers' fp32 and pipeshard's fp32 and INT4 fleets (bench/results/llamacpp.json).

llama.cpp is llama-cpp-python's vendored copy, built from its source once by the make target (no
prebuilt wheel on the index runs on this Debian 12; about half an hour on 2 cores). It runs the
Q4_K_M GGUF with its own quantized kernels, the only way it runs one; the greedy choice is an argmax
of its logits, as ours is. The GGUF is assembled again from the installed chunk packages (sha256
checked).

For each held-out prompt (tests/conftest.py's GEMMA3_PROMPTS, ``<bos>`` first, the same ids to
all four) and BENCH_TOKENS new tokens (default 128, eos ignored; BENCH_THREADS llama.cpp threads,
default 1): the tokens each pair has in
common before its first difference. Then, teacher-forced over transformers' greedy continuation,
llama.cpp's logits against transformers' fp32 ones: max |diff| and how often the top token agrees,
which says how far apart the two numerics are. No timing: nothing here depends on load.
"""

from __future__ import annotations

import importlib
import os
import sys
import tempfile
from itertools import combinations
from pathlib import Path

import numpy as np

from bench.family_fleets import Completions
from bench.stats import command_with_knobs, write_result
from pipeshard import paths
from pipeshard.offline import set_offline_defaults

NEW_TOKENS = int(os.environ.get("BENCH_TOKENS", "128"))
# llama.cpp's threads spin while they wait: on a shared, loaded machine one thread was 4x faster
# than two (the tokens are the same either way).
THREADS = int(os.environ.get("BENCH_THREADS", "1"))
STAGES = 2
KNOBS = ("BENCH_TOKENS", "BENCH_THREADS")
# The held-out prompts of Gemma 3's parity tests (tests/conftest.py GEMMA3_PROMPTS).
PROMPTS = (
    "The history of the printing press begins",
    "def fibonacci(n):\n    ",
    "In a small village at the foot of the mountains,",
    "Water boils at 100 degrees Celsius because",
)


class LlamaCpp:
    """llama.cpp over a GGUF (CPU), every row's logits kept so greedy is an argmax, as ours is."""

    def __init__(self, gguf: Path, n_ctx: int, threads: int):
        from llama_cpp import Llama

        self.llm = Llama(
            str(gguf), n_ctx=n_ctx, n_batch=n_ctx, n_threads=threads, logits_all=True, seed=0, verbose=False
        )

    def tokenize(self, text: str) -> list[int]:
        return self.llm.tokenize(text.encode(), add_bos=True)

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        self.llm.reset()
        self.llm.eval(prompt)
        out: list[int] = []
        while True:
            out.append(int(self.llm.scores[self.llm.n_tokens - 1].argmax()))
            if len(out) == n:
                return out
            self.llm.eval(out[-1:])

    def teacher_forced(self, seq: list[int]) -> np.ndarray:
        self.llm.reset()
        self.llm.eval(seq)
        return np.array(self.llm.scores[: len(seq)])


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens ``a`` and ``b`` share before their first difference."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def hf_greedy(hf, prompt: list[int]) -> list[int]:
    """transformers' fp32 greedy continuation, NEW_TOKENS long, eos ignored."""
    import torch

    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
        )
    return out[0, len(prompt) :].tolist()


def gguf_file(work: Path) -> Path:
    """The Q4_K_M GGUF assembled from the chunk packages `pipeshard model fetch gemma3-270m` installed."""
    from pipeshard.model.gemma3 import PACKAGE_MODULE

    package = importlib.import_module(PACKAGE_MODULE)
    return package.assemble(work / package.MODEL_NAME)


def fleet_greedy(source: Path, weights: str, precision: str, work: Path) -> list[list[int]]:
    """Each prompt's greedy continuation from a real 2-stage fleet of ``weights`` shards."""
    from pipeshard.exporter.export import export_model
    from pipeshard.services.launcher import start_fleet

    shards = paths.shards_dir() / paths.export_name(source.name, STAGES, weights)
    if not (shards / "manifest.json").exists():
        export_model(source, shards, stages=STAGES, weights=weights)
    fleet = start_fleet(shards, STAGES, work / f"run-{weights}", precision=precision)
    try:
        client = Completions(fleet.coordinator)
        return [client.run(p, NEW_TOKENS)["tokens"] for p in PROMPTS]
    finally:
        fleet.stop()


def main() -> int:
    set_offline_defaults()
    os.environ.setdefault("PIPESHARD_PREFIX_CACHE", "off")
    import torch
    from transformers import AutoModelForCausalLM

    from pipeshard.model.gemma3 import ensure_gemma3
    from pipeshard.shard.prompting import Prompter

    work = Path(tempfile.mkdtemp(prefix="pipeshard-llamacpp-"))
    source = ensure_gemma3()
    ids = [Prompter.from_dir(source).encode(p, []) for p in PROMPTS]
    llama = LlamaCpp(gguf_file(work), n_ctx=512, threads=THREADS)
    hf = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    runs: dict[str, list[list[int]]] = {"llama_cpp": [llama.greedy(p, NEW_TOKENS) for p in ids]}
    runs["hf_fp32"] = [hf_greedy(hf, p) for p in ids]
    # teacher-forced over transformers' continuation: how far apart are the two numerics?
    worst, agree, total = 0.0, 0, 0
    for p, cont in zip(ids, runs["hf_fp32"], strict=True):
        seq = p + cont[:-1]
        with torch.no_grad():
            ref = hf(torch.tensor([seq])).logits[0].numpy()
        got = llama.teacher_forced(seq)
        worst = max(worst, float(np.abs(got - ref).max()))
        agree += int((got.argmax(-1) == ref.argmax(-1)).sum())
        total += len(seq)
    del hf
    runs["pipeshard_fp32"] = fleet_greedy(source, "fp32", "f32", work)
    runs["pipeshard_int4"] = fleet_greedy(source, "int4", "default", work)
    result = {
        "model": source.name,
        "gguf": "gemma3-270m Q4_K_M (the package's; transformers dequantizes the same file to fp32)",
        "llama_cpp": _llama_cpp_version(),
        "stages": STAGES,
        "new_tokens": NEW_TOKENS,
        "prompts": list(PROMPTS),
        "same_prompt_tokens_as_llama_cpp": [
            llama.tokenize(p) == i for p, i in zip(PROMPTS, ids, strict=True)
        ],
        "common_prefix": {
            f"{a}~{b}": [common_prefix(x, y) for x, y in zip(runs[a], runs[b], strict=True)]
            for a, b in combinations(runs, 2)
        },
        "llama_cpp_vs_hf_fp32_teacher_forced": {
            "positions": total,
            "max_abs_logit_diff": worst,
            "top1_agreement": agree / total,
        },
        "tokens": runs,
        "load_avg": os.getloadavg(),
    }
    write_result("llamacpp", result, command_with_knobs("bench-llamacpp", KNOBS))
    return 0


def _llama_cpp_version() -> str:
    import llama_cpp

    return f"llama-cpp-python {llama_cpp.__version__} (its vendored llama.cpp)"


if __name__ == "__main__":
    sys.exit(main())
