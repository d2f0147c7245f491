"""Rotary position embeddings with real-valued cos/sin tables, and their context-extension variants.

Complex tensors are avoided on purpose: they are not supported by every
accelerator, by DTensor sharding rules or by autocast.

Convention: the head dimension is split into halves (x1, x2) and each pair
(x1[i], x2[i]) is rotated by angle pos * inv_freq[i], inv_freq[i] = theta^(-2i/D)
(the "rotate half" layout, as in Hugging Face Llama and InternLM2 checkpoints).

Scaling variants change inv_freq (or, for dynamic NTK, theta) so a model reaches
beyond the context it was pre-trained at:
- linear: every frequency divided by `factor` (position interpolation);
- llama3: long wavelengths divided by `factor`, short ones kept, a smooth blend between
  (Llama 3.1's rule, parametrised by low/high frequency factors and the original length);
- dynamic: theta grows with the sequence length once it exceeds the original length
  (NTK-aware scaling, InternLM2's and HF's "dynamic"); unchanged up to that length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RopeScaling:
    """How RoPE frequencies are adapted to a longer context; kind "none" leaves them alone."""

    kind: str = "none"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_len: int = 0

    @classmethod
    def from_config(cls, cfg) -> RopeScaling:
        """From a ModelConfig's rope_* fields (original_max_len 0 means max_seq_len)."""
        return cls(cfg.rope_scaling, cfg.rope_scaling_factor, cfg.rope_low_freq_factor,
                   cfg.rope_high_freq_factor, cfg.rope_original_max_len or cfg.max_seq_len)


def inv_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None,
                    device: torch.device | str | None = None) -> torch.Tensor:
    """inv_freq (head_dim // 2,) fp32: the rotation speed of each pair of channels."""
    # fp32 rather than fp64: some accelerators have no fp64.
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    if scaling is None or scaling.kind in ("none", "dynamic"):
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "llama3":
        return _llama3(inv_freq, scaling)
    raise ValueError(f"unknown RoPE scaling {scaling.kind!r}")


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1: wavelengths longer than original/low are slowed by `factor`, those shorter
    than original/high are kept, and the band between is a linear blend in original/wavelength."""
    wavelen = 2 * math.pi / inv_freq  # (D/2,) in positions
    slowed = inv_freq / s.factor
    blend = (s.original_max_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    mixed = (1 - blend) * slowed + blend * inv_freq
    long = wavelen > s.original_max_len / s.low_freq_factor
    short = wavelen < s.original_max_len / s.high_freq_factor
    return torch.where(long, slowed, torch.where(short, inv_freq, mixed))


def dynamic_theta(theta: float, head_dim: int, scaling: RopeScaling, seq_len: int) -> float:
    """NTK-aware base for a sequence of seq_len positions (> original_max_len)."""
    grow = scaling.factor * seq_len / scaling.original_max_len - (scaling.factor - 1)
    return theta * grow ** (head_dim / (head_dim - 2))


def rope_tables(head_dim: int, max_len: int, theta: float,
                device: torch.device | str | None = None,
                scaling: RopeScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each (max_len, head_dim // 2) fp32, for positions 0..max_len-1.

    For dynamic scaling these are the tables of sequences up to the original length;
    `rope_for_length` gives the ones of a longer sequence.
    """
    inv_freq = inv_frequencies(head_dim, theta, scaling, device)
    pos = torch.arange(max_len, device=device, dtype=torch.float32)
    angles = torch.outer(pos, inv_freq)  # (max_len, head_dim // 2)
    return angles.cos(), angles.sin()


def rope_for_length(cos: torch.Tensor, sin: torch.Tensor, seq_len: int, theta: float,
                    scaling: RopeScaling | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The tables a sequence of `seq_len` positions uses: the precomputed ones, except under
    dynamic scaling past the original length, where theta depends on seq_len."""
    if scaling is None or scaling.kind != "dynamic" or seq_len <= scaling.original_max_len:
        return cos, sin
    head_dim = 2 * cos.shape[-1]
    return rope_tables(head_dim, seq_len, dynamic_theta(theta, head_dim, scaling, seq_len), cos.device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, T, H, D) by the angles in cos/sin.

    cos and sin are (T, D/2) when every row has the same positions, or (B, T, D/2)
    for per-row positions (left-padded batches). The rotation runs in fp32 and the
    result is cast back to x's dtype.
    """
    cos = cos.unsqueeze(-2)  # (T, 1, D/2) or (B, T, 1, D/2): broadcast over heads
    sin = sin.unsqueeze(-2)
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)  # (B, T, H, D/2) each
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)
