"""Process-group start-up from the environment that torchrun / the elastic agent sets."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from polytrain.backend.base import Accelerator
from polytrain.distributed.watchdog import enable_collective_log


@dataclass(frozen=True)
class World:
    rank: int
    world_size: int
    local_rank: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_world(acc: Accelerator) -> World:
    """Join the job described by RANK / WORLD_SIZE / LOCAL_RANK, or run as a single process.

    A process group is created only when there is more than one process, with the
    accelerator's collective library (gloo on CPU). Idempotent: a test or script
    that already initialised torch.distributed keeps its group.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if dist.is_initialized():
        return World(dist.get_rank(), dist.get_world_size(), local_rank)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1:
        enable_collective_log()  # before the groups exist: the hang watchdog reads it
        acc.set_device(local_rank)
        dist.init_process_group(backend=acc.dist_backend, timeout=timedelta(minutes=30))
        return World(dist.get_rank(), world_size, local_rank)
    return World(0, 1, local_rank)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def mean_over_world(value: torch.Tensor) -> torch.Tensor:
    """Average a scalar over all ranks (every rank holds a data-parallel replica's value)."""
    if dist.is_initialized():
        value = value.clone()
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return value


def max_over_world(flag: torch.Tensor) -> torch.Tensor:
    """The largest value of `flag` on any rank (e.g. 1 if any rank saw an overflow)."""
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag
