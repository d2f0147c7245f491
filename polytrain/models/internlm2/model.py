"""InternLM2 decoder: Llama's architecture with one packed query/key/value projection.

Module names are InternLM2's own: tok_embeddings, layers["0".."n-1"] (attention_norm,
attention.{wqkv,wo}, ffn_norm, feed_forward.{w1,w2,w3}), norm, output, so its
checkpoints map one to one. RoPE as Llama (rotate-half), usually theta = 1e6 with
dynamic NTK scaling past the pre-training length (model.rope_scaling = "dynamic").

wqkv packs the heads grouped by key/value head, as InternLM2's checkpoints store them:
its output rows are n_kv_heads groups of (n_rep query heads, then the key head, then
the value head), each head_dim rows, n_rep = n_heads / n_kv_heads:

    rows = [q(g0,0) .. q(g0,n_rep-1), k(g0), v(g0), q(g1,0) .. , k(g1), v(g1), ...]

Query head h = g * n_rep + r belongs to group g = h // n_rep, the same sharing rule
as Llama's grouped-query attention, so tensor parallelism can split wqkv by whole
groups and each rank keeps its query heads together with their key and value.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from polytrain.config import ModelConfig
from polytrain.models.common.attention import Attention
from polytrain.models.common.base import head_dim
from polytrain.models.llama.model import Block, Llama


class PackedAttention(Attention):
    """Grouped-query attention whose q, k and v come from one grouped `wqkv` projection."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        self.n_rep = cfg.n_heads // cfg.n_kv_heads  # query heads per key/value head
        super().__init__(cfg.dim, cfg.n_heads, cfg.n_kv_heads, layer_id, head_dim=head_dim(cfg),
                         dropout=cfg.dropout)

    def _projections(self, dim: int, n_heads: int, n_kv_heads: int, bias: bool) -> None:
        self.wqkv = nn.Linear(dim, (n_heads + 2 * n_kv_heads) * self.head_dim, bias=bias)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, T, dim) -> q (B, T, H, D), k and v (B, T, Hkv, D) from the grouped rows of wqkv."""
        B, T, _ = x.shape
        groups = self.wqkv(x).view(B, T, -1, self.n_rep + 2, self.head_dim)  # (B, T, Hkv, n_rep+2, D)
        q = groups[:, :, :, :self.n_rep].reshape(B, T, -1, self.head_dim)  # (B, T, Hkv * n_rep, D)
        return q, groups[:, :, :, -2], groups[:, :, :, -1]


class InternLM2Block(Block):
    @staticmethod
    def make_attention(cfg: ModelConfig, layer_id: int) -> Attention:
        return PackedAttention(cfg, layer_id)


class InternLM2(Llama):
    """Decoder-only language model; forward maps tokens (B, T) to logits (B, T, vocab_size)."""

    block_class = InternLM2Block


def build(cfg: ModelConfig) -> InternLM2:
    """Registry entry point: an InternLM2 with this (resolved) config, on the current default device."""
    return InternLM2(cfg)
