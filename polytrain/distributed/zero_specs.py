"""How ZeRO-1/2's plain master shards are presented as DTensors, and who else holds a parameter.

A master is this rank's dp rows of a compute parameter's local tensor. When the compute
parameter is a tensor-parallel DTensor, those rows are a shard of a shard; the layout is
exactly FSDP2's over tensor parallelism (torch/distributed/fsdp/_fully_shard/_fsdp_param.py,
`_init_sharding_spec_tp`): mesh (dp, *tp axes), placements (dp placement, *tp placements),
where the dp placement is `_StridedShard(0, split_factor=k)` when tp already splits dim 0
into k pieces (the dp chunk is taken within each tp piece) and `Shard(0)` otherwise. So
Distributed Checkpoint moves these shards to and from FSDP2 (ZeRO-3), plain tensor
parallelism and a single process.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import _StridedShard


def as_sharded(local: torch.Tensor, like: torch.Tensor, dp_mesh: DeviceMesh | None) -> DTensor | torch.Tensor:
    """This rank's rows `local` of parameter `like` as a DTensor of `like`'s global shape (shares storage).

    Built from its spec: `DTensor.from_local` would copy a host (offloaded) shard to the
    mesh's device. FSDP2's CPU offload builds its sharded parameters the same way.
    Without a dp mesh and tensor parallelism the rows are the whole tensor and stay plain.
    """
    if isinstance(like, DTensor):
        tp_mesh, tp_placements = like.device_mesh, tuple(like.placements)
        if dp_mesh is None:
            mesh, placements = tp_mesh, tp_placements
        else:
            split = math.prod(tp_mesh.size(i) for i, p in enumerate(tp_placements)
                              if isinstance(p, Shard) and p.dim == 0)
            first = _StridedShard(0, split_factor=split) if split > 1 else Shard(0)
            mesh, placements = DeviceMesh._concatenate([dp_mesh, tp_mesh]), (first, *tp_placements)
    elif dp_mesh is not None:
        mesh, placements = dp_mesh, (Shard(0),)
    else:
        return local
    stride = torch.empty(like.shape, device="meta").stride()  # contiguous, of the global shape
    spec = DTensorSpec(mesh, placements, TensorMeta(like.shape, stride, local.dtype))
    return DTensor(local.detach(), spec, requires_grad=False)


def replicas(param: torch.Tensor, plain: int = 1) -> int:
    """How many ranks of one data-parallel rank's model-parallel group hold `param`'s local tensor.

    A DTensor: the sizes of its mesh dimensions that replicate it; a plain tensor: `plain`
    (the tensor-parallel degree it is copied over).
    """
    if not isinstance(param, DTensor):
        return plain
    return math.prod(param.device_mesh.size(i) for i, p in enumerate(param.placements) if isinstance(p, Replicate))


def tp_group_of(param: torch.Tensor) -> dist.ProcessGroup | None:
    """The process group over which a tensor-parallel DTensor `param` is split (None if not split)."""
    if not isinstance(param, DTensor):
        return None
    split = [i for i, p in enumerate(param.placements) if not isinstance(p, Replicate)]
    if not split:
        return None
    if len(split) > 1 or param.device_mesh.ndim > 1:
        raise ValueError("ZeRO-1/2 composes with 1-D tensor parallelism only")
    return param.device_mesh.get_group(split[0])
