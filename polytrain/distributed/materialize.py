"""Give a meta-device model real storage and layout-independent initial weights.

Each parameter is generated whole on the CPU from a generator seeded by
(seed, parameter name), then each rank keeps only its own shard. The result is
bit-identical whatever the sharding, which is what lets every parallel layout
reproduce the single-device run. Peak extra memory is one full parameter.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from polytrain.models.common.init import seed_for


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device, seed: int, init_as: dict[str, str] | None = None) -> None:
    """Allocate `model` (built on meta, possibly sharded) on `device` and initialise it.

    The model provides `init_parameter(name, full_cpu_tensor, generator)` and
    `init_buffers()`; tied parameters appear once in named_parameters(). `init_as`
    maps a parameter that copies another (a pipeline's tied output head) to the name
    whose initial values it takes.
    """
    model.to_empty(device=device)
    for name, param in model.named_parameters():
        source = (init_as or {}).get(name, name)
        full = torch.empty(param.shape, dtype=torch.float32)  # global shape, also for DTensors
        model.init_parameter(source, full, torch.Generator().manual_seed(seed_for(seed, source)))
        full = full.to(device=device, dtype=param.dtype)
        if isinstance(param, DTensor):
            # src_data_rank=None: every rank holds the same full tensor, so each
            # slices out its own shard locally instead of receiving it. The copy is
            # between local tensors: a DTensor copy_ would propagate shardings first,
            # which takes long on meshes of 3-4 axes.
            local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(local.to_local())
        else:
            param.copy_(full)
    model.init_buffers()
