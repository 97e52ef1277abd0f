"""The unsplit reference: an optimum-intel export of the same model, quantized the same way.

``--weight-format int4 --sym --group-size 64 --ratio 1.0``: every decoder matrix INT4 symmetric
with group 64, embeddings and the tied LM head INT8 asymmetric (optimum's backup precision),
the same as our shards' default ``--head-precision int8``.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np

OPTIMUM_ARGS = [
    "--task",
    "text-generation-with-past",
    "--weight-format",
    "int4",
    "--sym",
    "--group-size",
    "64",
    "--ratio",
    "1.0",
]


def optimum_export(model_dir: Path, out: Path) -> Path:
    if not (out / "openvino_model.xml").exists():
        cli = Path(sys.executable).with_name("optimum-cli")
        subprocess.run(
            [str(cli), "export", "openvino", "--model", str(model_dir), *OPTIMUM_ARGS, str(out)], check=True
        )
    return out


class GenAIPipeline:
    """openvino_genai.LLMPipeline fed token ids directly (no second tokenization or template).

    The stateful SDPA backend, as our shards use: the default paged-attention backend caches
    prompt prefixes, so a repeated benchmark prompt would skip its prefill and report a TTFT of
    a few ms. Times are taken here with the wall clock (first streamed token, last token), the
    same way as for every other configuration."""

    def __init__(self, folder: Path, **properties):
        """``properties``: extra CPU compile properties (a precision mode's, for paired runs)."""
        import openvino_genai

        self._genai = openvino_genai
        self.pipe = openvino_genai.LLMPipeline(str(folder), "CPU", ATTENTION_BACKEND="SDPA", **properties)

    def run(self, ids: list[int], new_tokens: int) -> dict:
        import openvino as ov

        g = self._genai
        config = g.GenerationConfig()
        config.max_new_tokens = new_tokens
        config.min_new_tokens = new_tokens
        config.ignore_eos = True
        config.do_sample = False
        inputs = g.TokenizedInputs(
            ov.Tensor(np.asarray([ids], dtype=np.int64)), ov.Tensor(np.ones((1, len(ids)), dtype=np.int64))
        )
        first: list[float] = []

        def streamer(_text: str) -> bool:
            if not first:
                first.append(time.perf_counter())
            return False

        t0 = time.perf_counter()
        out = self.pipe.generate(inputs, config, streamer)
        t_end = time.perf_counter()
        t_first = first[0] if first else t_end
        return {
            "tokens": [int(t) for t in out.tokens[0]],
            "ttft_ms": (t_first - t0) * 1000,
            "tok_s": (new_tokens - 1) / (t_end - t_first) if new_tokens > 1 else 0.0,
        }


class OwnLoop:
    """The optimum export driven by a minimal Python loop (one InferRequest, greedy)."""

    def __init__(self, folder: Path):
        import openvino as ov

        self.request = (
            ov.Core().compile_model(str(folder / "openvino_model.xml"), "CPU").create_infer_request()
        )

    def run(self, ids: list[int], new_tokens: int) -> dict:
        req = self.request
        req.reset_state()
        beam = np.zeros(1, dtype=np.int32)
        t0 = time.perf_counter()
        n = len(ids)
        req.infer(
            {
                "input_ids": np.asarray([ids], np.int64),
                "attention_mask": np.ones((1, n), np.int64),
                "position_ids": np.arange(n, dtype=np.int64)[None],
                "beam_idx": beam,
            }
        )
        token = int(req.get_tensor("logits").data[0, -1].argmax())
        t_first = time.perf_counter()
        tokens = [token]
        for _ in range(new_tokens - 1):
            n += 1
            req.infer(
                {
                    "input_ids": np.asarray([[token]], np.int64),
                    "attention_mask": np.ones((1, n), np.int64),
                    "position_ids": np.asarray([[n - 1]], np.int64),
                    "beam_idx": beam,
                }
            )
            token = int(req.get_tensor("logits").data[0, -1].argmax())
            tokens.append(token)
        t_end = time.perf_counter()
        return {
            "tokens": tokens,
            "ttft_ms": (t_first - t0) * 1000,
            "tok_s": (new_tokens - 1) / (t_end - t_first),
        }
