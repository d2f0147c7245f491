"""What the tensor-parallel layers of one model share: the group, the sequence-parallel switch, RNG.

Activations are batch-first, (B, T, D); under sequence parallelism the residual stream
between the tensor-parallel regions is split along T (SEQ_DIM): (B, T/tp, D) per rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ContextManager

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import distribute_tensor
from torch.distributed.tensor.placement_types import Placement

from polytrain.distributed.collectives import (
    copy_to_tp,
    gather_from_sp,
    reduce_from_tp,
    reduce_scatter_to_sp,
)
from polytrain.distributed.rng import DropoutRNG
from polytrain.distributed.tensor_parallel.overlap import RegionCall
from polytrain.distributed.tensor_parallel.cross_entropy import vocab_parallel_logprobs, vocab_parallel_loss
from polytrain.distributed.tensor_parallel.local_shard import local_shard

SEQ_DIM = 1


@dataclass
class TPContext:
    """Shared by every layer `parallelize_tp` installs in one model (or pipeline stage).

    `sp` is the configured sequence parallelism; `sp_active` is whether this forward
    runs it (the root turns it off for incremental decoding, where T may be 1), and
    `full_logits` whether the vocabulary head gathers full logits (decoding samples
    from them). Both are set per forward by the root and reset after it.
    """

    mesh: DeviceMesh
    sp: bool
    dropout: DropoutRNG | None = None
    sp_active: bool = field(init=False)
    full_logits: bool = False
    overlap: bool = False
    """parallel.tp_overlap: regions reduce their input gradient while their columns' weight gradients are computed."""
    region_call: RegionCall | None = field(default=None, repr=False)  # the overlapped region running now
    _params: dict[int, nn.Parameter] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.sp_active = self.sp

    @property
    def group(self):
        return self.mesh.get_group()

    @property
    def size(self) -> int:
        return self.mesh.size()

    @property
    def rank(self) -> int:
        return self.mesh.get_local_rank()

    def distribute(self, param: nn.Parameter, placements: list[Placement]) -> nn.Parameter:
        """`param` as a DTensor parameter on the tp mesh; the same object for a tied parameter.

        Works on the meta device (nothing is allocated) and on real tensors, where every
        rank must hold the same full value and keeps its slice.
        """
        if id(param) not in self._params:
            tensor = distribute_tensor(param.detach(), self.mesh, placements, src_data_rank=None)
            self._params[id(param)] = nn.Parameter(tensor, requires_grad=param.requires_grad)
        return self._params[id(param)]

    def forget_parameters(self) -> None:
        """Drop the tied-parameter memo of `distribute` (call when a model is done)."""
        self._params.clear()

    def loss_fn(self, vocab_size: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """The trainer's loss on the head's vocabulary-split logits (B, T, V/tp); equal on every rank."""
        return vocab_parallel_loss(self.mesh, vocab_size)

    def logprob_fn(self, vocab_size: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """(logits (B, T, V/tp), targets (B, T)) -> log p(targets) (B, T), equal on every rank."""
        return vocab_parallel_logprobs(self.mesh, vocab_size)

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """Into a tensor-parallel region: (B, T/tp, D) all-gathered under SP, else (B, T, D) as is.

        Either way backward sums the gradient over tp: every rank used x with its own
        weight slice.
        """
        if self.sp_active:
            return gather_from_sp(x, SEQ_DIM, self.group)
        return copy_to_tp(x, self.group)

    def leave(self, partial: torch.Tensor) -> torch.Tensor:
        """Out of a region: sum the ranks' partial (B, T, D); under SP keep this rank's (B, T/tp, D)."""
        if self.sp_active:
            self._check_divisible(partial.shape[SEQ_DIM])
            return reduce_scatter_to_sp(partial, SEQ_DIM, self.group)
        return reduce_from_tp(partial, self.group)

    def residual_param(self, param: torch.Tensor) -> torch.Tensor:
        """Local value of a replicated parameter applied to the residual stream (norm gains, row bias).

        Under SP each rank applies it to its own tokens only, so its gradient on each rank
        is a partial sum; copy_to_tp's backward adds them up.
        """
        local = local_shard(param)
        return copy_to_tp(local, self.group) if self.sp_active else local

    def residual_rng(self, training: bool) -> ContextManager:
        """Dropout on the residual stream: shared by the tp group, or per rank when SP shards it."""
        if self.dropout is None or not training:
            return contextlib.nullcontext()
        return self.dropout.fork(sharded=self.sp_active)

    def sharded_rng(self, training: bool) -> ContextManager:
        """Dropout on a tensor only this rank holds (its attention heads): independent per rank."""
        if self.dropout is None or not training:
            return contextlib.nullcontext()
        return self.dropout.fork(sharded=True)

    def _check_divisible(self, seq_len: int) -> None:
        if seq_len % self.size:
            raise ValueError(f"sequence parallelism splits the sequence over tp = {self.size} ranks; "
                             f"length {seq_len} is not a multiple of it")
