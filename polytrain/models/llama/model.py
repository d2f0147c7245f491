"""Llama-style decoder: RMSNorm, rotary grouped-query attention, SwiGLU, no biases.

Module names are part of the contract with sharding, pipeline splitting and
checkpoints: tok_embeddings, layers["0".."n-1"] (attention_norm, attention.{wq,wk,wv,wo},
ffn_norm, feed_forward.{w1,w2,w3}), norm, output. A pipeline stage may set
tok_embeddings, norm and output to None; forward then takes or returns hidden states.
"""

from __future__ import annotations

import math
import re

import torch
import torch.nn as nn

from polytrain.config import ModelConfig
from polytrain.models.common.attention import Attention
from polytrain.models.common.kv_cache import KVCache
from polytrain.models.common.mlp import SwiGLU
from polytrain.models.common.norms import RMSNorm
from polytrain.models.common.rope import rope_tables

INIT_STD = 0.02

# Projections that write into the residual stream; their init is scaled down with depth.
_RESIDUAL_OUT = {"attention.wo.weight", "feed_forward.w2.weight"}
_BLOCK_NAME = re.compile(r"layers\.(\d+)\.(.+)")


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + ffn(norm(x))."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg.dim, cfg.n_heads, cfg.n_kv_heads, layer_id, cfg.dropout)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = SwiGLU(cfg.dim, cfg.ffn_dim, cfg.dropout)

    def forward(self, x: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor,
                cache: KVCache | None = None, start_pos: int = 0,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, T, dim) -> (B, T, dim); see Attention.forward for the other arguments."""
        x = x + self.attention(self.attention_norm(x), rope_cos, rope_sin, cache, start_pos, mask)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """Decoder-only language model; forward maps tokens (B, T) to logits (B, T, vocab_size)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        unset = [k for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size",
                             "max_seq_len") if getattr(cfg, k) <= 0]
        if unset:
            raise ValueError(f"model fields {', '.join(unset)} are unset; resolve the size preset "
                             "first (polytrain.config.resolve_model)")
        if cfg.dim % cfg.n_heads or (cfg.dim // cfg.n_heads) % 2:
            raise ValueError(f"dim = {cfg.dim} must split into n_heads = {cfg.n_heads} heads of even size")
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.dropout = nn.Dropout(cfg.dropout)  # on the embeddings (GPT-style; no-op at 0)
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Derived from cfg, so kept out of checkpoints; init_buffers rebuilds them.
        cos, sin = rope_tables(cfg.dim // cfg.n_heads, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)  # (max_seq_len, head_dim // 2)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None,
                start_pos: int = 0) -> torch.Tensor:
        """tokens (B, T) -> logits (B, T, vocab_size), in the dtype the output projection produces.

        With a cache, the tokens occupy slots start_pos..start_pos+T-1 and attend to
        every earlier cached slot. On a pipeline stage without tok_embeddings, `tokens`
        is already hidden states (B, T, dim); without output, hidden states are returned.
        """
        T = tokens.shape[1]
        if start_pos + T > self.cfg.max_seq_len:
            raise ValueError(f"positions up to {start_pos + T} exceed model.max_seq_len = "
                             f"{self.cfg.max_seq_len}")
        h = tokens  # a stage without the embedding receives hidden states (B, T, dim)
        if self.tok_embeddings is not None:
            h = self.dropout(self.tok_embeddings(tokens))  # (B, T, dim)
        rope_cos, rope_sin, mask = self._attention_inputs(T, cache, start_pos, h.device)
        for layer in self.layers.values():
            h = layer(h, rope_cos, rope_sin, cache, start_pos, mask)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h

    def _attention_inputs(self, seqlen: int, cache: KVCache | None, start_pos: int,
                          device: torch.device):
        """RoPE cos/sin, (T, D/2) or per-row (B, T, D/2), and the attention mask (None = causal)."""
        positions = cache.positions(start_pos, seqlen, device) if cache is not None else None
        if positions is None:  # every row's positions are its slots
            end = start_pos + seqlen
            rope_cos, rope_sin = self.rope_cos[start_pos:end], self.rope_sin[start_pos:end]
        else:
            rope_cos, rope_sin = self.rope_cos[positions], self.rope_sin[positions]
        mask = cache.attn_mask(start_pos, seqlen, device) if cache is not None else None
        return rope_cos, rope_sin, mask

    def _apply(self, fn, recurse=True):
        # Converting meta parameters (to_empty) makes a new Parameter per module,
        # which unties output from tok_embeddings; tie them again.
        super()._apply(fn, recurse)
        if self.cfg.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight
        return self

    def init_buffers(self) -> None:
        """Recompute the RoPE tables on the device the buffers are on now (after to_empty)."""
        cos, sin = rope_tables(self.cfg.dim // self.cfg.n_heads, self.cfg.max_seq_len,
                               self.cfg.rope_theta, device=self.rope_cos.device)
        self.rope_cos, self.rope_sin = cos, sin

    def init_parameter(self, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        """Fill `tensor`, the full-size fp32 CPU value of parameter `name`, in place.

        Norm gains are ones; embeddings and projections are N(0, 0.02), with the
        residual output projections (attention.wo, feed_forward.w2) scaled by
        1/sqrt(2 n_layers) so the residual stream's variance does not grow with depth.
        """
        expected = self._full_shape(name)
        if tuple(tensor.shape) != expected:
            raise ValueError(f"{name} has full shape {expected}, got a tensor of {tuple(tensor.shape)}")
        if name.endswith("norm.weight"):
            tensor.fill_(1.0)
            return
        std = INIT_STD
        block = _BLOCK_NAME.fullmatch(name)
        if block and block.group(2) in _RESIDUAL_OUT:
            std /= math.sqrt(2 * self.cfg.n_layers)
        tensor.normal_(0.0, std, generator=generator)

    def _full_shape(self, name: str) -> tuple[int, ...]:
        """Unsharded shape of parameter `name`; ValueError if the model has no such parameter."""
        c = self.cfg
        kv_dim = c.n_kv_heads * (c.dim // c.n_heads)
        shapes = {"tok_embeddings.weight": (c.vocab_size, c.dim), "norm.weight": (c.dim,),
                  "output.weight": (c.vocab_size, c.dim)}
        key = name
        block = _BLOCK_NAME.fullmatch(name)
        if block and int(block.group(1)) < c.n_layers:
            key = block.group(2)
            shapes = {
                "attention_norm.weight": (c.dim,), "ffn_norm.weight": (c.dim,),
                "attention.wq.weight": (c.dim, c.dim), "attention.wk.weight": (kv_dim, c.dim),
                "attention.wv.weight": (kv_dim, c.dim), "attention.wo.weight": (c.dim, c.dim),
                "feed_forward.w1.weight": (c.ffn_dim, c.dim),
                "feed_forward.w3.weight": (c.ffn_dim, c.dim),
                "feed_forward.w2.weight": (c.dim, c.ffn_dim),
            }
        if key not in shapes:
            raise ValueError(f"Llama has no parameter named {name!r}")
        return shapes[key]

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Parameters held by this module (tied ones once; a pipeline stage counts its own part).

        exclude_embeddings drops the token-embedding table, unless it is tied to the
        output projection, where it is a matmul weight and still counts.
        """
        total = sum(p.numel() for p in self.parameters())
        emb = self.tok_embeddings
        if exclude_embeddings and emb is not None and not (self.output is not None and
                                                           self.output.weight is emb.weight):
            total -= emb.weight.numel()
        return total

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward), PaLM appendix B: 6 N + 12 L d T.

        N = num_params(exclude_embeddings=True): every matmul weight including the output
        projection (plus the negligible norm gains) but not the embedding lookup; the second term is attention scores and
        their weighted sum for L layers of width d over T = seq_len, ignoring causality.
        """
        n = self.num_params(exclude_embeddings=True)
        return 6.0 * n + 12.0 * len(self.layers) * self.cfg.dim * seq_len


def build(cfg: ModelConfig) -> Llama:
    """Registry entry point: a Llama with this (resolved) config, on the current default device."""
    return Llama(cfg)
