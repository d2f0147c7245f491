"""Rotary position embeddings with real-valued cos/sin tables.

Complex tensors are avoided on purpose: they are not supported by every
accelerator, by DTensor sharding rules or by autocast.

Convention: the head dimension is split into halves (x1, x2) and each pair
(x1[i], x2[i]) is rotated by angle pos * theta^(-2i/D) (the "rotate half"
layout, as in Hugging Face Llama checkpoints).
"""

from __future__ import annotations

import torch


def rope_tables(head_dim: int, max_len: int, theta: float,
                device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each (max_len, head_dim // 2) fp32, for positions 0..max_len-1."""
    # fp32 rather than fp64: some accelerators have no fp64.
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    pos = torch.arange(max_len, device=device, dtype=torch.float32)
    angles = torch.outer(pos, inv_freq)  # (max_len, head_dim // 2)
    return angles.cos(), angles.sin()


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
