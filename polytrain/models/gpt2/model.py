"""GPT-2 decoder: learned positions, pre-LayerNorm with biases, GELU (tanh) MLP, tied output.

Module names: tok_embeddings, pos_embeddings, layers["0".."n-1"] (attention_norm,
attention.{wq,wk,wv,wo}, ffn_norm, feed_forward.{w1,w2}), norm, output. Every linear
layer and norm has a bias. A pipeline stage may set tok_embeddings (then also
pos_embeddings), norm and output to None; forward then takes or returns hidden states.

Hugging Face stores GPT-2's projections as Conv1D (weight (in, out), q/k/v packed in
c_attn); polytrain.models.gpt2.hf transposes and splits them, so this module is
plain nn.Linear throughout.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from polytrain.config import ModelConfig
from polytrain.models.common.attention import Attention
from polytrain.models.common.base import ModelBase, check_resolved
from polytrain.models.common.documents import attention_mask
from polytrain.models.common.kv_cache import KVCache
from polytrain.models.common.mlp import FeedForward

REQUIRED = ("dim", "n_layers", "n_heads", "ffn_dim", "vocab_size", "max_seq_len")


class Block(nn.Module):
    """Pre-norm block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.attention_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg.dim, cfg.n_heads, cfg.n_heads, layer_id, head_dim=cfg.head_dim or None,
                                   bias=True, dropout=cfg.dropout)
        self.ffn_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim, cfg.activation, gated=False, bias=True,
                                        dropout=cfg.dropout)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, start_pos: int = 0,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, T, dim) -> (B, T, dim); see Attention.forward for the other arguments."""
        x = x + self.attention(self.attention_norm(x), None, None, cache, start_pos, mask)
        return x + self.feed_forward(self.ffn_norm(x))


class GPT2(ModelBase):
    """Decoder-only language model; forward maps tokens (B, T) to logits (B, T, vocab_size).

    Initialisation (ModelBase's, as GPT-2's paper): LayerNorm gains 1 and biases 0,
    weights N(0, 0.02), attention.wo and feed_forward.w2 scaled by 1/sqrt(2 n_layers).
    """

    lookup_tables = ("tok_embeddings", "pos_embeddings")

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        check_resolved(cfg, REQUIRED)
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_embeddings = nn.Embedding(cfg.max_seq_len, cfg.dim)
        self.dropout = nn.Dropout(cfg.dropout)  # on the summed embeddings, as GPT-2's embd_pdrop
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.n_layers)})
        self.norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.tie_weights()
        self._record_shapes()

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None, start_pos: int = 0,
                positions: torch.Tensor | None = None, documents: torch.Tensor | None = None,
                logits_at: int | None = None) -> torch.Tensor:
        """tokens (B, T) -> logits (B, T, vocab_size); a KV cache, positions, documents and
        logits_at (the logits (B, 1, vocab_size) of one position) work as for Llama.

        Left-padded rows (cache.pad) take their positions from their first real token,
        as the row alone would.
        """
        T = tokens.shape[1]
        end = start_pos + T if positions is None else int(positions.max()) + 1
        if end > self.cfg.max_seq_len:
            raise ValueError(f"positions up to {end} exceed model.max_seq_len = "
                             f"{self.cfg.max_seq_len} (the learned position table)")
        if self.tok_embeddings is not None:
            device = tokens.device
            if positions is None and cache is not None:
                positions = cache.positions(start_pos, T, device)
            if positions is None:
                positions = torch.arange(start_pos, start_pos + T, device=device)  # (T,)
            h = self.dropout(self.tok_embeddings(tokens) + self.pos_embeddings(positions))  # (B, T, dim)
        else:
            h = tokens
        mask = attention_mask(T, cache, start_pos, documents, h.device)
        for layer in self.layers.values():
            h = layer(h, cache, start_pos, mask)
        if logits_at is not None:
            h = h.narrow(1, logits_at % T, 1)  # (B, 1, dim)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h


def build(cfg: ModelConfig) -> GPT2:
    """Registry entry point: a GPT-2 with this (resolved) config, on the current default device."""
    return GPT2(cfg)
