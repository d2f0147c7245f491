"""Tied embeddings across pipeline stages, as Megatron does them: two copies kept equal.

With `model.tie_embeddings` the token table (first stage) and the output head (last
stage) are one weight of shape (V, D). A pipeline's stages are separate modules, each
with its own data-parallel strategy (FSDP units) and optimizer, and one Parameter
cannot belong to two of them, so the last stage holds a copy, `output.weight`, next
to the first stage's `tok_embeddings.weight`:

- both start from the embedding's initial values (materialize's `init_as`, COPIES);
- after every step's backward each copy's gradient becomes the sum of both, which is
  the tied weight's gradient in one process, so the two optimizers make the same
  update and the copies stay equal;
- the gradient norm counts the copy's gradient once, and checkpoints hold the
  optimizer state under `tok_embeddings.weight` only, as one process does
  (PipelineDataParallel's `copies`).

The first and last stage sit on different pipeline ranks under gpipe, 1f1b and
interleaved: the two ranks of each data/tensor-parallel coordinate form a process
group for the sum. ZB-V puts both stages on rank 0, where the sum is a local add.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from polytrain.distributed.pipeline.plan import PipelinePlan

EMBEDDING, HEAD = "tok_embeddings.weight", "output.weight"
COPIES = {HEAD: EMBEDDING}
"""Parameter name of a copy -> the name of the weight it copies (the name one process knows)."""


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's storage of `t`: a DTensor's local shard, or `t` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def pair_ranks(mesh: DeviceMesh, first: int, last: int) -> list[list[int]]:
    """Per data/tensor-parallel coordinate, the global ranks at pipeline coordinates `first` and `last`."""
    names = list(mesh.mesh_dim_names)
    ranks = mesh.mesh.movedim(names.index("pp"), 0).reshape(mesh.mesh.shape[names.index("pp")], -1)  # (pp, rest)
    return [[int(ranks[first, c]), int(ranks[last, c])] for c in range(ranks.shape[1])]


class TiedEmbeddings:
    """This rank's copies of the tied weight (the embedding's, the head's, both or none) and the group joining them.

    Construct on every rank: process groups are created collectively. `grad_of(param)`: the
    step's gradient of a copy so far (ZeRO-1/2's fp32 sum of 16-bit gradients; default `param.grad`).
    """

    def __init__(self, stages: nn.ModuleDict, plan: PipelinePlan, mesh: DeviceMesh,
                 grad_of: Callable[[nn.Parameter], torch.Tensor | None] = lambda param: param.grad):
        self.grad_of = grad_of
        last = plan.num_stages - 1
        # The stage modules, not their parameters: materialize gives them new Parameters.
        self.first = stages["0"] if "0" in stages else None
        self.last = stages[str(last)] if str(last) in stages else None
        self.group = None
        first_rank, last_rank = plan.rank_of_stage(0), plan.rank_of_stage(last)
        if first_rank != last_rank:
            for pair in pair_ranks(mesh, first_rank, last_rank):  # the same calls, in order, on every rank
                group = dist.new_group(pair)
                if dist.get_rank() in pair:
                    self.group = group

    @torch.no_grad()
    def sum_gradients(self) -> None:
        """Make each copy's gradient (V, D), or this rank's shard of it, the sum over both copies.

        Call after the step's last backward, when the data-parallel reduction is done.
        """
        embedding = self.first.tok_embeddings.weight if self.first is not None else None
        head = self.last.output.weight if self.last is not None else None
        if not any(w is not None and w.requires_grad for w in (embedding, head)):
            return  # neither copy here, or frozen (a LoRA base): the copies stay equal
        if embedding is not None and head is not None:  # ZB-V: both on this rank
            first, last = _local(self.grad_of(embedding)), _local(self.grad_of(head))
            total = first + last
            first.copy_(total)
            last.copy_(total)
        elif self.group is not None:
            mine = embedding if embedding is not None else head
            # Both copies are laid out alike (the same dp and tp placements of (V, D)) and
            # their gradients in the same dtype, so the two ranks' local tensors match.
            dist.all_reduce(_local(self.grad_of(mine)), group=self.group)
