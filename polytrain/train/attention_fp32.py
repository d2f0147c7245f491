"""The attention core in fp32 inside 16-bit training (`train.attention_fp32`).

With bf16 model states every tensor of a block is bf16, the attention core's too. On the
host CPU torch's bf16 flash-attention backward is slow for small heads: at llama tiny's
(8, 6, 256, 32), forward and backward with q, k, v upcast and the output cast back take
13.4 ms against 18.4 ms in bf16 on one thread (1.37x; 1.48x on two). For 64-wide heads it is
level or slower (0.86-0.98x at seq 256, 0.61-0.66x at seq 1024), so it is a switch, not a
default: `benchmarks/attention_precision.py --shapes B,H,T,D` says which way a model's heads
go (benchmarks/RESULTS.md, "The attention core in bf16 against fp32 on the CPU"). Like
activation checkpointing, it is applied from outside the model: each attention layer's `core`
(Attention.core's contract: q (B, H, T, D), k and v (B, Hkv, S, D), mask) is replaced on the
instance by one that upcasts its inputs, so module names, parameters and checkpoints are
untouched. Applied after tensor parallelism (which sees the same core) and before compilation
and recomputation (which then include the casts).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from polytrain.models.common.attention import Attention

Core = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, object], torch.Tensor]


def in_fp32(core: Core) -> Core:
    """`core` run on fp32 copies of q, k, v (and of a floating mask), its output in q's dtype.

    Autocast is off inside: CPU autocast would run the attention in 16 bits again."""
    def fp32_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
        if isinstance(mask, torch.Tensor) and mask.is_floating_point():
            mask = mask.float()  # an additive bias (B or 1, H or 1, T, S)
        with torch.autocast(q.device.type, enabled=False):
            out = core(q.float(), k.float(), v.float(), mask)  # (B, H, T, D) fp32
        return out.to(q.dtype)

    return fp32_core


def attention_in_fp32(model: nn.Module) -> int:
    """Replace every attention layer's core in `model` by its fp32 run; returns how many."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    for layer in layers:
        layer.core = in_fp32(layer.core)
    return len(layers)
