"""Runtime: what one process knows about the job it runs in, built once and passed down.

    world = init_world(acc)                                  # join the job (or run alone)
    runtime = Runtime.create(acc, world, dims)               # dims: ParallelDims for world.world_size
    runtime.mesh["tp"], runtime.dp_rank, runtime.device

Everything under polytrain/distributed takes the accelerator, mesh and coordinates from a
Runtime (or from arguments) instead of fetching globals. Several models with different
layouts can share one world: `runtime.with_dims(other_dims)` builds another mesh over the
same processes (RLHF's actor at ZeRO-3 beside a replicated reward model).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh

from polytrain.backend.base import Accelerator
from polytrain.distributed.context_parallel.checks import cp_degrees
from polytrain.distributed.context_parallel.layout import CPGroups, new_cp_groups
from polytrain.distributed.topology import ParallelDims, dp_coordinates
from polytrain.distributed.world import World


@dataclass(frozen=True)
class Runtime:
    """The accelerator, the world, one layout's degrees and mesh, and this rank's place in it."""

    acc: Accelerator
    world: World
    dims: ParallelDims
    mesh: DeviceMesh | None
    """The named mesh of `dims` (None in a single process)."""
    dp_rank: int
    """This rank's index among the data-parallel ranks: which slice of each batch it reads."""
    dp_size: int
    device: torch.device
    cp: CPGroups
    """This rank's context-parallel groups (one rank each when parallel.cp = 1)."""

    @classmethod
    def create(cls, acc: Accelerator, world: World, dims: ParallelDims) -> Runtime:
        """The runtime of layout `dims` on `world` (whose process group, if any, is initialised)."""
        if dims.world_size != world.world_size:
            raise ValueError(f"the layout is for {dims.world_size} processes, the world has {world.world_size}")
        mesh = dims.build_mesh(acc.device_type) if world.world_size > 1 else None
        dp_rank, dp_size = dp_coordinates(mesh) if mesh is not None else (0, 1)
        cp = CPGroups.single()
        if dims.cp > 1:  # collective: every rank creates every cp group's sub-groups
            _, ulysses = cp_degrees(dims.cp, dims.cp_mode, dims.cp_ulysses)
            cp = new_cp_groups(dims.groups("cp"), ulysses)
        return cls(acc, world, dims, mesh, dp_rank, dp_size, acc.device(world.local_rank), cp)

    def with_dims(self, dims: ParallelDims) -> Runtime:
        """Another layout over the same processes and device (a second model of the job)."""
        return Runtime.create(self.acc, self.world, dims)

    @property
    def coordinates(self) -> dict[str, int]:
        """This rank's coordinates on the mesh axes ({"pp": ..., "dp_replicate": ..., ...})."""
        return self.dims.coordinates(self.world.rank)

    def axis_rank(self, axis: str) -> int:
        """This rank's index along mesh `axis` (0 in a single process)."""
        return self.mesh[axis].get_local_rank() if self.mesh is not None else 0
