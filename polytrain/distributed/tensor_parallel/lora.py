"""1D tensor parallelism for LoRA layers: the adapters split to match their base weight's split.

A LoRALinear (polytrain/lora) in a column or row role becomes one of these; the base weight
splits exactly as the plain layer's, and its adapters A (r, in) and B (out, r) so that every
rank computes its own slice of the update with no collective in forward:

    role    base W (out, in)   A (r, in)    B (out, r)    this rank computes
    column  Shard(0)           Replicate    Shard(0)      x A^T (B, T, r), then its rows of B: (B, T, out/tp)
    row     Shard(1)           Shard(1)     Replicate     x_local A_local^T, a partial sum of x A^T,
                                                          times B^T: a partial sum of the update,
                                                          reduced with the base's partial sum when
                                                          leaving the region

Backward: the replicated factor's gradient is a partial sum on each rank (column: A's, from
this rank's output rows; row: B's, from its input columns), so it enters through copy_to_tp
(backward all-reduce over tp), as a shared KV head's weight does; the split factor's
gradient is complete for its slice. Dropout on the adapter's input: in a column layer the
input is the region's replicated activation and draws from the stream in force (shared by
the tp group without SP); in a row layer it is this rank's shard and draws per rank.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard

from polytrain.distributed.collectives import copy_to_tp
from polytrain.distributed.tensor_parallel.context import TPContext
from polytrain.distributed.tensor_parallel.local_shard import local_shard
from polytrain.distributed.tensor_parallel.one_d import ColumnParallelLinear, RowParallelLinear
from polytrain.lora import LoRALinear, lora_update


class ColumnParallelLoRA(ColumnParallelLinear):
    """A column-parallel LoRALinear: (B, T, in) -> this rank's (B, T, out/tp) of x W^T + b + the update."""

    def __init__(self, linear: LoRALinear, ctx: TPContext, unit: int = 1, shared_units: bool = False):
        super().__init__(linear, ctx, unit, shared_units)
        self.rank, self.scaling, self.dropout = linear.rank, linear.scaling, linear.dropout
        self.lora_a = ctx.distribute(linear.lora_a, [Replicate()])  # (r, in)
        # B's rows are the base weight's output rows: split alike, or replicated with shared units.
        self.lora_b = ctx.distribute(linear.lora_b, [Replicate() if self.rows is not None else Shard(0)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = copy_to_tp(local_shard(self.lora_a), self.ctx.group)  # (r, in); backward sums the ranks' dA
        b = local_shard(self.lora_b)  # (out/tp, r), or (out, r) for shared units
        if self.rows is not None:
            b = copy_to_tp(b, self.ctx.group)[self.rows]  # (unit, r)
        return super().forward(x) + lora_update(x, a, b, self.scaling, self.dropout, self.training, self.product)


class RowParallelLoRA(RowParallelLinear):
    """A row-parallel LoRALinear: (B, T, in/tp) -> (B, T, out) (or (B, T/tp, out) under SP)."""

    def __init__(self, linear: LoRALinear, ctx: TPContext):
        super().__init__(linear, ctx)
        self.rank, self.scaling, self.dropout = linear.rank, linear.scaling, linear.dropout
        self.lora_a = ctx.distribute(linear.lora_a, [Shard(1)])  # (r, in/tp): the base's input columns
        self.lora_b = ctx.distribute(linear.lora_b, [Replicate()])  # (out, r)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        b = copy_to_tp(local_shard(self.lora_b), self.ctx.group)  # backward sums the ranks' partial dB
        with self.ctx.sharded_rng(self.training):
            # x (B, T, in/tp) A_local^T: a partial sum of x A^T, so the update is partial too (B, T, out)
            update = lora_update(x, local_shard(self.lora_a), b, self.scaling, self.dropout, self.training,
                                 self.product)
        return super().partial(x) + update
