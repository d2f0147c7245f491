"""T5 encoder-decoder: relative position buckets, RMS-style LayerNorm, ReLU or gated-GELU FFN.

Module names: tok_embeddings (shared by encoder, decoder and, tied, the output),
encoder_pos_bias and decoder_pos_bias (bucket -> per-head bias tables, one per stack,
used by all its blocks), layers["0".."L_enc-1"] the encoder blocks and
layers["L_enc".."L_enc+L_dec-1"] the decoder blocks, each with attention_norm,
attention.{wq,wk,wv,wo}, decoder blocks also cross_attention_norm and
cross_attention.{wq,wk,wv,wo}, then ffn_norm and feed_forward.{w1,(w3),w2};
encoder_norm, decoder_norm, output. One flat `layers` dict keeps the trainer's
per-block wrapping (FSDP units, activation checkpointing) the same as for decoders.

T5 specifics: attention scores are not divided by sqrt(head_dim) and get a learned
bias indexed by the bucketed relative distance (bidirectional in the encoder,
causal in the decoder); norms are RMSNorm without bias (T5's "LayerNorm"); no
biases anywhere. v1.0: ReLU FFN, output tied to the embedding with the decoder's
final states scaled by dim ** -0.5 (model.output_scale). v1.1: gated-GELU (tanh)
FFN, untied output, no scaling.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from polytrain.config import ModelConfig
from polytrain.models.common.attention import Attention
from polytrain.models.common.base import ModelBase, check_resolved, head_dim
from polytrain.models.common.kv_cache import KVCache
from polytrain.models.common.mlp import FeedForward
from polytrain.models.common.norms import RMSNorm

REQUIRED = ("dim", "n_layers", "n_heads", "ffn_dim", "vocab_size", "max_seq_len")
DECODER_START = 0
"""The decoder's first input token: T5's decoder_start_token_id (its pad id; <|endoftext|> in polytrain's BPE)."""


def relative_position_bucket(rel: torch.Tensor, bidirectional: bool, num_buckets: int,
                             max_distance: int) -> torch.Tensor:
    """Bucket id in [0, num_buckets) of each relative position rel = key pos - query pos (int64).

    Bidirectional: half the buckets for keys after the query, half for the rest;
    causal: only distances back from the query count (later keys are masked anyway).
    Within a direction the first half of the buckets are exact distances 0, 1, ...;
    the rest cover exact .. max_distance logarithmically, farther distances share the last.
    """
    base = torch.zeros_like(rel)
    if bidirectional:
        num_buckets //= 2
        base = base + (rel > 0).long() * num_buckets
        dist = rel.abs()
    else:
        dist = (-rel).clamp(min=0)
    exact = num_buckets // 2
    # float32 and truncation toward zero, as T5's reference: the boundaries must agree exactly.
    far = exact + (torch.log(dist.float() / exact) / math.log(max_distance / exact)
                   * (num_buckets - exact)).to(torch.long)
    far = far.clamp(max=num_buckets - 1)
    return base + torch.where(dist < exact, dist, far)


class CrossAttention(Attention):
    """Decoder queries over the encoder's output; its keys and values are computed once per sequence."""

    def forward(self, x: torch.Tensor, memory: torch.Tensor, mask: torch.Tensor | None,
                cache: KVCache | None = None) -> torch.Tensor:
        """x (B, T, dim), memory (B, S, dim), mask additive (B, 1, 1, S) or None -> (B, T, dim)."""
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, H, T, D)

        def keys_values():
            S = memory.shape[1]
            k = self.wk(memory).view(B, S, -1, self.head_dim).transpose(1, 2)  # (B, H, S, D)
            return k, self.wv(memory).view(B, S, -1, self.head_dim).transpose(1, 2)

        k, v = cache.fixed(self.layer_id, keys_values) if cache is not None else keys_values()
        out = self.core(q, k, v, mask)
        return self.resid_dropout(self.wo(out.transpose(1, 2).reshape(B, T, -1)))


class Block(nn.Module):
    """Pre-norm T5 block: x + attn(norm(x)) [+ cross_attn(norm(x), memory)] + ffn(norm(x))."""

    def __init__(self, cfg: ModelConfig, layer_id: int, decoder: bool):
        super().__init__()
        hd, H = head_dim(cfg), cfg.n_heads
        self.decoder = decoder
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg.dim, H, H, layer_id, head_dim=hd, causal=decoder, scale=1.0,
                                   dropout=cfg.dropout)
        if decoder:
            self.cross_attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
            self.cross_attention = CrossAttention(cfg.dim, H, H, layer_id, head_dim=hd, causal=False, scale=1.0,
                                                  dropout=cfg.dropout)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim, cfg.activation, gated=cfg.gated_ffn,
                                        dropout=cfg.dropout)

    def forward(self, x: torch.Tensor, bias: torch.Tensor, memory: torch.Tensor | None = None,
                memory_mask: torch.Tensor | None = None, cache: KVCache | None = None,
                start_pos: int = 0) -> torch.Tensor:
        """x (B, T, dim) -> (B, T, dim).

        bias: additive (B or 1, H, T, S) self-attention bias (positions and masks);
        memory (B, S_enc, dim) and memory_mask additive (B, 1, 1, S_enc): decoder blocks only.
        """
        x = x + self.attention(self.attention_norm(x), cache=cache, start_pos=start_pos, mask=bias)
        if self.decoder:
            x = x + self.cross_attention(self.cross_attention_norm(x), memory, memory_mask, cache)
        return x + self.feed_forward(self.ffn_norm(x))


