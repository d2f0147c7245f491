"""Attention cores on the host CPU's flash kernel (`train.host_attention`).

backend/host_flash_attention.py's kernel runs a training step's attention core, forward and
backward, 1.6-2.0x faster than torch's CPU SDPA in fp32 at up to 512 tokens (llama tiny's to
125m's heads, one thread of a Zen 4 EPYC), 1.2-1.6x at 1,024 and level at 2,048; bf16 operands
are summed in fp32, as train.attention_fp32's upcast would, without the copies: 1.5-2.5x torch's
bf16 SDPA and 1.4-2.2x its fp32 copies at up to 512 tokens. On a CPU with bf16 dot-product
instructions (AVX512-BF16, AMX) torch's bf16 products run at twice the fp32 rate, and from 1,024
tokens its bf16 SDPA is as fast or faster (0.94-1.03x at 1,024, 0.79-0.88x at 2,048): `auto` keeps
it there (benchmarks/host_flash_attention.py, RESULTS.md).

Like train.attention_fp32 it is applied from outside the model: each attention layer's `core`
(q (B, H, T, D), k and v (B, Hkv, S, D), mask) is replaced on the instance by one that calls the
kernel where it applies (no mask, so the causal or full attention of the layer; no attention
dropout in training; fp32 or bf16 host tensors) and the core it replaced elsewhere (a padding or
additive mask, decoding's queries at an offset into a KV cache, fp16). Applied after tensor
parallelism and train.attention_fp32 (whose fp32 core is then the fallback), before compilation
and recomputation, which then include the kernel's calls.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from polytrain.backend import host_gemm
from polytrain.backend.host_flash_attention import DTYPES, flash_attention, supports_head_dim
from polytrain.models.common.attention import Attention

# `auto`'s bound on a CPU with bf16 instructions, from benchmarks/host_flash_attention.py on a 2-core
# Zen 4 EPYC (RESULTS.md): the kernel 1.5-2.7x bf16 SDPA up to 512 tokens, 0.94-1.03x at 1,024.
AUTO_MAX_SEQ_LEN_NATIVE_BF16 = 512


def wanted(setting: str, dtype: torch.dtype, device_type: str, head_dims: set[int], seq_len: int) -> bool:
    """Whether train.host_attention = `setting` runs the attention cores of a model computing in
    `dtype` on `device_type` through the host kernel, its heads `head_dims` wide at `seq_len`
    tokens. `true` where it cannot is a ConfigError's business (see `check`)."""
    if setting == "false" or device_type != "cpu" or dtype not in DTYPES or not head_dims:
        return False
    if not all(supports_head_dim(d) for d in head_dims):
        return False
    if setting == "true" or dtype == torch.float32 or host_gemm.emulates(dtype):
        return True
    return seq_len <= AUTO_MAX_SEQ_LEN_NATIVE_BF16


def why_not(dtype: torch.dtype, device_type: str, head_dims: set[int]) -> str | None:
    """Why train.host_attention = true cannot be honoured here, or None."""
    if device_type != "cpu":
        return f"it runs on the host CPU, and this run's device is {device_type}"
    if dtype not in DTYPES:
        return f"it computes in fp32 or bf16, not {dtype}"
    unsupported = sorted(d for d in head_dims if not supports_head_dim(d))
    if unsupported:
        return (f"head size {unsupported[0]} is not one it handles on this CPU (or the host kernels could "
                "not be built: see the warning above)")
    return None


def on_kernel(layer: Attention, core):
    """`core` (the layer's current one) with the kernel first: q (B, H, T, D), k and v (B, Hkv, S, D)
    -> (B, H, T, D)."""
    def kernel_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
        out = None
        if mask is None and q.shape[2] > 1 and not (layer.training and layer.dropout):
            out = flash_attention(q, k, v, causal=layer.causal, scale=layer.scale)
        return core(q, k, v, mask) if out is None else out

    return kernel_core


def attention_on_kernel(model: nn.Module) -> int:
    """Put the kernel in front of every attention layer's core in `model`; returns how many."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    for layer in layers:
        layer.core = on_kernel(layer, layer.core)
    return len(layers)
