"""The shared-memory collectives (host_collectives.py) as torch operators, for compiled graphs.

Under `torch.compile`, `torch.distributed` collectives are traced as functional collectives
of the process group (gloo on a CPU), so a compiled block would not use the ranks' shared
buffer that the same block uses eagerly. These operators are opaque to the compiler: the
graph calls them like a kernel, and at run time each one takes the shared path where
`host_collectives` can (else the process group's collective, synchronously). The group
travels as its name (`ProcessGroup.group_name`, which dynamo traces as a constant).

    out = torch.ops.polytrain.host_all_reduce(x, group_name)            # sum, same shape
    out = torch.ops.polytrain.host_all_gather(x, n, group_name)         # (S,) -> (n * S,)
    out = torch.ops.polytrain.host_reduce_scatter(x, n, group_name)     # (n * S,) -> (S,)
    out = torch.ops.polytrain.host_all_to_all(x, group_name)            # (n, ...) -> (n, ...)

Inputs are contiguous 1-d views for the gather and the scatter, any contiguous shape for the
others; every rank of the group calls the same operator at the same point of the graph.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from polytrain.backend import host_collectives


def group_name(group: dist.ProcessGroup | None) -> str:
    return (group if group is not None else dist.group.WORLD).group_name


@torch.library.custom_op("polytrain::host_all_reduce", mutates_args=())
def host_all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    group = _resolve_process_group(group_name)
    out = host_collectives.all_reduce(x, group)
    if out is None:
        out = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=group)
    return out


@torch.library.custom_op("polytrain::host_all_gather", mutates_args=())
def host_all_gather(x: torch.Tensor, n: int, group_name: str) -> torch.Tensor:
    group = _resolve_process_group(group_name)
    out = x.new_empty(n * x.numel())
    if not host_collectives.all_gather_(out, x, group):
        dist.all_gather_single(out, x, group=group)
    return out


@torch.library.custom_op("polytrain::host_reduce_scatter", mutates_args=())
def host_reduce_scatter(x: torch.Tensor, n: int, group_name: str) -> torch.Tensor:
    group = _resolve_process_group(group_name)
    out = x.new_empty(x.numel() // n)
    if not host_collectives.reduce_scatter_(out, x, group):
        dist.reduce_scatter_single(out, x.clone(), group=group)
    return out


@torch.library.custom_op("polytrain::host_all_to_all", mutates_args=())
def host_all_to_all(x: torch.Tensor, group_name: str) -> torch.Tensor:
    group = _resolve_process_group(group_name)
    out = torch.empty_like(x)
    if not host_collectives.all_to_all_(out, x, group):
        dist.all_to_all_single(out, x, group=group)
    return out


@host_all_reduce.register_fake
def _(x, group_name):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@host_all_gather.register_fake
def _(x, n, group_name):
    return x.new_empty(n * x.numel())


@host_reduce_scatter.register_fake
def _(x, n, group_name):
    return x.new_empty(x.numel() // n)


@host_all_to_all.register_fake
def _(x, group_name):
    return torch.empty_like(x)
