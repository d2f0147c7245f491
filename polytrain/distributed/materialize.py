"""Give a meta-device model real storage and layout-independent initial weights.

Each parameter's values come from a generator seeded by (seed, parameter name), as if
the parameter were generated whole in fp32 on the CPU. A sharded parameter (a DTensor:
ZeRO-3, tensor parallelism) gets only this rank's shard, computed directly
(shard_init.py: the same values, a block of rows at a time), so start-up needs about
one rank's share of host memory, not the whole model per rank. A plain parameter (a
replica) is generated whole. The result is bit-identical whatever the sharding, which is
what lets every parallel layout reproduce the single-device run.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from polytrain.distributed.shard_init import UnsupportedInit, init_local_shard
from polytrain.models.common.init import seed_for


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device, seed: int, init_as: dict[str, str] | None = None,
                round_to: torch.dtype | None = None, param_device: torch.device | None = None) -> None:
    """Allocate `model` (built on meta, possibly sharded) on `device` and initialise it.

    The model provides `init_parameter(name, full_cpu_tensor, generator)` and
    `init_buffers()`; tied parameters appear once in named_parameters(). `init_as`
    maps a parameter that copies another (a pipeline's tied output head) to the name
    whose initial values it takes. `round_to`: a 16-bit dtype the initial values pass
    through (mixed precision: fp32 masters that start as copies of the 16-bit weights).
    `param_device`: where the parameters go if not to `device` (offloaded shards: the
    host); buffers always go to `device`, where the model computes.
    """
    param_device = param_device or device
    model.to_empty(device=param_device)
    for name, param in model.named_parameters():
        init_parameter(model, name, param, seed, init_as, round_to)
    place_buffers(model, device)


@torch.no_grad()
def init_parameter(model: nn.Module, name: str, param: torch.Tensor, seed: int,
                   init_as: dict[str, str] | None = None, round_to: torch.dtype | None = None) -> None:
    """Fill one allocated parameter (this rank's shard of a DTensor) with its name-seeded initial values."""
    source = (init_as or {}).get(name, name)

    def init(tensor: torch.Tensor) -> None:
        model.init_parameter(source, tensor, torch.Generator().manual_seed(seed_for(seed, source)))

    if isinstance(param, DTensor):
        try:
            init_local_shard(init, param, round_to)
            return
        except UnsupportedInit:
            pass  # an initialiser a window cannot reproduce: generate it whole below
    _init_whole(init, param, param.device, round_to)


@torch.no_grad()
def place_buffers(model: nn.Module, device: torch.device) -> None:
    """Move the buffers to `device` (allocating any still on meta) and let the model compute them."""
    for module in model.modules():
        for key, buffer in module._buffers.items():
            if buffer is not None and (buffer.is_meta or buffer.device != device):
                module._buffers[key] = torch.empty_like(buffer, device=device) if buffer.is_meta else buffer.to(device)
    model.init_buffers()


def _init_whole(init: Callable[[torch.Tensor], None], param: torch.Tensor, device: torch.device,
                round_to: torch.dtype | None) -> None:
    """Generate the full tensor on the CPU and keep this rank's part (all of it for a replica)."""
    full = torch.empty(param.shape, dtype=torch.float32)  # global shape, also for DTensors
    init(full)
    if round_to is not None:
        full = full.to(round_to)
    full = full.to(device=device, dtype=param.dtype)
    if isinstance(param, DTensor):
        # src_data_rank=None: every rank holds the same full tensor, so each slices out
        # its own shard locally instead of receiving it. The copy is between local
        # tensors: a DTensor copy_ would propagate shardings first, which takes long on
        # meshes of 3-4 axes.
        local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(local.to_local())
    else:
        param.copy_(full)

