"""Gradient clipping by global norm when each rank holds a disjoint shard of the gradient.

    norm = sharded_grad_norm(local_shards, group, device)   # the whole gradient's 2-norm
    for g in local_shards: g.mul_(clip_coefficient(norm, max_norm))

Computed on the plain local shards with one all-reduce of a scalar, not through
DTensor ops: a DTensor norm and a DTensor multiply per parameter each cost a
dispatch, together more than the arithmetic on a small model.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


@torch.no_grad()
def sharded_grad_norm(shards: list[torch.Tensor], group: dist.ProcessGroup | None,
                      device: torch.device) -> torch.Tensor:
    """The 2-norm of a gradient whose pieces `shards` are spread, without overlap, over `group`'s ranks.

    Per-tensor norms first, as torch's clip_grad_norm_ does: one fp32 norm over a whole
    flat buffer loses ~1e-6 relative accuracy. The scalar result lives on `device`
    (collectives run on the accelerator). `group` None: this rank holds everything.
    """
    norms = [torch.linalg.vector_norm(g) for g in shards]
    total = (torch.stack(norms).square().sum() if norms else torch.zeros(())).to(device)
    if group is not None:
        dist.all_reduce(total, group=group)
    return total.sqrt()


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The factor (<= 1) that brings a gradient of 2-norm `norm` to at most `max_norm`, as torch's."""
    return (max_norm / (norm + 1e-6)).clamp(max=1.0)
