"""Multi-head attention on top of F.scaled_dot_product_attention, for every architecture.

One class covers the variants the model zoo needs: grouped-query heads (Llama,
InternLM2), projection biases (GPT-2, BERT), rotary positions or none (learned
positions are added to the embeddings instead), bidirectional attention (BERT,
T5's encoder) and an unscaled score with an additive bias (T5). Subclasses change
only how q, k and v are projected (InternLM2's packed wqkv, T5's cross-attention).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from polytrain.models.common.documents import DocumentMask
from polytrain.models.common.kv_cache import KVCache
from polytrain.models.common.rope import apply_rope


class Attention(nn.Module):
    """Multi-head attention where n_kv_heads key/value heads are shared by groups of query heads.

    Head counts are read from tensor shapes in `forward`, not from the constructor,
    so the same code runs when tensor parallelism leaves each rank a slice of the heads.
    """

    decode_kernel: Callable[..., torch.Tensor | None] | None = None
    """Set by inference while it generates (backend.host_attention.decode_attention on the host):
    (q (B, Hkv, G, D), k, v (B, Hkv, S, D), mask, scale) -> (B, Hkv, G, D), or None where it does
    not apply; decoding's one-query attention of grouped heads (`_one_query_per_group`) goes to it
    first."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, layer_id: int, *,
                 head_dim: int | None = None, bias: bool = False, causal: bool = True,
                 scale: float | None = None, dropout: float = 0.0):
        """head_dim: per-head size (default dim // n_heads); bias: on every projection;
        causal: decoder (True) or bidirectional (False) when no mask is given;
        scale: multiplies q k^T (default 1/sqrt(head_dim); T5 uses 1);
        dropout: on the attention weights and on the output, in training."""
        super().__init__()
        if n_heads % n_kv_heads:
            raise ValueError(f"n_kv_heads = {n_kv_heads} must divide n_heads = {n_heads}")
        self.head_dim = head_dim or dim // n_heads
        self.layer_id = layer_id  # which slot of a KVCache this layer owns
        self.causal = causal
        self.scale = scale
        self._projections(dim, n_heads, n_kv_heads, bias)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=bias)
        self.dropout = dropout  # on the attention weights, in training
        self.resid_dropout = nn.Dropout(dropout)  # on the output, before it joins the residual stream

    def _projections(self, dim: int, n_heads: int, n_kv_heads: int, bias: bool) -> None:
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=bias)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=bias)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=bias)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, T, dim) -> q (B, T, H, D), k and v (B, T, Hkv, D)."""
        B, T, _ = x.shape
        return (self.wq(x).view(B, T, -1, self.head_dim), self.wk(x).view(B, T, -1, self.head_dim),
                self.wv(x).view(B, T, -1, self.head_dim))

    def forward(self, x: torch.Tensor, rope_cos: torch.Tensor | None = None,
                rope_sin: torch.Tensor | None = None, cache: KVCache | None = None,
                start_pos: int = 0, mask: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, T, dim) -> (B, T, dim).

        rope_cos/rope_sin: (T, D/2) or (B, T, D/2) for these tokens' positions; None = no RoPE.
        mask: boolean (B or 1, 1, T, S), True = may attend, or additive float
        (B or 1, H or 1, T, S), or a DocumentMask (packed documents, no cache);
        None = causal (or full, for a bidirectional layer).
        """
        B, T, _ = x.shape
        q, k, v = self.project(x)
        if rope_cos is not None:
            q = apply_rope(q, rope_cos, rope_sin)
            k = apply_rope(k, rope_cos, rope_sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, D)
        if cache is not None:
            k, v = cache.update(self.layer_id, k, v, start_pos)  # (B, Hkv, S, D)
        out = self.core(q, k, v, mask)
        out = out.transpose(1, 2).reshape(B, T, -1)  # (B, T, H * D)
        return self.resid_dropout(self.wo(out))

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             mask: torch.Tensor | None) -> torch.Tensor:
        """softmax(scale q k^T + mask) v: q (B, H, T, D), k and v (B, Hkv, S, D) -> (B, H, T, D).

        Its own method so selective activation checkpointing can recompute just this
        part, whose saved activations grow with T * S, and so context parallelism can
        replace it (it sees the key/value heads before they are repeated for the queries).
        """
        if isinstance(mask, DocumentMask):
            mask = mask.dense(self.causal)
        if self._one_query_per_group(q, k, mask):
            # Decoding one token: the G query heads that share a key/value head become that head's
            # G rows of queries, (B, H, 1, D) -> (B, Hkv, G, D), and the cache's keys and values
            # are read as they are instead of copied G times over (all S slots, every layer, every step).
            B, H, _, D = q.shape
            q = q.reshape(B, k.shape[1], H // k.shape[1], D)  # (B, Hkv, G, D)
            out = None if self.decode_kernel is None else self.decode_kernel(q, k, v, mask, self.scale)
            if out is None and torch.compiler.is_compiling() and q.device.type == "cpu":
                out = attention_as_sums(q, k, v, mask, self.scale)
            elif out is None:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
            return out.view(B, H, 1, D)
        k, v = repeat_kv(q, k, v)
        causal = self.causal and mask is None and q.shape[2] > 1
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=self.scale,
                                              dropout_p=self.dropout if self.training else 0.0)

    def _one_query_per_group(self, q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> bool:
        """Whether a query head group can be folded into rows of queries of its shared kv head:
        one query position (decoding), several query heads per kv head, a mask the same for every
        head and query (B or 1, 1, 1, S) or none, and no attention dropout."""
        return (q.shape[2] == 1 and q.shape[1] > k.shape[1]
                and (mask is None or (mask.dim() == 4 and mask.shape[1] == 1 and mask.shape[2] == 1))
                and not (self.training and self.dropout))


def attention_as_sums(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                      scale: float | None) -> torch.Tensor:
    """softmax(scale q k^T + mask) v as broadcast products and sums: q (B, Hkv, G, D), k and v
    (B, Hkv, S, D), mask (B or 1, 1, 1, S) boolean (True = may attend) or additive -> (B, Hkv, G, D).
    16-bit inputs are summed in fp32 and the output rounded once, as SDPA's kernels accumulate.

    For a compiled decoding step on the host: Inductor fuses these with the cache write before
    them into one vectorised loop nest over (B, Hkv), where its SDPA stays a call of ATen's
    flash kernel, slower at decoding's few queries (llama 125m at batch 8, a profile of the
    step: 140 us a layer against 185 us; in bf16 at batch 1, 58.9 against 54.2 tokens/s on an Ice
    Lake Xeon, medians of 7 alternating calls). Eager, the products would be materialised,
    (B, Hkv, G, S, D): eager decoding keeps SDPA.
    """
    dtype = q.dtype
    q, k, v = q.float(), k.float(), v.float()  # fused into the loops that read them: no fp32 copies
    scores = (q.unsqueeze(-2) * k.unsqueeze(-3)).sum(-1) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if mask is not None:  # (B, Hkv, G, S)
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return (scores.softmax(-1).unsqueeze(-1) * v.unsqueeze(-3)).sum(-2).to(dtype)


def repeat_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v (B, Hkv, S, D) repeated to q's head count (B, H, S, D); query head h reads kv head h // (H / Hkv)."""
    n_rep = q.shape[1] // k.shape[1]
    if n_rep == 1:
        return k, v
    # Explicit repeat rather than SDPA's enable_gqa: not every backend or
    # DTensor sharding rule supports that flag.
    return k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
