"""The tp ranks as a grid (Colossal-AI's 2D, 2.5D and 3D tensor parallelism): shape, axes, groups.

    mode   grid (mesh axes, outermost first)        tp
    2d     tp_i x tp_j            q x q               q^2      (Xu et al., Optimus / SUMMA)
    2.5d   tp_k x tp_i x tp_j     d x q x q           q^2 d    (Wang et al., Tesseract)
    3d     tp_j x tp_l x tp_i     q x q x q           q^3      (Bian et al.)

The grid replaces the mesh's single "tp" axis (topology.ParallelDims.build_mesh, with the
axes of grid_shape.py): its axes are innermost, so a grid holds the same consecutive ranks a 1D tp group would.
Parameters are DTensors on the grid's sub-mesh with one placement per axis, so
Distributed Checkpoint reshards them to and from 1D and single-device layouts.
`along(axis)` is the group of ranks that differ only in that coordinate: e.g. in 2D,
along("tp_j") is my grid row (same i), along("tp_i") my grid column.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ContextManager

import torch
import torch.nn as nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, distribute_tensor
from torch.distributed.tensor.placement_types import Placement

from polytrain.distributed.collectives import copy_to_tp, reduce_from_tp
from polytrain.distributed.rng import DropoutRNG
from polytrain.distributed.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy


@dataclass
class Grid:
    """What the layers of one model share under a grid mode: its mesh, groups and dropout streams.

    `mesh` is the grid sub-mesh (axes as in grid_axes). The role implementations
    (summa.py, three_d.py) ask it for groups along an axis and for this rank's coordinates.
    """

    mesh: DeviceMesh
    mode: str
    logits_batch_axes: tuple[str, ...]
    """Axes whose coordinates (outermost first) pick the head's batch block of sequences."""
    logits_vocab_axis: str
    """Axis whose coordinate picks the head's vocabulary block."""
    dropout: DropoutRNG | None = None
    _params: dict[int, nn.Parameter] = field(default_factory=dict, repr=False)

    @property
    def q(self) -> int:
        return self.mesh.size(self.axes.index("tp_i"))

    @property
    def axes(self) -> tuple[str, ...]:
        return tuple(self.mesh.mesh_dim_names)

    def size(self, axis: str) -> int:
        return self.mesh.size(self.axes.index(axis)) if axis in self.axes else 1

    def coord(self, axis: str) -> int:
        return self.mesh.get_local_rank(axis) if axis in self.axes else 0

    def along(self, axis: str) -> ProcessGroup | None:
        """Ranks that differ from this one only in `axis`; None for an axis the grid lacks (size 1)."""
        return self.mesh.get_group(axis) if axis in self.axes else None

    def placements(self, **by_axis: Placement) -> list[Placement]:
        """One placement per mesh axis, in mesh order; Replicate where not named."""
        return [by_axis.get(axis, Replicate()) for axis in self.axes]

    def distribute(self, param: nn.Parameter, **by_axis: Placement) -> nn.Parameter:
        """`param` as a DTensor parameter on the grid (memoized, so tied parameters stay one object).

        Meta parameters stay meta; real ones must be equal on every rank, each keeps its block.
        """
        if id(param) not in self._params:
            tensor = distribute_tensor(param.detach(), self.mesh, self.placements(**by_axis), src_data_rank=None)
            self._params[id(param)] = nn.Parameter(tensor, requires_grad=param.requires_grad)
        return self._params[id(param)]

    def shared(self, local: torch.Tensor, *axes: str) -> torch.Tensor:
        """A parameter block that the ranks along `axes` hold alike but apply to different data.

        Forward identity; backward sums the gradient over those ranks (copy_to_tp), so
        every replica of the block gets the same, whole gradient.
        """
        for axis in axes:
            if self.size(axis) > 1:
                local = copy_to_tp(local, self.along(axis))
        return local

    def forget_parameters(self) -> None:
        self._params.clear()

    def rng(self, training: bool) -> ContextManager:
        """Every activation on a grid is this rank's own block: one per-rank dropout stream."""
        if self.dropout is None or not training:
            return contextlib.nullcontext()
        return self.dropout.fork(sharded=True)

    def loss_fn(self, vocab_size: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """The trainer's loss: mean cross-entropy of the head's logits block, equal on every rank.

        logits (b, T, V/n): the sequences of batch block `logits_batch_axes`, vocabulary
        block `logits_vocab_axis` (n ranks). Each block's loss is vocabulary-parallel
        across that axis; the blocks' mean is summed across the batch axes (forward
        all-reduce, backward identity: each rank owns its block's gradient, 1 / blocks).
        """
        parts, block = 1, 0
        for axis in self.logits_batch_axes:
            parts, block = parts * self.size(axis), block * self.size(axis) + self.coord(axis)
        vocab_axis = self.logits_vocab_axis
        start = self.coord(vocab_axis) * vocab_size // self.size(vocab_axis)

        def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            mine = targets.chunk(parts)[block]  # (b, T): the sequences of this rank's logits
            loss = vocab_parallel_cross_entropy(logits, mine, start, self.along(vocab_axis)) / parts
            for axis in self.logits_batch_axes:
                if self.size(axis) > 1:
                    loss = reduce_from_tp(loss, self.along(axis))
            return loss

        return loss_fn
