"""A tensor-parallel parameter's local shard for a layer's forward, with a lean backward.

`param.to_local()` is what a tp layer multiplies with; its backward wraps the shard's
gradient back into a DTensor of the parameter's placements, and where the parameter already
has a gradient (micro-batches after the first, a pipeline's later micro-batches) autograd
adds the two DTensors through DTensor's dispatch. Both are Python, paid per use of a weight
and micro-batch (some hundred uses per micro-batch at gpt2 small): `local_shard` took a
tp 2 x pp 2 step at micro-batch 2 from 948 to 915 ms (benchmarks/RESULTS.md, "Waiting ranks
sleep on a futex, and tp weights' gradients skip DTensor's dispatch").

`local_shard(param)` does the same with the parameter's own spec (the gradient of a shard has
the shard's layout: nothing to compute or check) and, where a gradient is already there,
adds the new one to its local tensor in place and hands that DTensor back to autograd as
this use's gradient (taking it off the parameter first, so autograd's accumulation stores it
rather than adding it again): the gradient and its buffer are those `to_local` would give,
and post-accumulate hooks (ZeRO's) fire as before. A compiled graph traces `to_local`
itself (its backward may not mutate a parameter's gradient).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local_shard(param: torch.Tensor) -> torch.Tensor:
    """The local tensor of DTensor `param` (out/tp, in) for a forward; its gradient reaches `param.grad`."""
    if (torch.compiler.is_compiling() or not isinstance(param, DTensor) or not param.requires_grad
            or not torch.is_grad_enabled() or not param._local_tensor.is_contiguous()):
        return param.to_local()
    return _LocalShard.apply(param)


class _LocalShard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, param: DTensor) -> torch.Tensor:
        ctx.param = param  # the leaf itself: its .grad is read in backward (no tensor is saved)
        local = param._local_tensor
        return local.view_as(local)  # a new tensor object for autograd's metadata

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> DTensor:
        param = ctx.param
        grad = grad.contiguous()  # the shard's layout, which the parameter's spec describes
        held = param.grad
        if (isinstance(held, DTensor) and held._spec == param._spec and not held.requires_grad
                and held._local_tensor.is_contiguous()):
            held._local_tensor.add_(grad)
            param.grad = None  # autograd stores `held` back: accumulated once, hooks fire
            return held
        return DTensor(grad, param._spec, requires_grad=False)
