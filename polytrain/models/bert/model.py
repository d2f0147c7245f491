"""BERT encoder with its masked-language-model head.

Embeddings are token + learned position + token-type (segment), then LayerNorm.
Blocks are post-norm: x = LN(x + attn(x)), then x = LN(x + ffn(x)), bidirectional
attention with biases and an exact (erf) GELU feed-forward. The MLM head
transforms the final states (dense, GELU, LayerNorm) and projects them on the tied
token table plus a per-token bias.

Module names: tok_embeddings, pos_embeddings, type_embeddings, embed_norm,
layers["0".."n-1"] (attention.{wq,wk,wv,wo}, attention_norm, feed_forward.{w1,w2},
ffn_norm), head_dense, head_norm, output (weight tied to tok_embeddings, own bias).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from polytrain.config import ModelConfig
from polytrain.models.common.attention import Attention
from polytrain.models.common.base import ModelBase, check_resolved
from polytrain.models.common.mlp import ACTIVATIONS, FeedForward

REQUIRED = ("dim", "n_layers", "n_heads", "ffn_dim", "vocab_size", "max_seq_len")


class Block(nn.Module):
    """Post-norm block: x = LN(x + attn(x)), then x = LN(x + ffn(x))."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.attention = Attention(cfg.dim, cfg.n_heads, cfg.n_heads, layer_id, head_dim=cfg.head_dim or None,
                                   bias=True, causal=False, dropout=cfg.dropout)
        self.attention_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim, cfg.activation, gated=False, bias=True,
                                        dropout=cfg.dropout)
        self.ffn_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, T, dim) -> (B, T, dim); mask (B, 1, 1, T) True = a real key, None = all real."""
        x = self.attention_norm(x + self.attention(x, mask=mask))
        return self.ffn_norm(x + self.feed_forward(x))


class Bert(ModelBase):
    """Masked LM: tokens (B, T) [+ token types, padding mask] -> logits (B, T, vocab_size).

    Initialisation: LayerNorm gains 1 and biases 0 (the output bias too), every other
    weight N(0, 0.02), as BERT's; no depth scaling, which post-norm does not need.
    """

    lookup_tables = ("tok_embeddings", "pos_embeddings", "type_embeddings")
    residual_out = ()

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        check_resolved(cfg, REQUIRED)
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_embeddings = nn.Embedding(cfg.max_seq_len, cfg.dim)
        self.type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.dim)
        self.embed_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.dropout = nn.Dropout(cfg.dropout)  # after the embeddings' LayerNorm, as BERT's
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.n_layers)})
        self.head_dense = nn.Linear(cfg.dim, cfg.dim)
        self.head_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=True)
        self.tie_weights()
        self._record_shapes()

    def forward(self, tokens: torch.Tensor, token_types: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (B, T) -> MLM logits (B, T, vocab_size).

        token_types (B, T): segment ids (None = all 0). attention_mask (B, T): 1 for real
        tokens, 0 for padding, which no token attends to (None = no padding). On a pipeline
        stage without tok_embeddings `tokens` is hidden states; without output, hidden
        states (after the head's transform when it is present) are returned.
        """
        T = tokens.shape[1]
        if T > self.cfg.max_seq_len:
            raise ValueError(f"{T} tokens exceed model.max_seq_len = {self.cfg.max_seq_len} "
                             "(the learned position table)")
        if self.tok_embeddings is not None:
            if token_types is None:
                token_types = torch.zeros_like(tokens)
            positions = torch.arange(T, device=tokens.device)  # (T,)
            h = self.tok_embeddings(tokens) + self.type_embeddings(token_types) + self.pos_embeddings(positions)
            h = self.dropout(self.embed_norm(h))  # (B, T, dim)
        else:
            h = tokens
        mask = None
        if attention_mask is not None:
            mask = attention_mask.bool()[:, None, None, :]  # (B, 1, 1, T): keys that may be attended
        for layer in self.layers.values():
            h = layer(h, mask)
        if self.head_dense is not None:
            h = self.head_norm(ACTIVATIONS[self.cfg.activation](self.head_dense(h)))
        return self.output(h) if self.output is not None else h


def build(cfg: ModelConfig) -> Bert:
    """Registry entry point: a BERT MLM with this (resolved) config, on the current default device."""
    return Bert(cfg)
