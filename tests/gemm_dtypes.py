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
