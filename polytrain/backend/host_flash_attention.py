"""Training's attention on the host CPU: `flash_attention`, C++ operators (host_flash_attention.cpp).

torch's CPU SDPA runs a training step's attention through its flash kernel, which multiplies
each block of queries by each block of keys with a call of the CPU BLAS and works the softmax
between those calls. At the head sizes of small and mid-sized models the calls are short and the
work between them dominates: at llama tiny's (8, 6, 256, 32), causal, on one Zen 4 core, its
forward and backward took 25 ms in fp32 and 34 ms in bf16, ~25 GFLOP/s, where the kernel below
reaches ~60. host_flash_attention.cpp does the same blockwise algorithm
(64 x 64 blocks of scores that never reach memory, online softmax in the forward, the
probabilities recomputed from each row's log-sum-exp in the backward) with the products as
register tiles of fp32 vectors: no calls, no packing, and grouped-query heads read in place
(query head h reads key/value head h / (H / Hkv): no repeated copies of k and v, and no sum of
their gradients). Its sums are fp32 in both dtypes; bf16 operands are widened on the way in and
results rounded once on the way out, so it also stands in for train.attention_fp32's upcast.
It runs those heads' forward and backward in 13-14 ms in either dtype (1.8x and 2.5x), 1.6-2.0x
SDPA's fp32 time at up to 512 tokens and 64-wide heads, level with it at 2,048, where SDPA's
products are long enough to run well (`benchmarks/host_flash_attention.py`, RESULTS.md).

It covers what training's attention is in most models: no mask or the causal one (queries and
keys the same positions), no dropout, a head size of 1, 2, 4, 8 or 16 vector widths (16-256 on
an AVX-512 CPU, 8-128 on AVX2), fp32 or bf16. Elsewhere (a padding or additive mask, a KV
cache's offset queries, attention dropout, a sharded DTensor, another device) `flash_attention`
returns None and the caller keeps its own attention. Outputs differ from SDPA's by fp32
rounding (sums in another order).

Built with the other host kernels (host_matmul.available()); train/host_attention.py puts it in
place of the attention cores of a model trained on the host (train.host_attention).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from polytrain.backend import host_matmul

DTYPES = (torch.float32, torch.bfloat16)

_head_dims: frozenset[int] = frozenset()
"""The head sizes the kernel takes here, 1, 2, 4, 8 or 16 of its vectors; set by `_register()`.
A plain set, so that a compiled caller's check of it is a constant."""


def supports_head_dim(head_dim: int) -> bool:
    """Whether heads `head_dim` wide go through the kernel here (building the host kernels first)."""
    return host_matmul.available() and head_dim in _head_dims


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                    scale: float | None = None) -> torch.Tensor | None:
    """softmax(scale q k^T [causal]) v for q (B, H, T, D) and k, v (B, Hkv, S, D) -> (B, H, T, D),
    differentiable; None where the kernel does not apply (see the module's docstring), for the
    caller's own attention. `causal` needs T == S (a KV cache's queries at an offset: None)."""
    if (any(isinstance(t, DTensor) or t.device.type != "cpu" for t in (q, k, v))
            or q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype
            or q.dim() != 4 or k.dim() != 4 or v.shape != k.shape
            or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3] or q.shape[1] % k.shape[1]
            or (causal and q.shape[2] != k.shape[2])
            or q.shape[3] not in _head_dims):
        return None
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out, _ = torch.ops.polytrain.flash_attention(q, k, v, causal, q.shape[-1] ** -0.5 if scale is None else scale)
    return out


def _fake_forward(q, k, v, causal, scale):
    B, H, T, D = q.shape
    return q.new_empty(B, T, H, D).transpose(1, 2), q.new_empty(B, H, T, dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    q, k, v, causal, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal, ctx.scale = causal, scale


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    grad_out = grad_out if grad_out.stride(-1) == 1 else grad_out.contiguous()
    dq, dk, dv = torch.ops.polytrain.flash_attention_backward(grad_out, q, k, v, out, lse, ctx.causal, ctx.scale)
    return dq, dk, dv, None, None


def _register() -> None:
    """Give the operators their shapes under torch.compile and their backward, and note the head
    sizes they take: once the extension is loaded (host_matmul.when_loaded)."""
    global _head_dims
    lanes = int(torch.ops.polytrain.host_vector_lanes())
    _head_dims = frozenset(lanes * n for n in (1, 2, 4, 8, 16))
    torch.library.register_fake("polytrain::flash_attention")(_fake_forward)
    torch.library.register_fake("polytrain::flash_attention_backward")(
        lambda dout, q, k, v, out, lse, causal, scale: (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)))
    torch.library.register_autograd("polytrain::flash_attention", _backward, setup_context=_setup_context)


host_matmul.when_loaded(_register)
