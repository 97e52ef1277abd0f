"""Weight formats: NNCF weight compression of a converted stage.

- ``int4``: every decoder-layer matrix INT4 symmetric (``CompressWeightsMode.INT4_SYM``,
  ratio 1.0, ``all_layers``) with ONE group size for every matrix. ``auto`` picks the largest
  of 128/64/32 that divides every compressed input dimension (64 for SmolLM2: 576 is not a
  multiple of 128). Embeddings and LM head follow ``head_precision``:
  ``int8`` (default) INT8 asymmetric per channel, which is what NNCF (and so optimum-intel's
  ``--weight-format int4``, whose default leaves ``all_layers`` off) does with the first
  embedding and the last MatMul; ``int4`` puts them in the same INT4 group format; ``fp16``
  and ``fp32`` leave them uncompressed (stored fp16 / fp32).
  The choice is made per tensor, by name, and not by NNCF's "last MatMul of the graph" rule:
  in a middle stage that rule would wrongly keep the last layer's ``down_proj`` in INT8 and
  the shards would not add up to the monolithic model.
- ``int8``: every matrix INT8 (asymmetric by default, ``int8_sym=True`` for symmetric).
- ``fp16``: no NNCF; constants stored as fp16 (``compress_to_fp16`` on save).
- ``fp32``: nothing.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass

import openvino as ov

from pipeshard.errors import InvalidArgument
from pipeshard.exporter.families import ModelSpec
from pipeshard.shard.manifest import WEIGHT_FORMATS

HEAD_PRECISIONS = ("int8", "int4", "fp16", "fp32")
GROUP_SIZE_CANDIDATES = (128, 64, 32)


@dataclass(frozen=True)
class CompressionPlan:
    """What one export does to its weights; recorded in the manifest."""

    weights: str
    group_size: int | None
    head_precision: str
    int8_sym: bool = False

    @property
    def save_fp16(self) -> bool:
        """Uncompressed float constants are stored as fp16 (fp16 format, or an fp16 head)."""
        return self.weights == "fp16" or (self.weights in ("int4", "int8") and self.head_precision == "fp16")

    def to_json(self) -> dict:
        return {
            "format": self.weights,
            "group_size": self.group_size,
            "mode": {
                "int4": "int4_sym",
                "int8": "int8_sym" if self.int8_sym else "int8_asym",
                "fp16": "fp16",
                "fp32": "fp32",
            }[self.weights],
            "embedding_and_lm_head": self.head_precision
            if self.weights in ("int4", "int8")
            else self.weights,
        }


def compressed_input_dims(spec: ModelSpec, head_precision: str = "int8") -> set[int]:
    """Input (reduction) dimensions of the matrices INT4 compression groups along."""
    dims = {spec.hidden_size, spec.num_heads * spec.head_dim, spec.intermediate_size}
    if spec.moe is not None:
        dims.add(spec.moe.intermediate_size)
    if head_precision == "int4":
        dims.add(spec.hidden_size)  # embedding rows and LM head columns are hidden_size long
    return dims


def choose_group_size(dims: Iterable[int], requested: int | str | None = "auto") -> int:
    """The INT4 group size: ``requested`` if it divides every dim, else the largest candidate that does."""
    dims = sorted(set(dims))
    if requested in (None, "auto"):
        for g in GROUP_SIZE_CANDIDATES:
            if all(d % g == 0 for d in dims):
                return g
        raise InvalidArgument(
            "group_size", f"auto found none of {GROUP_SIZE_CANDIDATES} dividing the input dims {dims}"
        )
    try:
        g = int(requested)
    except (TypeError, ValueError):
        raise InvalidArgument(
            "group_size", f"must be 'auto' or a positive integer, got {requested!r}"
        ) from None
    if g <= 0:
        raise InvalidArgument("group_size", f"must be positive, got {g}")
    bad = [d for d in dims if d % g]
    if bad:
        raise InvalidArgument(
            "group_size", f"{g} does not divide the compressed input dims {bad} (of {dims})"
        )
    return g


def make_plan(
    spec: ModelSpec,
    weights: str,
    group_size: int | str | None = "auto",
    head_precision: str = "int8",
    int8_sym: bool = False,
) -> CompressionPlan:
    if weights not in WEIGHT_FORMATS:
        raise InvalidArgument("weights", f"must be one of {', '.join(WEIGHT_FORMATS)}, got {weights!r}")
    if head_precision not in HEAD_PRECISIONS:
        raise InvalidArgument(
            "head_precision", f"must be one of {', '.join(HEAD_PRECISIONS)}, got {head_precision!r}"
        )
    if weights != "int4":
        if group_size not in (None, "auto"):
            raise InvalidArgument("group_size", f"applies to int4 weights only, not {weights}")
        return CompressionPlan(weights, None, head_precision, int8_sym)
    g = choose_group_size(compressed_input_dims(spec, head_precision), group_size)
    return CompressionPlan(weights, g, head_precision, int8_sym)


def _head_node_names(model: ov.Model) -> list[str]:
    """Friendly names of the embedding Gather and LM-head MatMul (named after their torch modules)."""
    names = []
    for op in model.get_ops():
        n = op.get_friendly_name()
        if (op.get_type_name() == "Gather" and "embed_tokens" in n) or (
            op.get_type_name() == "MatMul" and "lm_head" in n
        ):
            names.append(n)
    return names


def compress_stage(model: ov.Model, plan: CompressionPlan) -> ov.Model:
    """Apply ``plan`` to one converted stage; returns the (possibly new) model."""
    if plan.weights in ("fp16", "fp32"):
        return model
    # NNCF reads NNCF_CI only to turn its usage telemetry off; with no network each send would
    # otherwise wait out a timeout in a background thread and hold the process at exit.
    os.environ.setdefault("NNCF_CI", "1")
    import nncf  # heavy import: only when compressing

    nncf.set_log_level(logging.ERROR)
    heads = _head_node_names(model)
    int8_mode = nncf.CompressWeightsMode.INT8_SYM if plan.int8_sym else nncf.CompressWeightsMode.INT8_ASYM
    if plan.weights == "int8":
        ignored = heads if plan.head_precision in ("fp16", "fp32") else []
        return nncf.compress_weights(
            model, mode=int8_mode, ignored_scope=nncf.IgnoredScope(names=ignored, validate=False)
        )
    # int4: decoder layers (and the head too when head_precision is int4) in one INT4 pass ...
    int4_ignored = [] if plan.head_precision == "int4" else heads
    model = nncf.compress_weights(
        model,
        mode=nncf.CompressWeightsMode.INT4_SYM,
        ratio=1.0,
        group_size=plan.group_size,
        all_layers=True,
        ignored_scope=nncf.IgnoredScope(names=int4_ignored, validate=False),
    )
    # ... then the embedding / LM head alone in INT8 (per channel).
    if plan.head_precision == "int8" and heads:
        layers = [
            op.get_friendly_name() for op in model.get_ops() if op.get_type_name() in ("MatMul", "Gather")
        ]
        model = nncf.compress_weights(
            model,
            mode=int8_mode,
            ignored_scope=nncf.IgnoredScope(names=[n for n in layers if n not in heads], validate=False),
        )
    return model


def weight_precisions(model: ov.Model) -> dict[str, int]:
    """Count of weight constants per element type (for tests and the manifest)."""
    counts: dict[str, int] = {}
    for op in model.get_ops():
        if op.get_type_name() == "Constant" and op.get_output_partial_shape(0).rank.get_length() >= 2:
            t = op.get_output_element_type(0).get_type_name()
            counts[t] = counts.get(t, 0) + 1
    return counts
