"""Grouped-query self-attention on top of F.scaled_dot_product_attention."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from polytrain.models.common.kv_cache import KVCache
from polytrain.models.common.rope import apply_rope


class Attention(nn.Module):
    """Multi-head attention where n_kv_heads key/value heads are shared by groups of query heads.

    Head counts are read from tensor shapes in `forward`, not from the constructor,
    so the same code runs when tensor parallelism leaves each rank a slice of the heads.
    """

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, layer_id: int, dropout: float = 0.0):
        super().__init__()
        if n_heads % n_kv_heads:
            raise ValueError(f"n_kv_heads = {n_kv_heads} must divide n_heads = {n_heads}")
        self.head_dim = dim // n_heads
        self.layer_id = layer_id  # which slot of a KVCache this layer owns
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)
        self.dropout = dropout  # on the attention weights, in training
        self.resid_dropout = nn.Dropout(dropout)  # on the output, before it joins the residual stream

    def forward(self, x: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor,
                cache: KVCache | None = None, start_pos: int = 0,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, T, dim) -> (B, T, dim).

        rope_cos/rope_sin: (T, D/2) or (B, T, D/2) for these tokens' positions.
        mask: boolean (B or 1, 1, T, S), True = may attend; None = causal.
        """
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, -1, self.head_dim)  # (B, T, H, D)
        k = self.wk(x).view(B, T, -1, self.head_dim)  # (B, T, Hkv, D)
        v = self.wv(x).view(B, T, -1, self.head_dim)  # (B, T, Hkv, D)
        q = apply_rope(q, rope_cos, rope_sin)
        k = apply_rope(k, rope_cos, rope_sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, D)
        if cache is not None:
            k, v = cache.update(self.layer_id, k, v, start_pos)  # (B, Hkv, S, D)
        n_rep = q.shape[1] // k.shape[1]
        if n_rep > 1:
            # Explicit repeat rather than SDPA's enable_gqa: not every backend or
            # DTensor sharding rule supports that flag.
            k = k.repeat_interleave(n_rep, dim=1)  # (B, H, S, D)
            v = v.repeat_interleave(n_rep, dim=1)
        out = self.core(q, k, v, mask)
        out = out.transpose(1, 2).reshape(B, T, -1)  # (B, T, H * D)
        return self.resid_dropout(self.wo(out))

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             mask: torch.Tensor | None) -> torch.Tensor:
        """softmax(q k^T / sqrt(D)) v: q (B, H, T, D), k and v (B, H, S, D) -> (B, H, T, D).

        Its own method so selective activation checkpointing can recompute just this
        part, whose saved activations grow with T * S.
        """
        causal = mask is None and q.shape[2] > 1
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                              dropout_p=self.dropout if self.training else 0.0)
