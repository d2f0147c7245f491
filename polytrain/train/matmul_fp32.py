"""16-bit training's matrix products run as fp32 GEMMs where the host emulates 16-bit ones
(`train.matmul_fp32`).

With bf16 model states every Linear multiplies bf16 operands. On a CPU without bf16
dot-product instructions torch emulates those GEMMs at a third of fp32's speed or less
(`backend.host_gemm`): there the same products, widened to fp32 and rounded back to 16 bits,
give the 16-bit GEMM's result (to fp32 rounding) 2.4-5x faster, while weights, gradients,
activations and optimizer states stay 16-bit. `auto` turns it on for CPU runs whose 16-bit
dtype the host's CPU emulates (`backend.host_gemm.emulates`).

Like train.attention_fp32 it is applied from outside the model, after tensor parallelism and
before compilation and recomputation: each plain nn.Linear gets an instance forward that
calls `backend.host_gemm.linear` (module names, parameters and checkpoints untouched), and
the chunked loss head runs its chunks' products in fp32 (`ScoringHead.matmul_dtype`).
Layers that run their own products take them through a `product` attribute, which is set to
`fp32_product`: LoRA layers (`LoRALinear.product`) and tensor parallelism's sharded layers
(1D column, row and vocabulary head, LoRA's under tp, 2D/2.5D and 3D), whose overlapped
backward (`parallel.tp_overlap`) runs its input and weight gradients through it too. Left in
16 bits: any other subclass of nn.Linear with its own forward. `route_products` is that
traversal for any product; train.fp32_gemm routes fp32 models' products to oneDNN with it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from polytrain.backend import host_gemm

Product = Callable[..., torch.Tensor]
"""(x, weight, bias=None) -> x weight^T + bias, as F.linear."""


def wanted(setting: str, dtype: torch.dtype, device_type: str) -> bool:
    """Whether train.matmul_fp32 = `setting` runs the products of a model computing in `dtype` on
    `device_type` in fp32: `auto` where the host emulates `dtype` GEMMs; never for an fp32 model."""
    if dtype not in host_gemm.LOW_DTYPES or setting == "false":
        return False
    return setting == "true" or (device_type == "cpu" and host_gemm.emulates(dtype))


def fp32_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) as fp32 GEMMs when it would run in 16 bits (a 16-bit weight, or
    a 16-bit autocast); an fp32 product (a value head kept in fp32) stays F.linear."""
    device_type = x.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype
    if dtype not in host_gemm.LOW_DTYPES:
        return F.linear(x, weight, bias)
    return host_gemm.linear(x, weight, bias, dtype)


def _forward_through(layer: nn.Linear, product: Product) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(x: torch.Tensor) -> torch.Tensor:  # x (..., in) -> (..., out)
        return product(x, layer.weight, layer.bias)

    forward.yields_to_inference = True  # decoding's few-row kernels (inference.threaded_matmul) may take over
    return forward


def route_products(model: nn.Module, product: Product, head: Callable[[nn.Module], None]) -> int:
    """Give every plain nn.Linear of `model` a forward through `product`, layers that run their own
    products (LoRA's, tensor parallelism's) `product`, and let `head` set up the chunked loss head;
    returns how many layers changed."""
    changed = 0
    for module in model.modules():
        is_head, own_products = hasattr(module, "matmul_dtype"), hasattr(module, "product")
        if type(module) is nn.Linear and "forward" not in module.__dict__:
            module.forward = _forward_through(module, product)
        elif not (is_head or own_products):
            continue
        if is_head:  # the chunked loss head (a ScoringHead), sharded or not
            head(module)
        if own_products:  # LoRALinear and tp's sharded layers: (x, weight, bias=None) -> x weight^T + bias
            module.product = product
        changed += 1
    return changed


def linears_in_fp32(model: nn.Module) -> int:
    """Give every plain nn.Linear of `model` the fp32-GEMM forward, layers that run their own
    products (LoRA's, tensor parallelism's) fp32 products and the chunked loss head fp32 chunk
    products; returns how many layers changed."""
    return route_products(model, fp32_product, lambda head: setattr(head, "matmul_dtype", torch.float32))
