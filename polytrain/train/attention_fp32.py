"""The attention core in fp32 inside 16-bit training (`train.attention_fp32`).

With bf16 model states every tensor of a block is bf16, the attention core's too. On the
host CPU torch's bf16 flash-attention backward is about twice as slow as its fp32 one
(llama tiny's (8, 6, 256, 32) heads, one thread: 17.6 ms against 8.1 ms; the forward 2.3
against 3.6 ms), so computing softmax(q k^T) v in fp32 and casting the output back is faster
there, and more exact. Like activation checkpointing, it is applied from outside the model:
each attention layer's `core` (Attention.core's contract: q (B, H, T, D), k and v (B, Hkv,
S, D), mask) is replaced on the instance by one that upcasts its inputs, so module names,
parameters and checkpoints are untouched. Applied after tensor parallelism (which sees the
same core) and before compilation and recomputation (which then include the casts).
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
