"""Feed-forward activations on the host CPU: `gelu_tanh` and `silu_mul`, C++ operators
(host_activations.cpp).

GPT-2's (and T5's, "gelu_new") tanh GELU runs in torch's CPU kernel through a vectorised tanh
accurate to the last bit, ~2.8 ms forward and ~3.1 ms backward for a (2,048, 768) fp32
activation on one Zen 4 core: several times the time to read and write it, and ~45 ms of a
GPT-2 small step at tp 2 (RESULTS.md). Written as x sigmoid(2u) with the sigmoid from one
exponential (the one the flash kernel's softmax uses), a pass costs about its memory traffic.
Llama's SwiGLU, silu(w1 x) * w3 x, is three torch passes forward and three backward, and autograd
keeps silu(w1 x) besides both inputs; `silu_mul` is one pass each way and keeps the two inputs
(on other devices too: there it runs torch's ops and recomputes silu(w1 x) in the backward).

Both compute in fp32 for fp32 and bf16 tensors and round once; they agree with torch's to fp32
rounding (gelu's small negative tail closer to the exact value than torch's 0.5 x (1 + tanh u),
which cancels there). Where they do not apply (another device or dtype, a non-contiguous or
DTensor operand, fewer than MIN_ELEMENTS numbers, inside torch.compile, whose inductor fuses
torch's ops with their neighbours, or no host kernels built) they return torch's own result.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from polytrain.backend import host_matmul

DTYPES = (torch.float32, torch.bfloat16)
MIN_ELEMENTS = 1 << 14
"""Smaller activations (a decoding step's few tokens) keep torch's ops: an operator call with its
autograd costs ~10 us more than an aten one, what the faster pass saves on ~5,000 numbers."""


def applies(*operands: torch.Tensor) -> bool:
    """Whether the operators take these operands: contiguous fp32 or bf16 host tensors of one shape
    and dtype, at least MIN_ELEMENTS, outside torch.compile, with the host kernels built."""
    first = operands[0]
    if first.numel() < MIN_ELEMENTS or torch.compiler.is_compiling():
        return False
    return (not any(isinstance(t, DTensor) for t in operands)
            and first.device.type == "cpu" and first.dtype in DTYPES
            and all(t.device == first.device and t.dtype == first.dtype and t.shape == first.shape
                    and t.is_contiguous() for t in operands)
            and host_matmul.available())


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """F.gelu(x, approximate="tanh"), differentiable."""
    if applies(x):
        return torch.ops.polytrain.gelu_tanh(x)
    return F.gelu(x, approximate="tanh")


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """F.silu(gate) * up (SwiGLU's product of its gate and up projections), differentiable; its
    backward keeps gate and up only, on every device (silu(gate) is recomputed)."""
    if applies(gate, up):
        return torch.ops.polytrain.silu_mul(gate, up)
    return _SiluMul.apply(gate, up)


class _SiluMul(torch.autograd.Function):
    """silu(gate) * up in torch's ops, saving gate and up (autograd would keep silu(gate) too)."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        d_gate = torch.ops.aten.silu_backward(grad * up, gate) if ctx.needs_input_grad[0] else None
        d_up = grad * F.silu(gate) if ctx.needs_input_grad[1] else None
        return d_gate, d_up


def _gelu_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _gelu_backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return torch.ops.polytrain.gelu_tanh_backward(grad.contiguous(), x)


def _silu_mul_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _silu_mul_backward(ctx, grad):
    gate, up = ctx.saved_tensors
    return torch.ops.polytrain.silu_mul_backward(grad.contiguous(), gate, up)


def _register() -> None:
    """Shapes under torch.compile (for a caller that traces the operators themselves) and backwards."""
    torch.library.register_fake("polytrain::gelu_tanh")(torch.empty_like)
    torch.library.register_fake("polytrain::gelu_tanh_backward")(lambda grad, x: torch.empty_like(x))
    torch.library.register_fake("polytrain::silu_mul")(lambda gate, up: torch.empty_like(gate))
    torch.library.register_fake("polytrain::silu_mul_backward")(
        lambda grad, gate, up: (torch.empty_like(gate), torch.empty_like(up)))
    torch.library.register_autograd("polytrain::gelu_tanh", _gelu_backward, setup_context=_gelu_setup)
    torch.library.register_autograd("polytrain::silu_mul", _silu_mul_backward, setup_context=_silu_mul_setup)


host_matmul.when_loaded(_register)
