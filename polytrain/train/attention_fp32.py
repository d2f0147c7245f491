"""The attention core in fp32 inside 16-bit training (`train.attention_fp32`).

With bf16 model states every tensor of a block is bf16, the attention core's too. On the
host CPU torch's bf16 flash-attention backward is slow:
- where the CPU emulates the 16-bit dtype's GEMMs (x86 without AVX512-BF16 or AMX for bf16,
  without AMX-FP16 for fp16), for every shape: on an Ice Lake Xeon, forward and backward with
  q, k, v upcast and the output cast back run 2.1-2.6x faster than in bf16 (llama tiny's to
  125m's heads, 256 and 1024 tokens, two threads), and the fp32 forward alone is level;
- where the CPU has bf16 instructions (an AMX Xeon), for narrow heads only: at llama tiny's
  (8, 6, 256, 32) 13.4 ms against 18.4 ms on one thread (1.37x; 1.49x on two), while for wider
  heads and longer sequences fp32 is level or slower (64-wide heads 0.80-0.98x at 256 tokens,
  32-wide ones 0.94-0.98x at 1024-2048) and its forward alone 2x slower.
So `auto` turns it on for CPU runs whose 16-bit GEMMs the CPU emulates, and on other CPUs for
heads at most 32 wide at up to 512 tokens; a core whose inputs need no gradient (evaluation,
generation, frozen layers) keeps running in 16 bits.
`benchmarks/attention_precision.py --shapes B,H,T,D` says which way a model's heads go
(benchmarks/RESULTS.md, "The attention core in bf16 against fp32 on the CPU"). Like
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

from polytrain.backend import host_gemm
from polytrain.models.common.attention import Attention

Core = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, object], torch.Tensor]

# `auto`'s bounds on a CPU with 16-bit instructions, from benchmarks/attention_precision.py on a
# 2-core AMX Xeon (RESULTS.md): the fp32 core's forward and backward beat bf16's for heads this
# narrow at sequences this short.
AUTO_MAX_HEAD_DIM = 32
AUTO_MAX_SEQ_LEN = 512


def wanted(setting: str, dtype: torch.dtype, device_type: str, head_dims: set[int], seq_len: int) -> bool:
    """Whether train.attention_fp32 = `setting` runs the cores of a model computing in `dtype` on
    `device_type` in fp32, its attention layers' heads `head_dims` wide at `seq_len` tokens. An fp32
    model (an RLHF role under a 16-bit train.precision) has nothing to upcast."""
    if dtype == torch.float32 or not head_dims or setting == "false":
        return False
    if setting == "true":
        return True
    return device_type == "cpu" and (host_gemm.emulates(dtype)
                                     or (max(head_dims) <= AUTO_MAX_HEAD_DIM and seq_len <= AUTO_MAX_SEQ_LEN))


def in_fp32(core: Core) -> Core:
    """`core` run on fp32 copies of q, k, v (and of a floating mask), its output in q's dtype, where
    a backward will follow; without one (no input needs a gradient) the 16-bit core is faster.

    Autocast is off inside: CPU autocast would run the attention in 16 bits again."""
    def fp32_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
        if not (q.requires_grad or k.requires_grad or v.requires_grad):
            return core(q, k, v, mask)
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
