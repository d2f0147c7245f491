"""16-bit matrix products on a host CPU without 16-bit dot-product instructions, run as fp32 GEMMs.

A bf16 GEMM on an x86 CPU that lacks AVX512-BF16 and AMX (an Ice Lake Xeon, an EPYC before
Zen 4) is emulated by torch's oneDNN: on one thread of the project's Ice Lake Xeon, forward
and both backward products of llama tiny's layers (2048 tokens x 192 -> 320, 1024; 512 -> 192)
take 24, 74 and 38 ms in bf16 against 8, 24 and 13 ms with the operands widened to fp32 and
the results rounded back (2.9-3.0x; gpt2 125m's 4.1-5.2x), and fp16's are slower still
(`benchmarks/host_gemm.py`, benchmarks/RESULTS.md).
The fp32 route computes what the 16-bit GEMM defines: a bf16 or fp16 product is exact in
fp32, the sums run in fp32 (as the 16-bit GEMM's accumulator does), and the result is rounded
once to 16 bits; only the order of the sums differs, so results match to fp32 rounding before
that last rounding.

`linear(x, weight, bias, dtype)` is F.linear in `dtype` computed that way, with a backward
that keeps the 16-bit operands (the same saved tensors as F.linear's, no fp32 copies held
between forward and backward) and widens them again when the gradients are made.
`emulates(dtype)` says whether this host would emulate a `dtype` GEMM.

fp32 products: torch's x86 builds run them on MKL, whose kernels are tuned for Intel's CPUs and
take a generic code path on others (MKL_VERBOSE says "Intel(R) Architecture processors" on the
project's Zen 4 EPYC). oneDNN, in the same builds, picks its kernels by the CPU's instructions:
there its matmul runs the forward and input-gradient products of training's layers at 100-106
GFLOP/s a core against MKL's 85-94 (the weight gradient's, whose operands are both transposed,
not faster). `onednn_linear` is F.linear with those two on oneDNN; `blas_is_generic()` says
whether this host is such a CPU.
"""

from __future__ import annotations

import functools
import platform

import torch
import torch.nn.functional as F

LOW_DTYPES = (torch.bfloat16, torch.float16)


@functools.cache
def emulates(dtype: torch.dtype) -> bool:
    """Whether this host's CPU has no dot-product instructions for `dtype` GEMMs (bf16: AVX512-BF16
    or AMX; fp16: AMX-FP16), so torch emulates them. Only x86 is judged; elsewhere False."""
    if dtype not in LOW_DTYPES or platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
        return False
    if dtype == torch.bfloat16:
        return not (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    return not torch.cpu._is_amx_fp16_supported()


class _Fp32Linear(torch.autograd.Function):
    """x (..., in) @ weight (out, in).T + bias (out,), all in one 16-bit dtype, through fp32 GEMMs."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        out = F.linear(x.float(), weight.float(), bias.float() if bias is not None else None)
        return out.to(x.dtype)  # (..., out)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        want_x, want_w, want_b = ctx.needs_input_grad
        # A backward called inside autocast runs under it: it would round these GEMMs to 16 bits.
        with torch.autocast(grad_out.device.type, enabled=False):
            dy = grad_out.reshape(-1, grad_out.shape[-1]).float()  # (N, out)
            grad_x = (dy @ weight.float()).view(x.shape).to(x.dtype) if want_x else None  # (..., in)
            grad_w = (dy.t() @ x.reshape(-1, x.shape[-1]).float()).to(weight.dtype) if want_w else None  # (out, in)
        grad_b = dy.sum(0).to(grad_out.dtype) if want_b and ctx.has_bias else None  # (out,)
        return grad_x, grad_w, grad_b


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """F.linear(x, weight, bias) with operands rounded to `dtype` (16-bit) and its products run as
    fp32 GEMMs; the output is `dtype`, as autocast's or a 16-bit layer's F.linear returns it."""
    bias = bias.to(dtype) if bias is not None else None
    with torch.autocast(x.device.type, enabled=False):  # autocast would round the fp32 GEMM to 16 bits
        return _Fp32Linear.apply(x.to(dtype), weight.to(dtype), bias)


@functools.cache
def blas_is_generic() -> bool:
    """Whether torch's BLAS is MKL on an x86 CPU not made by Intel (where it takes its generic code
    path) and oneDNN is there to take the fp32 products instead. Judged on Linux (/proc/cpuinfo)."""
    if not (torch.backends.mkl.is_available() and torch.backends.mkldnn.is_available()):
        return False
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        with open("/proc/cpuinfo") as f:
            vendor = next((line.split(":", 1)[1].strip() for line in f if line.startswith("vendor_id")), "")
    except OSError:
        return False
    return bool(vendor) and vendor != "GenuineIntel"


def onednn_available() -> bool:
    """Whether oneDNN's matmul is in this build of torch (x86 and ARM builds)."""
    return torch.backends.mkldnn.is_available()


@torch.library.custom_op("polytrain::onednn_linear", mutates_args=())
def _traced_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's product as an operator a compiled block can hold (torch's own has no fake)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@_traced_product.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def onednn_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., in) @ weight (out, in).T + bias on oneDNN; eagerly without the operator's dispatch."""
    if torch.compiler.is_compiling():
        return _traced_product(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class _OneDnnLinear(torch.autograd.Function):
    """x (..., in) @ weight (out, in).T + bias (out,) in fp32, forward and input gradient on oneDNN."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return onednn_product(x, weight, bias)  # (..., out)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        want_x, want_w, want_b = ctx.needs_input_grad
        dy = grad_out.reshape(-1, grad_out.shape[-1])  # (N, out)
        if want_x:  # dy weight: oneDNN reads the weight's transpose in place
            grad_x = onednn_product(dy.contiguous(), weight.t(), None)
            grad_x = grad_x.view(x.shape)
        else:
            grad_x = None
        grad_w = dy.t() @ x.reshape(-1, x.shape[-1]) if want_w else None  # (out, in): the BLAS, faster here
        grad_b = dy.sum(0) if want_b and ctx.has_bias else None
        return grad_x, grad_w, grad_b


MIN_ONEDNN_ROWS = 16
"""Fewer rows (a decoding step's tokens) keep F.linear: inference's few-row kernels take those."""


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) with its forward and input-gradient products on oneDNN, for fp32 host
    tensors of at least MIN_ONEDNN_ROWS rows, x contiguous, outside autocast; F.linear elsewhere. A
    compiled block holds the products as `polytrain::onednn_linear` operators (inductor would run
    F.linear's on the BLAS). x (..., in), weight (out, in), which may be a transposed view (an
    input-gradient product passes weight.t())."""
    if (x.dtype != torch.float32 or weight.dtype != torch.float32 or x.device.type != "cpu"
            or torch.is_autocast_enabled("cpu") or not x.is_contiguous()
            or x.numel() < MIN_ONEDNN_ROWS * x.shape[-1]):
        return F.linear(x, weight, bias)
    return _OneDnnLinear.apply(x, weight, bias)
