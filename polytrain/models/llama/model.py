"""Llama-style decoder: RMSNorm, rotary grouped-query attention, SwiGLU, no biases.

Module names are part of the contract with sharding, pipeline splitting and
checkpoints: tok_embeddings, layers["0".."n-1"] (attention_norm, attention.{wq,wk,wv,wo},
ffn_norm, feed_forward.{w1,w2,w3}), norm, output. A pipeline stage may set
tok_embeddings, norm and output to None; forward then takes or returns hidden states.

Covers Llama 1-3 checkpoints: grouped-query attention, tied or untied output,
model.head_dim different from dim / n_heads, and RoPE scaling (linear, dynamic
NTK, Llama 3.1's "llama3") through the model.rope_* fields.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from polytrain.config import ModelConfig
from polytrain.models.common.attention import Attention
from polytrain.models.common.base import ModelBase, check_resolved, head_dim
from polytrain.models.common.documents import attention_mask
from polytrain.models.common.kv_cache import KVCache
from polytrain.models.common.mlp import FeedForward
from polytrain.models.common.norms import RMSNorm
from polytrain.models.common.rope import RopeScaling, rope_for_length, rope_tables

REQUIRED = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "max_seq_len")


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + ffn(norm(x))."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = self.make_attention(cfg, layer_id)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim, cfg.activation, gated=True, dropout=cfg.dropout)

    @staticmethod
    def make_attention(cfg: ModelConfig, layer_id: int) -> Attention:
        return Attention(cfg.dim, cfg.n_heads, cfg.n_kv_heads, layer_id, head_dim=head_dim(cfg),
                         dropout=cfg.dropout)

    def forward(self, x: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor,
                cache: KVCache | None = None, start_pos: int = 0,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, T, dim) -> (B, T, dim); see Attention.forward for the other arguments."""
        x = x + self.attention(self.attention_norm(x), rope_cos, rope_sin, cache, start_pos, mask)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(ModelBase):
    """Decoder-only language model; forward maps tokens (B, T) to logits (B, T, vocab_size).

    Initialisation (ModelBase's): norm gains are ones; embeddings and projections are
    N(0, 0.02), with the residual output projections (attention.wo, feed_forward.w2)
    scaled by 1/sqrt(2 n_layers) so the residual stream's variance does not grow with depth.
    """

    block_class = Block

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        check_resolved(cfg, REQUIRED)
        if (cfg.head_dim == 0 and cfg.dim % cfg.n_heads) or head_dim(cfg) % 2:
            raise ValueError(f"dim = {cfg.dim} must split into n_heads = {cfg.n_heads} heads of even size")
        self.cfg = cfg
        self.rope_scaling = RopeScaling.from_config(cfg)
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.dropout = nn.Dropout(cfg.dropout)  # on the embeddings (GPT-style; no-op at 0)
        self.layers = nn.ModuleDict({str(i): self.block_class(cfg, i) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.tie_weights()
        # Derived from cfg, so kept out of checkpoints; init_buffers rebuilds them.
        cos, sin = rope_tables(head_dim(cfg), cfg.max_seq_len, cfg.rope_theta, scaling=self.rope_scaling)
        self.register_buffer("rope_cos", cos, persistent=False)  # (max_seq_len, head_dim // 2)
        self.register_buffer("rope_sin", sin, persistent=False)
        self._record_shapes()

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None, start_pos: int = 0,
                positions: torch.Tensor | None = None, documents: torch.Tensor | None = None,
                logits_at: int | None = None) -> torch.Tensor:
        """tokens (B, T) -> logits (B, T, vocab_size), in the dtype the output projection produces.

        With a cache, the tokens occupy slots start_pos..start_pos+T-1 and attend to
        every earlier cached slot. On a pipeline stage without tok_embeddings, `tokens`
        is already hidden states (B, T, dim); without output, hidden states are returned.
        positions (T,) or (B, T): each token's RoPE position where it is not its slot (packed
        documents restart at 0; a shard of a longer sequence keeps its global positions).
        documents (B, T): document ids of packed sequences (no cache); attention stays
        inside each document (models/common/documents.py).
        logits_at: the logits (B, 1, vocab_size) of this position alone (-1: the last, all a prefill
        samples from; the output projection over every prompt token is a fifth of llama 125m's
        prefill, and its (B, T, vocab) logits the largest tensor of a long prompt's).
        """
        T = tokens.shape[1]
        end = start_pos + T if positions is None else int(positions.max()) + 1
        if end > self.cfg.max_seq_len:
            raise ValueError(f"positions up to {end} exceed model.max_seq_len = "
                             f"{self.cfg.max_seq_len}")
        h = tokens  # a stage without the embedding receives hidden states (B, T, dim)
        if self.tok_embeddings is not None:
            h = self.dropout(self.tok_embeddings(tokens))  # (B, T, dim)
        rope_cos, rope_sin, mask = self.attention_inputs(T, cache, start_pos, h.device, positions, documents)
        for layer in self.layers.values():
            h = layer(h, rope_cos, rope_sin, cache, start_pos, mask)
        if logits_at is not None:
            h = h.narrow(1, logits_at % T, 1)  # (B, 1, dim)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h

    def attention_inputs(self, seqlen: int, cache: KVCache | None, start_pos: int, device: torch.device,
                         positions: torch.Tensor | None = None, documents: torch.Tensor | None = None):
        """RoPE cos/sin, (T, D/2) or per-row (B, T, D/2), and the attention mask (None = causal)."""
        mask = attention_mask(seqlen, cache, start_pos, documents, device)
        if positions is None and cache is not None:
            positions = cache.positions(start_pos, seqlen, device)
        end = start_pos + seqlen
        # Dynamic NTK scaling picks its tables by the longest position in use, as HF does.
        longest = end if positions is None or self.rope_scaling.kind != "dynamic" else int(positions.max()) + 1
        cos, sin = rope_for_length(self.rope_cos, self.rope_sin, longest, self.cfg.rope_theta,
                                   self.rope_scaling)
        if positions is None:  # every row's positions are its slots
            return cos[start_pos:end], sin[start_pos:end], mask
        return cos[positions], sin[positions], mask

    def init_buffers(self) -> None:
        """Recompute the RoPE tables on the device the buffers are on now (after to_empty)."""
        cos, sin = rope_tables(head_dim(self.cfg), self.cfg.max_seq_len, self.cfg.rope_theta,
                               device=self.rope_cos.device, scaling=self.rope_scaling)
        self.rope_cos, self.rope_sin = cos, sin


def build(cfg: ModelConfig) -> Llama:
    """Registry entry point: a Llama with this (resolved) config, on the current default device."""
    return Llama(cfg)
