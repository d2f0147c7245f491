"""Rows of one global batch between models of different layouts.

Step 3's four models may each have another data-parallel degree (the actor at tp 2 and
dp 1 beside a reward model at dp 2, on two processes). Every model reads the same global
batch of B rows: data-parallel rank d of D holds rows [d B / D, (d + 1) B / D), the
ranks of one tensor-parallel group the same rows. A model computes on its rows, and
`gather_rows` hands every process the whole batch's result, so the next model slices it
its own way. Outside a process group both are the identity.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from polytrain.distributed.runtime import Runtime


def row_range(n_rows: int, runtime: Runtime) -> range:
    """This rank's rows of a global batch of `n_rows` (its data-parallel slice)."""
    D, d = runtime.dp_size, runtime.dp_rank
    if n_rows % D:
        raise ValueError(f"a batch of {n_rows} rows does not split over {D} data-parallel ranks")
    per = n_rows // D
    return range(d * per, (d + 1) * per)


def _dp_rank_of(runtime: Runtime, rank: int) -> int:
    c = runtime.dims.coordinates(rank)
    return c["dp_replicate"] * runtime.dims.dp_shard + c["dp_shard"]


def _first_rank_of_each_slice(runtime: Runtime) -> list[int]:
    """For data-parallel rank d = 0 .. D - 1, the lowest world rank holding its rows."""
    owners: dict[int, int] = {}
    for rank in range(runtime.world.world_size):
        owners.setdefault(_dp_rank_of(runtime, rank), rank)
    return [owners[d] for d in range(runtime.dp_size)]


def gather_rows(local: torch.Tensor, runtime: Runtime) -> torch.Tensor:
    """The whole batch (B, ...) on every rank from each rank's slice (B / D, ...), same shape on all ranks."""
    if runtime.world.world_size == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(runtime.world.world_size)]
    dist.all_gather(parts, local.contiguous())
    return torch.cat([parts[r] for r in _first_rank_of_each_slice(runtime)])


def gather_objects(local: list[Any], runtime: Runtime) -> list[Any]:
    """As gather_rows, for a list of picklable rows (token lists of different lengths)."""
    if runtime.world.world_size == 1:
        return list(local)
    parts: list[Any] = [None] * runtime.world.world_size
    dist.all_gather_object(parts, local)
    return [row for r in _first_rank_of_each_slice(runtime) for row in parts[r]]
