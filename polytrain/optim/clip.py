"""Gradient clipping by global norm when each rank holds a disjoint shard of the gradient.

    norm = sharded_grad_norm(local_shards, group, device)   # the whole gradient's 2-norm
    for g in local_shards: g.mul_(clip_coefficient(norm, max_norm))

Computed on the plain local shards with one all-reduce of a scalar, not through
DTensor ops: a DTensor norm and a DTensor multiply per parameter each cost a
dispatch, together more than the arithmetic on a small model.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


@torch.no_grad()
def sharded_grad_norm(shards: list[torch.Tensor], group: dist.ProcessGroup | None,
                      device: torch.device) -> torch.Tensor:
    """The 2-norm of a gradient whose pieces `shards` are spread, without overlap, over `group`'s ranks.

    Per-tensor norms first, as torch's clip_grad_norm_ does: one fp32 norm over a whole
    flat buffer loses ~1e-6 relative accuracy. The scalar result lives on `device`
    (collectives run on the accelerator). `group` None: this rank holds everything.
    """
    # One multi-tensor op for all per-tensor norms.
    total = (torch.stack(torch._foreach_norm(shards)).square().sum() if shards else torch.zeros(())).to(device)
    if group is not None:
        dist.all_reduce(total, group=group)
    return total.sqrt()


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The factor (<= 1) that brings a gradient of 2-norm `norm` to at most `max_norm`, as torch's."""
    return (max_norm / (norm + 1e-6)).clamp(max=1.0)


@torch.no_grad()
def squared_norm_share(grads: list[torch.Tensor], stage_ranks: int, device: torch.device) -> torch.Tensor:
    """This rank's share of the squared global gradient norm; summed over all ranks it is the whole.

    `grads` may be DTensors laid out over any mesh axes (data parallel shards or
    replicas, tensor-parallel shards or replicas) or plain tensors. `stage_ranks` is
    how many ranks hold the same part of the model (world size / pp). A piece that
    `stage_ranks / pieces` ranks hold identically contributes that fraction of its
    squared norm on each of them, so one all-reduce over the world (which also adds
    the pipeline stages up) gives the norm without knowing which axis is which.
    """
    weights, local = [], []
    for g in grads:
        pieces = 1
        if isinstance(g, DTensor):
            mesh = g.device_mesh
            # Any non-replicated placement splits the tensor: FSDP2 over a tp-sharded weight
            # uses _StridedShard, which is_shard() does not report.
            pieces = math.prod(mesh.size(i) for i, p in enumerate(g.placements) if not p.is_replicate())
            g = g.to_local()
        weights.append(pieces / stage_ranks)
        local.append(g.float())
    if not local:
        return torch.zeros((), dtype=torch.float32, device=device)
    squares = torch.stack(torch._foreach_norm(local)).square()  # (n,): one multi-tensor op for all norms
    return (squares * torch.tensor(weights, device=squares.device)).sum().to(device)


def global_norm(share: torch.Tensor) -> torch.Tensor:
    """sqrt of the sum over every rank of `share` (one scalar all-reduce; none in a single process)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(share)
    return share.sqrt()
