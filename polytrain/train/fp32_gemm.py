"""fp32 training's products on oneDNN where the host's BLAS takes a generic code path (`train.fp32_gemm`).

torch's x86 builds run fp32 matrix products on MKL, whose kernels are tuned for Intel's CPUs; on
others (a Zen 4 EPYC) it runs a generic code path, and oneDNN's matmul, in the same build, runs
the forward and input-gradient products of training's layers 10-20% faster
(`backend.host_gemm.onednn_linear`; its weight-gradient product, both operands transposed, is no
faster and stays on the BLAS). `auto` turns it on for fp32 CPU runs on such a CPU.

Applied like train.matmul_fp32, from outside the model after tensor parallelism and before
compilation (a compiled block keeps the oneDNN products as operators of its graph): every plain
nn.Linear gets an instance forward through `onednn_linear`, layers with their own products
(LoRA's, tensor parallelism's) take it as their `product`, and the chunked loss head as its
chunks' `chunk_product` (the logits and the hidden states' gradient).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from polytrain.backend import host_gemm
from polytrain.errors import ConfigError
from polytrain.train.matmul_fp32 import route_products


def wanted(setting: str, dtype: torch.dtype, device_type: str) -> bool:
    """Whether train.fp32_gemm = `setting` runs an fp32 model's products on oneDNN on `device_type`;
    a ConfigError for `onednn` where this build of torch has none."""
    if setting == "onednn" and not host_gemm.onednn_available():
        raise ConfigError("train.fp32_gemm = onednn: this build of torch has no oneDNN; use auto or blas")
    if setting == "blas" or dtype != torch.float32 or device_type != "cpu" or not host_gemm.onednn_available():
        return False
    return setting == "onednn" or host_gemm.blas_is_generic()


def linears_on_onednn(model: nn.Module) -> int:
    """Route `model`'s Linear layers' and chunked loss head's products through oneDNN (see the module's
    docstring); returns how many layers changed."""
    return route_products(model, host_gemm.onednn_linear,
                          lambda head: setattr(head, "chunk_product", host_gemm.onednn_linear))
