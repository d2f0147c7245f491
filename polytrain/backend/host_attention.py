"""Decoding's attention on the host CPU: `decode_attention`, a C++ operator (host_attention.cpp).

A decoding step attends one new token per row to the whole KV cache, G query heads per
key/value head. torch's SDPA runs this through its flash kernel, built for many queries; the
compiled step's products and sums (models.common.attention.attention_as_sums), which Inductor
fuses into one loop nest, still read each key once per query head and work through the
cache's unwritten slots. The operator reads each key and value row once for all G queries,
skips the slots the mask excludes, and sums in fp32 (bf16 rounded once at the end): on a
2-core Sapphire Rapids Xeon, llama 125m's bf16 attention at batch 8 takes 35 us a layer over a
96-slot cache (64 written) against SDPA's 42 and the compiled sums' 84, and 264 us over 1,024
slots (512 written) against 449 and 723 (benchmarks/decode_attention.py, RESULTS.md).

It is built with host_matmul.cpp into one extension (`host_matmul.available()` builds it) and
used by generation only: inference sets each attention layer's `decode_kernel` to
`decode_attention` while generating on the host, so the model's code names no kernel. Its
outputs differ from SDPA's by fp32 rounding (sums in another order).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

DTYPES = (torch.float32, torch.bfloat16)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     scale: float | None) -> torch.Tensor | None:
    """softmax(scale q k^T + mask) v for q (B, Hkv, G, D), k and v (B, Hkv, S, D), mask (B or 1, 1,
    1, S) boolean (True: attend) or fp32 additive, or None -> (B, Hkv, G, D); None where the
    operator does not apply (another device or dtype, a gradient wanted, a sharded tensor),
    for the caller's own attention. Only once `host_matmul.available()` is True."""
    tensors = (q, k, v) if mask is None else (q, k, v, mask)
    if (any(isinstance(t, DTensor) or t.device.type != "cpu" for t in tensors)
            or q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype
            or (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)))
            or any(t.stride(-1) != 1 for t in (q, k, v))
            or (mask is not None and (mask.dtype not in (torch.bool, torch.float32) or mask.dim() != 4
                                      or mask.shape[1:3] != (1, 1)))):
        return None
    return torch.ops.polytrain.decode_attention(q, k, v, mask, q.shape[-1] ** -0.5 if scale is None else scale)
