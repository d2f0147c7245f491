"""Gradient reduce-scatter for data parallelism, done the way the collective library does it fastest.

Each of dp ranks holds a buffer (dp, S) whose row r is meant for rank r; a
reduce-scatter leaves rank r the sum over the ranks of row r. Where the accelerator
says `reduce_scatter_by_all_reduce` (the CPU backend: on one host its reduce-scatter
of a 12 MiB buffer takes about twice its all-reduce of the same buffer, and part of
it runs in the calling thread), the whole buffer is all-reduced in place and each
rank reads its own row: twice the bytes on the wire, less time. Between ranks of one host
the reduce-scatter goes through shared memory where it can (backend/host_collectives.py),
done at once, each rank summing only its own row.

    work, recv = start_reduce_scatter(send, group, rank, by_all_reduce)  # ZeRO-1/2
    model.set_custom_reduce_scatter(HostReduceScatter())                # FSDP2 (ZeRO-3)
    model.set_custom_all_gather(HostAllGather())                        # FSDP2's parameter gathers
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from polytrain.backend import host_collectives


def start_reduce_scatter(send: torch.Tensor, group: dist.ProcessGroup | None, rank: int,
                         by_all_reduce: bool) -> tuple[dist.Work | None, torch.Tensor]:
    """Start summing `send` (dp, S) over `group`; return (work, recv).

    recv (S,) holds this rank's row of the sum once `work` is waited for. Through shared
    memory or as an all-reduce, recv is a view of `send`, which must live until then either way.
    `group` None (one rank): nothing to reduce, recv is row 0 itself.
    """
    if group is None:
        return None, send[0]
    if host_collectives.reduce_scatter_(send[rank], send.view(-1), group):  # in place: see the module
        return None, send[rank]
    if by_all_reduce:
        return dist.all_reduce(send, group=group, async_op=True), send[rank]
    recv = torch.empty(send.shape[1], dtype=send.dtype, device=send.device)
    return dist.reduce_scatter_single(recv, send.view(-1), group=group, async_op=True), recv


def buffers_sent(group: dist.ProcessGroup | None, by_all_reduce: bool) -> int:
    """The (dp, S) buffers one reduction sends under the ring count: 2 where it runs as the
    process group's all-reduce, 1 as a reduce-scatter or through shared memory (a collective
    on the group's first use)."""
    return 2 if by_all_reduce and not host_collectives.shared(group) else 1


class HostReduceScatter:
    """FSDP2's reduce-scatter (`FSDPModule.set_custom_reduce_scatter`) through shared memory
    where the group's ranks share this host, else done as an all-reduce (see the module doc).

    FSDP2 allocates its flat input (dp * S,) and output (S,) through `allocate` and calls
    the object synchronously, reading the output right after.
    """

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op: dist.ReduceOp, async_op: bool = False) -> None:
        if async_op:
            raise NotImplementedError("HostReduceScatter runs synchronously, as FSDP2 calls it")
        if op == dist.ReduceOp.SUM and host_collectives.reduce_scatter_(output_tensor, input_tensor, group):
            return
        dist.all_reduce(input_tensor, op=op, group=group)
        rows = input_tensor.view(group.size(), -1)  # (dp, S)
        output_tensor.copy_(rows[dist.get_rank(group)])


class HostAllGather:
    """FSDP2's all-gather (`FSDPModule.set_custom_all_gather`) through shared memory where the
    group's ranks share this host, else the process group's; the shared path is done at once."""

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, async_op: bool = False) -> dist.Work | None:
        if host_collectives.all_gather_(output_tensor, input_tensor, group):
            return None
        return dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)
