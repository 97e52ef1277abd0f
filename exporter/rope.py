"""Rotary inverse frequencies, plain or with a family's scaling (one place for both sides of the
stage module: its constructor and the weights-assigned rebuild)."""

from __future__ import annotations

import math

import torch

from pipeshard.exporter.families import ModelSpec


def inv_freq(spec: ModelSpec, local: bool = False) -> torch.Tensor:
    """``1 / theta^(2i/d)``, then Llama 3.x's scaling when the spec has it; ``local``: the
    sliding-window layers' own base (Gemma 3's ``rope_local_base_freq``), never scaled.

    llama3: wavelengths longer than ``original / low_freq_factor`` are stretched by ``factor``,
    those shorter than ``original / high_freq_factor`` kept, and the band between blended
    linearly in ``original / wavelength`` (as the published models were trained)."""
    d = spec.head_dim
    theta = spec.local_rope_theta if local and spec.local_rope_theta else spec.rope_theta
    base = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    rope = spec.rope_scaling
    if rope is None or local:
        return base
    wavelen = 2 * math.pi / base
    low_wavelen = rope.original_max_positions / rope.low_freq_factor
    high_wavelen = rope.original_max_positions / rope.high_freq_factor
    scaled = torch.where(wavelen > low_wavelen, base / rope.factor, base)
    smooth = (rope.original_max_positions / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)
