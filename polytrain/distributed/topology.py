"""ParallelDims: the one owner of parallel degrees, and the DeviceMesh built from them.

The mesh has named axes, outermost first:

    ("pp", "dp_replicate", "dp_shard", "cp", "tp")

Ranks are laid out row-major over that shape (Megatron's order): the innermost
axis, tp, holds consecutive ranks, so a tensor-parallel group, which talks on every
layer, stays inside one node; context parallelism (cp: one sequence split over the
group, attention computed across it) comes next, inside data parallelism, as it
talks on every layer too, but less; pipeline stages, which only pass activations to
their neighbours, are outermost and go across nodes; data parallelism spreads over
what is left. Axes of size 1 are kept, so code can always ask for `mesh["tp"]`, except
under parallel.tp_mode 2d / 2.5d / 3d, where the tp axis is built as the grid's axes
(tensor_parallel/grid.py: tp_i x tp_j, ...) in its place; `tp_mesh(mesh)` gives either.

Data-parallel ranks = dp_replicate x dp_shard: with ZeRO-3 the parameters are
sharded over dp_shard and replicated over dp_replicate (HSDP); ZeRO-1/2 shard
optimizer state (and gradients) over all of them, on dp_shard; without ZeRO
everything sits on dp_replicate. The ranks of a cp group read the same batch (their
dp coordinates agree) but compute different tokens' gradients, so gradients are
reduced over dp x cp: `grad_mesh` gives the 2-D (replicate, shard) mesh FSDP2 runs on,
with cp flattened into the shard axis under ZeRO-3 and into the replicate axis without
ZeRO, and `zero_mesh` the 1-D group of ZeRO-1/2.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from polytrain.config import ParallelConfig
from polytrain.distributed.grid_shape import grid_axes
from polytrain.errors import ConfigError

MESH_AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


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
    tp_overlap: bool = False
    tp_mode: str = "1d"
    tp_depth: int = 1
    cp: int = 1
    cp_mode: str = "ring"
    cp_ulysses: int = 1

    @property
    def dp(self) -> int:
        """Number of data-parallel ranks (each sees different data)."""
        return self.dp_replicate * self.dp_shard

    @property
    def shape(self) -> tuple[int, ...]:
        """Mesh shape in MESH_AXES order."""
        return (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)

    def coordinates(self, rank: int) -> dict[str, int]:
        """Where global `rank` sits on the mesh: {"pp": ..., "dp_replicate": ..., "dp_shard": ..., "cp": ..., "tp": ...}."""
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
        """The degrees `p` asks for on `world_size` processes (dp = -1: what cp x tp x pp leave)."""
        _check_model_parallel(p)
        model_parallel = p.cp * p.tp * p.pp
        if world_size % model_parallel:
            keys, values = ("parallel.tp x parallel.pp", f"{p.tp} x {p.pp}") if p.cp == 1 else \
                ("parallel.cp x parallel.tp x parallel.pp", f"{p.cp} x {p.tp} x {p.pp}")
            raise ConfigError(
                f"world size {world_size} is not divisible by {keys} = {values}; choose degrees whose "
                f"product divides it, or set parallel.nproc to a multiple of {model_parallel}"
            )
        dp = p.dp if p.dp != -1 else world_size // model_parallel
        if dp <= 0:
            raise ConfigError(f"parallel.dp = {p.dp} must be positive or -1 (whatever the world size leaves)")
        if dp * model_parallel != world_size:
            raise ConfigError(
                f"parallel.dp = {dp} does not fit world size {world_size} "
                f"(dp x {'cp x ' if p.cp > 1 else ''}tp x pp must equal it); set parallel.dp = "
                f"{world_size // model_parallel} or -1"
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
                   tp=p.tp, pp=p.pp, sp=p.sp, tp_mode=p.tp_mode, tp_depth=p.tp_depth,
                   # The zero-bubble schedule splits input and weight gradients itself.
                   tp_overlap=p.tp_overlap and not (p.pp > 1 and p.pp_schedule == "zero_bubble"),
                   cp=p.cp, cp_mode=p.cp_mode, cp_ulysses=p.cp_ulysses)

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The world's DeviceMesh with named axes; needs an initialised process group.

        A tp grid's axes stand where tp would (innermost): the same ranks, split finer.
        """
        grid = self.tp_axes
        mesh = init_device_mesh(device_type, (*self.shape[:-1], *grid.values()),
                                mesh_dim_names=(*MESH_AXES[:-1], *grid))
        if self.cp > 1:  # the gradient-reduction axes (grad_mesh, zero_mesh); collective, like the mesh
            mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
            mesh["dp_replicate", "cp"]._flatten("dp_replicate_cp")
        return mesh

    def grad_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The 2-D (replicate, shard) mesh FSDP2 reduces gradients over: the data-parallel axes, and
        with cp > 1 the cp axis flattened into the shard axis (ZeRO-3: parameters sharded over dp_shard
        x cp, as torchtitan's dp_shard_cp) or into the replicate one (no ZeRO: replicas everywhere)."""
        if self.cp == 1:
            return mesh["dp_replicate", "dp_shard"]
        names = ("dp_replicate", "dp_shard_cp") if self.zero == 3 else ("dp_replicate_cp", "dp_shard")
        with warnings.catch_warnings():  # torch asks to keep flattened meshes aside; this is the one place
            warnings.filterwarnings("ignore", message="Slicing a flattened dim")
            return mesh[names]

    def zero_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The 1-D group ZeRO-1/2 shard over: dp_shard (all data-parallel ranks), x cp."""
        if self.cp == 1:
            return mesh["dp_shard"]
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Slicing a flattened dim")
            return mesh["dp_shard_cp"]

    @property
    def grad_ranks(self) -> int:
        """Ranks that share the model's parameters and average their gradients: dp x cp."""
        return self.dp * self.cp

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
    for key in ("tp", "pp", "cp", "cp_ulysses", "tp_depth", "pp_virtual_stages"):
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
