"""ParallelDims: the one owner of parallel degrees, and the DeviceMesh built from them.

The mesh has named axes, outermost first:

    ("pp", "dp_replicate", "dp_shard", "tp")

Ranks are laid out row-major over that shape (Megatron's order): the innermost
axis, tp, holds consecutive ranks, so a tensor-parallel group, which talks on every
layer, stays inside one node; pipeline stages, which only pass activations to
their neighbours, are outermost and go across nodes; data parallelism spreads over
what is left. Axes of size 1 are kept, so code can always ask for `mesh["tp"]`, except
under parallel.tp_mode 2d / 2.5d / 3d, where the tp axis is built as the grid's axes
(tensor_parallel/grid.py: tp_i x tp_j, ...) in its place; `tp_mesh(mesh)` gives either.

Data-parallel ranks = dp_replicate x dp_shard: with ZeRO-3 the parameters are
sharded over dp_shard and replicated over dp_replicate (HSDP); ZeRO-1/2 shard
optimizer state (and gradients) over all of them, on dp_shard; without ZeRO
everything sits on dp_replicate.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from polytrain.config import ParallelConfig
from polytrain.distributed.grid_shape import grid_axes
from polytrain.errors import ConfigError

MESH_AXES = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """Validated parallel degrees for one world size.

    Build with `ParallelDims.from_config(cfg.parallel, world_size)`; degrees that do not
    fit the world fail there with a ConfigError naming the key and the fix. What the
    degrees must also fit (the model, the batch, the pipeline) is checked by the start-up
    layout check (polytrain/train/startup.py).
    """

    world_size: int
    dp_replicate: int
    dp_shard: int
    zero: int
    tp: int = 1
    pp: int = 1
    sp: bool = False
    tp_mode: str = "1d"
    tp_depth: int = 1

    @property
    def dp(self) -> int:
        """Number of data-parallel ranks (each sees different data)."""
        return self.dp_replicate * self.dp_shard

    @property
    def shape(self) -> tuple[int, ...]:
        """Mesh shape in MESH_AXES order."""
        return (self.pp, self.dp_replicate, self.dp_shard, self.tp)

    def coordinates(self, rank: int) -> dict[str, int]:
        """Where global `rank` sits on the mesh: {"pp": ..., "dp_replicate": ..., "dp_shard": ..., "tp": ...}."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world size {self.world_size}")
        coords = {}
        for axis, size in reversed(list(zip(MESH_AXES, self.shape))):
            coords[axis] = rank % size
            rank //= size
        return {axis: coords[axis] for axis in MESH_AXES}

    def groups(self, axis: str) -> list[list[int]]:
        """The rank groups that communicate along `axis` (each group varies only that coordinate)."""
        by_rest: dict[tuple, list[int]] = {}
        for rank in range(self.world_size):
            c = self.coordinates(rank)
            rest = tuple(v for a, v in c.items() if a != axis)
            by_rest.setdefault(rest, []).append(rank)
        return list(by_rest.values())

    @classmethod
    def from_config(cls, p: ParallelConfig, world_size: int) -> ParallelDims:
        """The degrees `p` asks for on `world_size` processes (dp = -1: what tp x pp leave)."""
        _check_model_parallel(p)
        model_parallel = p.tp * p.pp
        if world_size % model_parallel:
            raise ConfigError(
                f"world size {world_size} is not divisible by parallel.tp x parallel.pp = {p.tp} x {p.pp}; "
                f"choose degrees whose product divides it, or set parallel.nproc to a multiple of {model_parallel}"
            )
        dp = p.dp if p.dp != -1 else world_size // model_parallel
        if dp <= 0:
            raise ConfigError(f"parallel.dp = {p.dp} must be positive or -1 (whatever the world size leaves)")
        if dp * model_parallel != world_size:
            raise ConfigError(
                f"parallel.dp = {dp} does not fit world size {world_size} "
                f"(dp x tp x pp must equal it); set parallel.dp = {world_size // model_parallel} or -1"
            )
        if p.zero == 3:
            shard = dp if p.zero_shard == -1 else p.zero_shard
            if shard <= 0 or dp % shard:
                raise ConfigError(
                    f"parallel.zero_shard = {p.zero_shard} must divide parallel.dp = {dp}; "
                    f"choose one of {', '.join(str(d) for d in _divisors(dp))} or -1"
                )
        else:
            if p.zero_shard not in (-1, 1):
                raise ConfigError("parallel.zero_shard only applies with parallel.zero = 3; remove it or set zero = 3")
            shard = dp if p.zero in (1, 2) else 1
        return cls(world_size=world_size, dp_replicate=dp // shard, dp_shard=shard, zero=p.zero,
                   tp=p.tp, pp=p.pp, sp=p.sp, tp_mode=p.tp_mode, tp_depth=p.tp_depth)

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The world's DeviceMesh with named axes; needs an initialised process group.

        A tp grid's axes stand where tp would (innermost): the same ranks, split finer.
        """
        grid = self.tp_axes
        return init_device_mesh(device_type, (*self.shape[:-1], *grid.values()),
                                mesh_dim_names=(*MESH_AXES[:-1], *grid))

    def tp_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The tensor-parallel part of `mesh`: the 1-D tp axis, or the tp grid's axes."""
        return mesh[tuple(self.tp_axes)]

    @property
    def tp_axes(self) -> dict[str, int]:
        """The mesh axes tensor parallelism spans: a grid's under 2d / 2.5d / 3d, else {"tp": tp} (and at tp = 1)."""
        return grid_axes(self.tp_mode if self.tp > 1 else "1d", self.tp, self.tp_depth)


def dp_coordinates(mesh: DeviceMesh) -> tuple[int, int]:
    """(rank, size) of this process among the data-parallel ranks: which slice of each batch it reads."""
    rep, shard = mesh["dp_replicate"], mesh["dp_shard"]
    rank = rep.get_local_rank() * shard.size() + shard.get_local_rank()
    return rank, rep.size() * shard.size()


def _check_model_parallel(p: ParallelConfig) -> None:
    """Degrees and modes that are wrong whatever the world size."""
    for key in ("tp", "pp", "tp_depth", "pp_virtual_stages"):
        if getattr(p, key) < 1:
            raise ConfigError(f"parallel.{key} = {getattr(p, key)} must be at least 1")
    if p.pp_microbatches < 0:
        raise ConfigError(f"parallel.pp_microbatches = {p.pp_microbatches} must be >= 0 (0 = one pipeline run per step)")
    if p.sp and p.tp == 1:
        raise ConfigError("parallel.sp = true splits the sequence over the tensor-parallel ranks; "
                          "it needs parallel.tp > 1")
    if p.tp_depth != 1 and p.tp_mode != "2.5d":
        raise ConfigError("parallel.tp_depth only applies with parallel.tp_mode = '2.5d'")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
