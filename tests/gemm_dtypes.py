"""Which dtypes a piece of code's GEMMs ran in: aten's mm, addmm, bmm and baddbmm, counted by the
dtype of their operands, forward and backward alike (autograd runs CPU backward on this thread).

    with GemmDtypes() as gemms:
        loss = model(tokens).sum(); loss.backward()
    assert gemms.seen == {torch.float32: 42}
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
GEMMS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}


class GemmDtypes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen: Counter[torch.dtype] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in GEMMS:
            self.seen[args[-1].dtype] += 1  # mm(a, b), addmm(bias, a, b), ...: b's dtype is the operands'
        return func(*args, **(kwargs or {}))


def assert_bf16_products_in_fp32(ref: torch.nn.Module, model: torch.nn.Module, loss_fn, tokens: torch.Tensor,
                                 targets: torch.Tensor, label: str) -> None:
    """train.matmul_fp32 on a parallel `model` and its single-device `ref` (same weights): in bf16,
    the parallel model runs no bf16 GEMM, forward or backward, and its loss and gradients follow
    ref's with the same fp32 products (bf16 roundings apart: a partial sum over ranks is rounded
    to bf16 before it is summed). `loss_fn(logits, targets)` is the parallel model's loss."""
    import torch.nn.functional as F

    from polytrain.train.matmul_fp32 import linears_in_fp32

    for m in (ref, model):
        m.to(torch.bfloat16)
        assert linears_in_fp32(m) > 0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_loss = F.cross_entropy(ref(tokens).flatten(0, 1).float(), targets.flatten())
        ref_loss.backward()
        with GemmDtypes() as gemms:
            loss = loss_fn(model(tokens), targets)
            loss.backward()
    assert set(gemms.seen) == {torch.float32}, (label, gemms.seen)
    torch.testing.assert_close(loss.float(), ref_loss, rtol=1e-2, atol=0)
    ref_params = dict(ref.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad.full_tensor().float(), ref_params[name].grad.float(),
                                   rtol=5e-2, atol=5e-3, msg=f"{label}: {name}")
