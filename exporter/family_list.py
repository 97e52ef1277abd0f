"""`pipeshard model list`: the families the exporter knows, what each adds to the Llama shape,
and where weights of each come from (real weights pipeshard installs, synthetic shapes)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from pipeshard.exporter.families import FAMILIES, Family
from pipeshard.model.shapes import SHAPES


@dataclass(frozen=True)
class FamilyRow:
    """One line of the listing."""

    family: str
    features: tuple[str, ...]
    real_weights: str | None
    shapes: tuple[str, ...]

    def render(self) -> str:
        sources = []
        if self.real_weights:
            sources.append(f"real weights: {self.real_weights}")
        if self.shapes:
            sources.append(f"synthetic shapes: {', '.join(self.shapes)}")
        features = ", ".join(self.features) or "-"
        return f"{self.family:<12} {features:<36} {'; '.join(sources) or 'bring a Hugging Face folder'}"


def _features(family: Family) -> tuple[str, ...]:
    out = []
    if family.qkv_bias is True:
        out.append("qkv bias")
    elif family.qkv_bias:
        out.append(f"bias if {family.qkv_bias}")
    if family.qk_norm:
        out.append("QK-norm")
    if family.qkv_proj or family.gate_up_proj:
        out.append("fused qkv, gate-up")
    if family.pre_mlp_norm:
        out.append("four norms")
    if family.embed_scaled:
        out.append("scaled embedding")
    if family.local_rope_theta:
        out.append("local/global layers")
    if family.num_experts:
        out.append("routed experts")
    return tuple(out)


def family_rows() -> list[FamilyRow]:
    """Every family the exporter supports, in name order."""
    return [
        FamilyRow(
            family=name,
            features=_features(family),
            real_weights=family.real_weights,
            shapes=tuple(s.name for s in SHAPES.values() if s.model_type == name),
        )
        for name, family in sorted(FAMILIES.items())
    ]


def register(subparsers: argparse._SubParsersAction) -> None:
    """Adds ``list`` to the ``model`` command (registered before this module)."""
    model = subparsers.choices["model"]
    model_sub = next(a for a in model._actions if isinstance(a, argparse._SubParsersAction))
    listing = model_sub.add_parser("list", help="the model families the exporter supports, and their weights")
    listing.set_defaults(func=run_list)


def run_list(args: argparse.Namespace) -> int:
    print(f"{'family':<12} {'beyond the Llama shape':<36} weights")
    for row in family_rows():
        print(row.render())
    return 0