class T5(ModelBase):
    """Encoder-decoder LM: (tokens (B, S), decoder_tokens (B, T)) -> logits (B, T, vocab_size)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        check_resolved(cfg, REQUIRED)
        self.cfg = cfg
        self.n_encoder = cfg.n_layers
        n_decoder = cfg.n_decoder_layers or cfg.n_layers
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.encoder_pos_bias = nn.Embedding(cfg.rel_pos_buckets, cfg.n_heads)
        self.decoder_pos_bias = nn.Embedding(cfg.rel_pos_buckets, cfg.n_heads)
        # HF T5's placement: after each stack's embedding and after its final norm.
        self.dropout = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleDict({str(i): Block(cfg, i, decoder=i >= self.n_encoder)
                                     for i in range(self.n_encoder + n_decoder)})
        self.encoder_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.decoder_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.tie_weights()
        self._record_shapes()

    def forward(self, tokens: torch.Tensor, decoder_tokens: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (B, S) encoder input, decoder_tokens (B, T) (the targets shifted right behind a
        start token), attention_mask (B, S) 1 = real encoder token -> logits (B, T, vocab_size)."""
        memory = self.encode(tokens, attention_mask)
        return self.decode(decoder_tokens, memory, attention_mask)

    def encode(self, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (B, S) -> encoder output (B, S, dim); padding (attention_mask 0) is never attended to."""
        S = tokens.shape[1]
        h = self.dropout(self.tok_embeddings(tokens))  # (B, S, dim)
        bias = self._position_bias(self.encoder_pos_bias, 0, S, bidirectional=True, device=h.device)
        if attention_mask is not None:
            bias = bias + self._padding(attention_mask)  # (B, H, S, S)
        for block in self._blocks(decoder=False):
            h = block(h, bias)
        return self.dropout(self.encoder_norm(h))

    def decode(self, decoder_tokens: torch.Tensor, memory: torch.Tensor,
               attention_mask: torch.Tensor | None = None, cache: KVCache | None = None,
               start_pos: int = 0) -> torch.Tensor:
        """decoder_tokens (B, T) at positions start_pos.. over memory (B, S, dim) -> logits (B, T, V).

        With a cache, self-attention keys and values accumulate in it and cross-attention's
        are computed from memory once.
        """
        T = decoder_tokens.shape[1]
        end = start_pos + T
        h = self.dropout(self.tok_embeddings(decoder_tokens))  # (B, T, dim)
        bias = self._position_bias(self.decoder_pos_bias, start_pos, T, bidirectional=False, device=h.device)
        q_pos = torch.arange(start_pos, end, device=h.device)[:, None]
        future = torch.arange(end, device=h.device)[None, :] > q_pos  # (T, end): keys after the query
        bias = bias.masked_fill(future, torch.finfo(bias.dtype).min)  # (1, H, T, end)
        memory_mask = self._padding(attention_mask) if attention_mask is not None else None
        for block in self._blocks(decoder=True):
            h = block(h, bias, memory, memory_mask, cache, start_pos)
        h = self.dropout(self.decoder_norm(h))
        if self.cfg.output_scale:
            h = h * self.cfg.dim ** -0.5  # T5 v1.0 rescales before its tied output projection
        return self.output(h)

    def _blocks(self, decoder: bool) -> list[Block]:
        return [b for i, b in enumerate(self.layers.values()) if (i >= self.n_encoder) == decoder]

    def _position_bias(self, table: nn.Embedding, start_pos: int, T: int, bidirectional: bool,
                       device: torch.device) -> torch.Tensor:
        """(1, H, T, start_pos + T) fp32 bias of queries start_pos.. over keys 0..start_pos+T-1."""
        q_pos = torch.arange(start_pos, start_pos + T, device=device)[:, None]  # (T, 1)
        k_pos = torch.arange(start_pos + T, device=device)[None, :]  # (1, S)
        buckets = relative_position_bucket(k_pos - q_pos, bidirectional, self.cfg.rel_pos_buckets,
                                           self.cfg.rel_pos_max_distance)  # (T, S)
        return table(buckets).float().permute(2, 0, 1)[None]  # (1, H, T, S)

    @staticmethod
    def _padding(attention_mask: torch.Tensor) -> torch.Tensor:
        """(B, S) 1/0 -> additive (B, 1, 1, S) fp32: 0 for real keys, the most negative float for padding."""
        real = attention_mask.bool()[:, None, None, :]
        return torch.zeros(real.shape, device=real.device).masked_fill(~real, torch.finfo(torch.float32).min)

    def _init(self, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        """T5's (Mesh TensorFlow's) scales, which keep unscaled attention scores near unit variance:
        embedding 1; q (dim * head_dim) ** -0.5; k, v, FFN inputs, bias tables and an untied
        output dim ** -0.5; attention outputs (heads * head_dim) ** -0.5; FFN output ffn_dim ** -0.5."""
        c, hd = self.cfg, head_dim(self.cfg)
        if name.endswith("norm.weight"):
            tensor.fill_(1.0)
            return
        leaf = name.rsplit(".", 2)[-2]  # the module's own name: wq, w1, tok_embeddings, ...
        std = {"tok_embeddings": 1.0, "wq": (c.dim * hd) ** -0.5, "wo": (c.n_heads * hd) ** -0.5,
               "w2": c.ffn_dim ** -0.5}.get(leaf, c.dim ** -0.5)
        tensor.normal_(0.0, std, generator=generator)


def build(cfg: ModelConfig) -> T5:
    """Registry entry point: a T5 with this (resolved) config, on the current default device."""
    return T5(cfg)
