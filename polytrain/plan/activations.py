"""Activation bytes a transformer block saves for backward, per token: Korthikanti et al. for polytrain.

Korthikanti et al. (2022) count a Megatron GPT block as sbh(34 + 5as/h) bytes in 16-bit
with dropout masks. polytrain's blocks save different tensors, so the same bookkeeping
is redone here for the code as it is (tests/unit/test_plan_activations.py checks every
term against the tensors autograd really saves):

    per norm     RMSNorm: its fp32 input and normalised value (8D); LayerNorm: its fp32
                 input (4D) and two statistics
    norm output  the input of the linears after it: saved once in fp32 (4D), or under
                 autocast once per consuming linear, each casting it anew (2D each:
                 wq, wk, wv = 3; InternLM2's packed wqkv = 1; gated MLP 2, plain 1)
    attention    q, k, v (k and v repeated to the query heads) and the output: 4 x H hd
                 elements; the log-sum-exp of flash attention (H fp32). No (T x T)
                 scores: scaled_dot_product_attention's flash kernels keep none
    MLP          gated: w1's and w3's outputs and their product silu(w1 x) w3 x (3F: the
                 fused silu_mul recomputes the activation); plain: w1's output and the
                 activation (2F)
    autocast     each micro-batch's bf16/fp16 copies of the block's weights (2 bytes per
                 matrix element), saved with the graph until that block's backward

Under 1D tensor parallelism heads and FFN features split tp ways, the norms and their
outputs (the linears' inputs) are whole; sequence parallelism splits the norms too
(the all-gathered linear inputs stay whole, as the linears save them). Full
recomputation keeps the block's input (its fp32 residual stream, 4D); selective
recomputation of the attention core drops the log-sum-exp and the K/V heads repeated for
grouped-query attention (the core's inputs, unrepeated, are kept; the output is saved by
wo anyway): with flash attention there is no 5as^2b term for it to remove.
"""

from __future__ import annotations

from dataclasses import dataclass

from polytrain.errors import ConfigError

FP32 = 4
TOKEN_ID_BYTES = 8  # int64 ids the embedding keeps for its backward


@dataclass(frozen=True)
class BlockFamily:
    """What a block saves, by kind: which norm, how many linears read each norm's output, gated MLP."""

    norm: str  # "rms" or "layer"
    attention_consumers: int  # linears that read the attention norm's output
    mlp_consumers: int
    gated: bool
    masked_lm_head: bool = False  # BERT: an embedding norm, and dense + GELU + norm before the output
    packed_qkv: bool = False  # one q/k/v projection: the core's V is a view that keeps all of it alive


FAMILIES = {
    "llama": BlockFamily("rms", 3, 2, gated=True),
    "internlm2": BlockFamily("rms", 1, 2, gated=True, packed_qkv=True),  # packed wqkv
    "gpt2": BlockFamily("layer", 3, 1, gated=False),
    "bert": BlockFamily("layer", 3, 1, gated=False, masked_lm_head=True),  # post-norm: same tensors, other places
}


def block_family(arch: str) -> BlockFamily:
    """The family of `arch`'s blocks; T5 (relative-position biases, cross-attention) is not modelled."""
    if arch not in FAMILIES:
        raise ConfigError(f"polytrain plan models the blocks of {', '.join(FAMILIES)}; model.arch = "
                          f"'{arch}' is not one of them")
    return FAMILIES[arch]


@dataclass(frozen=True)
class BlockDims:
    """Widths of one block: model width D, FFN width F, heads H of size hd, Hkv key/value heads."""

    dim: int
    ffn_dim: int
    n_heads: int
    head_dim: int
    n_kv_heads: int | None = None  # None: as many as the query heads

    @property
    def attn_width(self) -> int:
        return self.n_heads * self.head_dim

    def kv_width(self, tp: int = 1) -> float:
        """Key (or value) width one tp rank holds: its share of the KV heads, one head where there
        are fewer heads than ranks (each rank keeps a copy)."""
        kv_heads = self.n_kv_heads or self.n_heads
        return self.head_dim * (kv_heads / tp if kv_heads >= tp else 1)


def block_bytes_per_token(family: BlockFamily, d: BlockDims, compute_bytes: int, tp: int = 1,
                          sp: bool = False, recompute: str = "none") -> float:
    """Bytes one block saves per token of the micro-batch (tokens counted before any split).

    `compute_bytes`: 4 for fp32 training, 2 under bf16/fp16 autocast.
    """
    if recompute == "full":
        return FP32 * d.dim / (tp if sp else 1)
    autocast = compute_bytes < FP32
    norm_share = tp if sp else 1
    if family.norm == "rms":
        norms = 2 * (2 * FP32 * d.dim + FP32) / norm_share  # x, x * rsqrt, rsqrt
    else:
        norms = 2 * (FP32 * d.dim + 2 * FP32) / norm_share  # input, mean, rstd
    if autocast:
        norm_outputs = compute_bytes * d.dim * (family.attention_consumers + family.mlp_consumers)
    else:
        norm_outputs = 2 * FP32 * d.dim
    # q and the attention output; the core's K and V: repeated to every query head inside it
    # (SDPA saves them so), unrepeated where selective recomputation saves only the core's
    # inputs. With a packed projection the saved V is a view of the whole (q, k, v) output.
    if recompute == "none":
        attention = compute_bytes * 4 * d.attn_width / tp
    elif family.packed_qkv:  # q and k after RoPE, the packed output behind V, the output
        attention = compute_bytes * (2 * d.attn_width / tp + d.kv_width(tp) + (d.attn_width / tp + 2 * d.kv_width(tp)))
    else:
        attention = compute_bytes * (2 * d.attn_width / tp + 2 * d.kv_width(tp))
    lse = 0.0 if recompute == "selective" else FP32 * d.n_heads / tp
    # per FFN feature: the activation's input and w2's input; gated, also w3's output
    # (silu_mul keeps gate and up, not silu(gate): backend/host_activations.py)
    mlp = (3 if family.gated else 2) * compute_bytes * d.ffn_dim / tp
    return norms + norm_outputs + attention + lse + mlp


def head_bytes_per_token(family: BlockFamily, dim: int, compute_bytes: int, tp: int = 1, sp: bool = False) -> float:
    """Bytes the layers around the blocks save per token: the final norm and the output
    projection's input (BERT: also its embedding norm and its head's dense + GELU + norm),
    the token ids (8 bytes; BERT's segment ids too); the loss's own come apart."""
    share = tp if sp else 1
    if family.masked_lm_head:  # fp32 embedding norm; dense input, GELU input, norm input, output input
        return (FP32 * dim + 2 * FP32) / share + 4 * compute_bytes * dim + 2 * FP32 + 2 * TOKEN_ID_BYTES
    norm = (2 * FP32 * dim + FP32 if family.norm == "rms" else FP32 * dim + 2 * FP32) / share
    return norm + compute_bytes * dim + TOKEN_ID_BYTES


def autocast_weight_bytes(block_matrices: float, compute_bytes: int, recompute: str) -> float:
    """Bytes of one block's 16-bit weight copies kept with one micro-batch's graph (0 in fp32 or
    with full recomputation, where the copies are made again in backward)."""
    if compute_bytes >= FP32 or recompute == "full":
        return 0.0
    return compute_bytes * block_matrices
