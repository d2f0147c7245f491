"""Data parallelism and ZeRO-3 through FSDP2 (`fully_shard`) on the data-parallel mesh.

One mechanism covers both layouts, so checkpoints and gradient clipping see
DTensors either way:
- zero = 0: mesh (dp_replicate=dp, dp_shard=1). Every rank holds full
  parameters; gradients are all-reduced (DDP semantics).
- zero = 3: mesh (dp_replicate, dp_shard). Parameters, gradients and optimizer
  state are sharded over dp_shard: each block is all-gathered just before its
  forward and backward and freed after; gradients are reduce-scattered.

Each transformer block is its own FSDP unit so only one block's full parameters
exist at a time; the root unit holds the embedding, final norm and output head.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from polytrain.distributed.topology import ParallelDims


def apply_data_parallel(model: nn.Module, dims: ParallelDims, mesh: DeviceMesh) -> nn.Module:
    """Shard/replicate `model` (still on meta) over the data-parallel mesh axes; in place."""
    if dims.dp == 1:
        return model
    dp_mesh = mesh["dp_replicate", "dp_shard"]
    # Re-gathering after forward is what saves ZeRO-3 its memory; with full
    # replicas there is nothing to free.
    reshard = dims.zero == 3
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard)
    # The root's parameters (embedding, head) are needed again right at the start
    # of backward, so they stay gathered after forward.
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False)
    return model


def set_gradient_sync(model: nn.Module, dims: ParallelDims, last_micro_batch: bool) -> None:
    """Reduce gradients across ranks only when needed during gradient accumulation.

    Replicas sync once, on the last micro-batch. ZeRO-3 reduce-scatters every
    micro-batch: holding unsharded gradients until the end would cost the full
    model's gradient memory that sharding exists to avoid.
    """
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(last_micro_batch or dims.zero == 3)
